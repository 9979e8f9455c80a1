"""Driver side: what the workers of one launch send to the driver, polled from each worker.

There is no process in between: while the driver waits for a call's workers, :meth:`RunInbox.pump`
asks each worker for its outbox (:mod:`ray_lightning_sgd._worker_group.outbox`) without blocking:
rank 0 every :data:`PUMP_INTERVAL_S` while the driver shows its events live (a progress bar, driver
callbacks), else every :data:`OTHER_RANKS_INTERVAL_S`; the other ranks every
:data:`OTHER_RANKS_INTERVAL_S`, or less often in a larger group, where they are asked
:data:`OTHER_RANKS_PER_S` times a second together, so the driver's polls do not grow with the
number of workers. What cannot wait for a rank's turn comes through a standing question the
driver holds on every other rank (``news``, answered by the worker's own thread for it, see
:meth:`~ray_lightning_sgd._worker_group.outbox.Outbox.wait_news`): a rank that received SIGTERM
answers it at once and is polled at once, and again once its notice arrived, so that it hears at
once that the driver holds it; a rank with output lines or functions sent to the driver answers
it after :data:`OTHER_RANKS_INTERVAL_S`; the driver asks it again after that poll's answer. A
rank that looks silent past ``progress_timeout_s`` is polled at once, and only an answer that
shows it silent (or no answer) fails the call. A worker is asked again only once its previous
answer is in the driver's memory, and each poll acknowledges the latest values the driver holds.
The driver's own time in callbacks does not count as any rank's silence. The answers give

- each rank's output lines, printed here tagged ``[rank R]``;
- rank 0's callback events (and functions any rank sent with ``send_to_driver``), replayed into
  the driver's callbacks by a :class:`~ray_lightning_sgd._driver.replay.DriverReplay`;
- the latest resume checkpoint (its bytes in the driver's memory, or its URI) and SIGTERM notices,
  delivered into the launch's :class:`~ray_lightning_sgd._driver.run.Run`;
- how long ago each rank last made progress, for ``progress_timeout_s`` and the hang report: when
  no rank has made progress for ``hang_report_after_s`` (by default 20 times the longest wait
  between two of a rank's progress reports so far, at least :data:`HANG_REPORT_FLOOR_S`), every
  rank's stack is logged once (:mod:`.stacks`).

Every rank's stack is also there on demand: :meth:`RunInbox.stacks` (``worker_stacks()`` of the
strategy) and, printed to stderr, SIGUSR1 to the driver (:meth:`RunInbox.print_stacks`).
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import ray

from ray_lightning_sgd._boundary.channels import (
    EVENTS,
    LOGGERS,
    OUTPUT,
    PROGRESS,
    RESUME,
    SIGTERM_NOTICE,
    TIMINGS,
)
from ray_lightning_sgd._driver.output import OutputPrinter
from ray_lightning_sgd._driver.replay import DriverReplay
from ray_lightning_sgd._driver.run import Run
from ray_lightning_sgd._driver.stacks import CALL_ENDED, RankStack, report
from ray_lightning_sgd._driver.stragglers import StragglerWatch
from ray_lightning_sgd._worker_group.group import WorkerGroup
from ray_lightning_sgd._worker_group.outbox import Mail
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata, rank_on_node
from ray_lightning_sgd.exceptions import WorkerGroupError, WorkerTimeoutError

log = logging.getLogger(__name__)

#: How often the driver looks at the answers and asks rank 0 for its outbox while the workers
#: run and the driver shows rank 0's events live (seconds).
PUMP_INTERVAL_S = 0.1
#: How often the driver asks each other rank in its turn at most (more often only when its news
#: question or a silence past ``progress_timeout_s`` asks for it), and rank 0 when nothing on the
#: driver shows its events live.
OTHER_RANKS_INTERVAL_S = 0.5
#: How many polls a second the ranks other than 0 get together, at most: from 6 workers on, each
#: other rank is asked every ``(workers - 1) / OTHER_RANKS_PER_S`` seconds (what cannot wait comes
#: through the standing ``news`` question).
OTHER_RANKS_PER_S = 10.0
#: A poll unanswered (or polls failing) for this long show a silent rank as silent (its worker
#: cannot answer).
_UNANSWERED_S = 5.0
#: How long after a news question failed (a worker briefly unreachable) it is put again.
_NEWS_RETRY_S = 1.0
#: How often the driver looks for ranks silent too long (seconds).
_CHECK_EVERY_S = 0.5
#: A pump running this long when SIGUSR1 comes: the report shows the driver's own stack too.
_DRIVER_BUSY_SHOWN_S = 1.0
#: A pump at least this long is a busy spell of the driver's whose time comes off the ages the
#: ranks report (shorter ones: at most a few percent of an age, left in it).
_BUSY_SPELL_S = 0.05
#: The busy spells kept for that (the latest).
_BUSY_SPELLS_KEPT = 256
#: How long the driver waits for the workers' last answers after an attempt succeeded.
_LAST_ANSWERS_S = 30.0
#: How long it waits, in all, for a failed attempt's survivors (their mail is a bonus).
_LOST_ANSWERS_S = 2.0
#: The automatic hang report comes after this many times the longest wait between two progress
#: reports of a rank (a step, a validation batch) in the call so far...
HANG_REPORT_FACTOR = 20
#: ... and never before this many seconds without progress on any rank.
HANG_REPORT_FLOOR_S = 300.0
#: How long the driver waits for the workers' stacks.
STACKS_WAIT_S = 10.0


def in_order(mail: Mail, channels: tuple[str, ...]) -> Iterator[tuple[str, list[Any]]]:
    """The items of ``channels`` in a mail, in the order the worker added them: runs of one
    channel each (a mail without that order: each channel's items, channel by channel)."""
    taken = dict.fromkeys(channels, 0)
    for channel, count in mail.order:
        if channel in taken:
            start = taken[channel]
            taken[channel] += count
            chunk = mail.items.get(channel, [])[start : start + count]
            if chunk:
                yield channel, chunk
    for channel in channels:
        rest = mail.items.get(channel, [])[taken[channel] :]
        if rest:
            yield channel, rest


class RunInbox:
    """Driver side: polls the workers of each attempt of one launch and delivers what they send.

    Args:
        replay: Replays rank 0's events and runs sent functions; None for a call without a Trainer.
        progress_timeout_s: Raise :class:`WorkerTimeoutError` when a rank makes no progress for
            this long; None: never.
        run: The launch's state, which receives the resume points and SIGTERM notices.
        hang_report_after_s: Log every rank's stack once when no rank has made progress for
            this long; None: the automatic window (see the module's docstring).
        log_folder: Where each rank's output is also written, one file a rank; None: nowhere.
    """

    def __init__(
        self,
        replay: DriverReplay | None,
        progress_timeout_s: float | None,
        run: Run,
        hang_report_after_s: float | None = None,
        log_folder: str | None = None,
    ) -> None:
        self.replay = replay
        self.progress_timeout_s = progress_timeout_s
        self.hang_report_after_s = hang_report_after_s
        # the longest wait between two progress reports of a rank (as the ranks measure them),
        # and whether the hang report was logged since the last progress
        self._longest_wait = 0.0
        self._hang_reported = False
        #: The running attempt's step times by rank, and its straggler.
        self.stragglers = StragglerWatch()
        self._run = run
        self._printer = OutputPrinter(log_folder)
        self._group: WorkerGroup | None = None
        self._call_id = ""
        self._asked: dict[int, ray.ObjectRef] = {}
        # when each rank was last asked, and last answered (the silences' clock)
        self._asked_at: dict[int, float] = {}
        self._answered_at: dict[int, float] = {}
        self._failing_since: dict[int, float] = {}  # since when each rank's polls fail
        self._done: set[int] = set()  # the ranks whose call has ended: silent by right
        # the standing news questions (one per rank), the ranks whose answer came
        # (with the attempt they belong to; appended by Ray's callback thread), and the ranks
        # to ask again once their poll's answer arrived
        self._attempt = 0
        self._news: dict[int, ray.ObjectRef] = {}
        self._news_came: collections.deque[tuple[int, int, bool]] = collections.deque()
        self._ask_news_again: set[int] = set()
        self._news_retry: dict[int, float] = {}  # rank -> when its failed question is put again
        # (when, rank) of each rank's next poll, the soonest first
        self._next_ask: list[tuple[float, int]] = []
        self._intervals = (OTHER_RANKS_INTERVAL_S, OTHER_RANKS_INTERVAL_S)
        # the driver's own busy time so far: the clock that ranks' silences are measured on
        # runs without it
        self._busy_s = 0.0
        # its long busy spells (a driver callback, a sent function: wall start and end), and
        # when the running pump began (None outside one): a rank's reported age spans them
        self._busy_spells: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=_BUSY_SPELLS_KEPT
        )
        self._pump_started: float | None = None
        self._printing = threading.Lock()
        self._checked_at = 0.0
        # per rank: when the driver last saw it progress (monotonic), and where it was
        self._progress_at: dict[int, float] = {}
        self._last_at: dict[int, tuple[str, int]] = {}
        # per rank: the numbers of the latest values the driver holds, sent with the next poll
        self._acknowledged: dict[int, dict[str, int]] = {}

    def attach(self, group: WorkerGroup, call_id: str) -> None:
        """Driver side: an attempt starts on ``group``; its workers open their outboxes under
        ``call_id``. Every rank's progress clock starts now."""
        now = self._now()
        self._group, self._call_id = group, call_id
        self._asked, self._asked_at, self._answered_at = {}, {}, {}
        self._failing_since = {}
        self._done = set()
        self._attempt += 1
        self._news, self._ask_news_again, self._news_retry = {}, set(), {}
        self._news_came.clear()
        live = self.replay is not None and self.replay.shows_live
        others = max(OTHER_RANKS_INTERVAL_S, (len(group) - 1) / OTHER_RANKS_PER_S)
        self._intervals = (PUMP_INTERVAL_S if live else OTHER_RANKS_INTERVAL_S, others)
        # the other ranks' first polls spread over one interval: never all of them at once
        spread = others / max(1, len(group) - 1)
        asked_at = self._wall()  # polls keep wall time; silences the driver's clock
        self._next_ask = [
            (asked_at + max(0, rank - 1) * spread, rank) for rank in range(len(group))
        ]
        self._progress_at = dict.fromkeys(range(len(group)), now)
        self._last_at = {}  # a rank's first progress report fills it
        self._acknowledged = {rank: {} for rank in range(len(group))}
        self._hang_reported = False
        self.stragglers = StragglerWatch()
        for rank, meta in enumerate(self._run.metadata):  # each file says whose output it is
            self._printer.note(
                rank,
                f"=== call {call_id}: {rank_on_node(rank, meta, len(group))}; output of C++ code "
                "(NCCL_DEBUG, TORCH_CPP_LOG_LEVEL) goes to Ray's log of this worker on its node "
                f"(the files ending in -{meta.pid}.out and .err in the session's logs folder, "
                "/tmp/ray/session_latest/logs by default) ===",
            )
        # rank 0 is polled often anyway; its question brings its resume points at once
        for rank in range(len(group)):
            self._ask_news(rank)

    def _ask_news(self, rank: int) -> None:
        """Puts the standing question to ``rank``: its answer (True) lands in the news."""
        group = self._group
        if group is None:
            return
        attempt = self._attempt
        ref = group.news_async(rank, self._call_id, OTHER_RANKS_INTERVAL_S)
        self._news[rank] = ref  # held until it is asked again or the attempt ends

        def answered(future: Future) -> None:  # in Ray's thread: only note it
            failed = future.exception() is not None
            if failed or future.result():
                self._news_came.append((attempt, rank, failed))

        ref.future().add_done_callback(answered)

    def stacks(self, timeout_s: float = STACKS_WAIT_S) -> list[RankStack]:
        """Driver side, any thread: every rank's stack of its training thread now, with its
        node, its last progress and the hook it is in; [] when no attempt runs."""
        group = self._group
        if group is None:
            return []
        try:
            refs = {rank: group.stack_async(rank) for rank in range(len(group))}
        except (WorkerGroupError, IndexError):  # the attempt ended meanwhile (main thread)
            return []
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        answered = set(ready)
        stacks = []
        for rank, ref in refs.items():
            stack, missing = None, f"no answer within {timeout_s:g} s"
            if ref in answered:
                try:
                    stack = ray.get(ref)
                    missing = "" if stack is not None else _no_call(rank in self._done)
                except ray.exceptions.RayError as err:
                    missing = f"the worker is lost ({type(err).__name__})"
            where = _rank_on_node(self._run.metadata, rank)
            stacks.append(RankStack(rank, where, self._last_at.get(rank), stack, missing))
        return stacks

    def print_stacks(self) -> None:
        """Driver side, any thread: :meth:`_print_stacks`, one report at a time (a burst of
        SIGUSR1 gives one)."""
        if not self._printing.acquire(blocking=False):
            return
        try:
            self._print_stacks()
        finally:
            self._printing.release()

    def _print_stacks(self) -> None:
        """Driver side, any thread (SIGUSR1 starts one): prints every rank's stack to stderr,
        and the driver's own main thread's when it has been busy for a while (a driver callback
        or a function a worker sent: no pump runs then)."""
        why = "Every rank's stack (SIGUSR1):"
        started = self._pump_started
        if started is not None and self._wall() - started >= _DRIVER_BUSY_SHOWN_S:
            frame = sys._current_frames().get(threading.main_thread().ident or -1)
            where = "".join(traceback.format_stack(frame)) if frame is not None else ""
            why += (
                f"\nThe driver itself has been busy for {self._wall() - started:.0f} s (a "
                f"driver callback, or a function a worker sent), at:\n{where.rstrip()}"
            )
        if self._group is None:
            why += (
                " no attempt runs now (its workers are starting, or the run is between "
                "attempts); ask again in a moment"
            )
            print(why, file=sys.stderr, flush=True)
            return
        print(report(self.stacks(), why), file=sys.stderr, flush=True)

    def pump(self) -> None:
        """Driver side, while the workers run: takes the answers that arrived, asks again those
        whose turn it is, and raises :class:`WorkerTimeoutError` if a rank has gone quiet for
        longer than the timeout. What a function sent by a worker raises comes out here."""
        if self._group is None:
            return
        started = self._pump_started = self._wall()
        try:
            self._take_answers(timeout_s=0.0, run_calls=True)
        finally:
            self._pump_started = None
            # the driver's own work (callbacks, sent functions, large mail) is no rank's silence
            wall = self._wall()
            self._busy_s += wall - started
            if wall - started >= _BUSY_SPELL_S:
                self._busy_spells.append((started, wall))
        now = self._now()
        for rank in [r for r in self._ask_news_again if r not in self._asked]:
            self._ask_news_again.discard(rank)  # the poll's answer came: news from now on
            self._ask_news(rank)
        while self._news_came:
            attempt, rank, failed = self._news_came.popleft()
            if attempt != self._attempt:
                continue
            if failed:  # a lost worker fails the attempt; a worker briefly unreachable is asked
                self._news_retry[rank] = wall + _NEWS_RETRY_S  # again in a moment
            else:
                self._ask_now(rank)
                self._ask_news_again.add(rank)
        for rank, due in list(self._news_retry.items()):
            if due <= wall:
                del self._news_retry[rank]
                self._ask_news(rank)
        while self._next_ask and self._next_ask[0][0] <= wall:
            due, rank = heapq.heappop(self._next_ask)
            if rank not in self._asked:  # else its answer is still on its way: ask later
                self._asked[rank] = self._ask(rank)
            # each rank keeps its place in the spread, unless the driver fell behind
            heapq.heappush(self._next_ask, (max(due + self._intervals[rank > 0], wall), rank))
        if now - self._checked_at >= _CHECK_EVERY_S:
            self._checked_at = now
            self._check(now)

    def _wall(self) -> float:
        """The clock of the polls' schedule: monotonic time."""
        return time.monotonic()

    def _now(self, age_s: float = 0.0) -> float:
        """The clock of ranks' silences: monotonic time, less the driver's own busy time; with
        ``age_s``, the moment that long before the answers were taken (an age a worker measured
        in real time, by then). Inside a pump that is the pump's start: it takes every answer
        it handles at once, before any of them runs a callback. The driver's busy spells after
        that moment come off the age: a rank that waited for the driver (its resume checkpoint
        taken, a driver callback) was not silent."""
        taken = self._wall() if self._pump_started is None else self._pump_started
        then = taken - age_s
        credit = sum(
            max(0.0, min(end, taken) - max(start, then)) for start, end in self._busy_spells
        )
        return then + credit - self._busy_s  # the busy time up to the last pump's end

    def finish(self) -> None:
        """Driver side: the attempt succeeded; takes every worker's last mail (output, events,
        sent functions) before the call returns."""
        if self._group is None:
            return
        self._last_answers(timeout_s=_LAST_ANSWERS_S, run_calls=True)
        self._warn_of_straggler()  # a call too short for a poll to see it
        self._end_attempt()

    def abandon(self) -> None:
        """Driver side: the attempt failed or was lost; takes what the survivors left within a
        moment (their output and events), but runs none of the functions they sent. Raises
        nothing but an interrupt."""
        if self._group is None:
            return
        try:
            self._last_answers(timeout_s=_LOST_ANSWERS_S, run_calls=False)
        except Exception:
            log.debug("Could not take the last mail of a failed attempt", exc_info=True)
        self._asked = {}
        self._end_attempt()

    def _end_attempt(self) -> None:
        # the news questions end with the call on each worker (or with the worker)
        self._group, self._news, self._ask_news_again, self._news_retry = None, {}, set(), {}
        self._attempt += 1

    def _last_answers(self, timeout_s: float, run_calls: bool) -> None:
        # the answers on their way may predate the last mail: take them, then ask every rank again
        if self._group is None:
            return
        deadline = time.monotonic() + timeout_s
        self._take_answers(timeout_s=timeout_s, run_calls=run_calls)
        for rank in range(len(self._group)):
            if rank not in self._asked:  # an unanswered poll is still the one to wait for
                self._asked[rank] = self._ask(rank)
        self._take_answers(max(0.0, deadline - time.monotonic()), run_calls=run_calls)

    def _ask_now(self, rank: int) -> None:
        """Asks ``rank`` at once, out of its turn, unless a poll of it is on its way."""
        group = self._group
        if group is not None and 0 <= rank < len(group) and rank not in self._asked:
            self._asked[rank] = self._ask(rank)

    def _ask(self, rank: int) -> ray.ObjectRef:
        if self._group is None:
            raise RuntimeError("RunInbox asks the workers of an attempt only")
        self._asked_at[rank] = self._now()
        return self._group.poll_async(rank, dict(self._acknowledged.get(rank, {})))

    def _take_answers(self, timeout_s: float, run_calls: bool) -> None:
        if not self._asked:
            return
        refs = list(self._asked.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready_set = set(ready)
        answered = [(rank, ref) for rank, ref in sorted(self._asked.items()) if ref in ready_set]
        for rank, _ref in answered:
            del self._asked[rank]
        for rank, ref in answered:
            try:
                mail = ray.get(ref)
            except ray.exceptions.RayError:
                # a lost worker: the wait for the call's results reports it; polls that fail
                # for long count as unanswered ones for a silence
                self._failing_since.setdefault(rank, self._now())
                continue
            self._deliver(rank, mail, run_calls)

    def _deliver(self, rank: int, mail: Mail, run_calls: bool) -> None:
        # an answer shows the rank as it is now, even before its call began there
        self._answered_at[rank] = self._now()
        self._failing_since.pop(rank, None)
        if mail.call_id != self._call_id:
            return  # a warm worker's previous call, or this one not yet begun
        if not mail.running:
            self._done.add(rank)  # its result waits: it makes no more progress, by right
        if LOGGERS in mail.latest:
            self._run.loggers_reported(*mail.latest[LOGGERS])
            # rank 0 waits for this at a call's setup, until the next poll says so
            self._acknowledged.setdefault(rank, {})[LOGGERS] = mail.sequences[LOGGERS]
        if RESUME in mail.latest:
            self._run.resume_point_arrived(mail.latest[RESUME])
            # in the driver's memory now: rank 0 trains on once the next poll says so
            self._acknowledged.setdefault(rank, {})[RESUME] = mail.sequences[RESUME]
        if SIGTERM_NOTICE in mail.latest:
            self._run.sigterm_received(rank)
            log.warning("%s received SIGTERM", _rank_on_node(self._run.metadata, rank))
            # the worker ends as soon as the driver holds the notice: the next poll says so
            self._acknowledged.setdefault(rank, {})[SIGTERM_NOTICE] = mail.sequences[SIGTERM_NOTICE]
            self._ask_now(rank)
        if PROGRESS in mail.latest:  # a new report since the last poll
            # its age when the worker answered, less the driver's busy time within it
            at = self._now(mail.ages[PROGRESS])
            stage, step, *longest = mail.latest[PROGRESS]
            if longest:
                self._longest_wait = max(self._longest_wait, longest[0])
            self._progress_at[rank] = at
            self._last_at[rank] = (stage, step)
        if TIMINGS in mail.latest:
            where = _rank_on_node(self._run.metadata, rank)
            self.stragglers.update(rank, where, *mail.latest[TIMINGS])
        # output lines and rank 0's events in the order they happened on the worker
        chunks = list(in_order(mail, (OUTPUT, EVENTS)))
        for index, (channel, chunk) in enumerate(chunks):
            if channel == OUTPUT:
                self._printer.write(rank, chunk)
            elif self.replay is not None:
                try:
                    self.replay.replay(chunk, run_calls=run_calls)
                except BaseException:  # a sent function raised: the rank's lines still show
                    for later, lines in chunks[index + 1 :]:
                        if later == OUTPUT:
                            self._printer.write(rank, lines)
                    raise

    def hang_window_s(self) -> float:
        """After how long without progress on any rank the hang report comes."""
        if self.hang_report_after_s is not None:
            return self.hang_report_after_s
        return max(HANG_REPORT_FLOOR_S, HANG_REPORT_FACTOR * self._longest_wait)

    def _warn_of_straggler(self) -> None:
        straggler = self.stragglers.straggler()
        if straggler is not None:
            log.warning("%s", straggler)

    def _check(self, now: float) -> None:
        self._warn_of_straggler()
        if self._progress_at:
            still = min(now - at for at in self._progress_at.values())  # the latest progress
            window = self.hang_window_s()
            if still < window:
                self._hang_reported = False
            elif not self._hang_reported:
                self._hang_reported = True
                why = (
                    f"No rank has made progress for {still:.0f} s (hang_report_after_s="
                    f"{self.hang_report_after_s if self.hang_report_after_s is not None else 'auto'}"
                    f": {window:.0f} s). Every rank's stack:"
                )
                log.warning("%s", report(self.stacks(), why))
        timeout = self.progress_timeout_s
        if timeout is None:
            return
        quiet = []
        for rank, at in sorted(self._progress_at.items()):
            if now - at <= timeout or rank in self._done:
                continue
            # what the driver knows may be old (a large group's ranks are asked seldom): only
            # an answer that shows the silence, or polls unanswered or failing for
            # _UNANSWERED_S, end the call
            known_at = self._answered_at.get(rank, -math.inf)
            if rank in self._asked and now - self._asked_at.get(rank, now) > _UNANSWERED_S:
                known_at = now
            if now - self._failing_since.get(rank, now) > _UNANSWERED_S:
                known_at = now
            if known_at - at > timeout:
                quiet.append((rank, now - at))
            else:
                self._ask_now(rank)
        if not quiet:
            return
        ranks = "; ".join(
            f"{_rank_on_node(self._run.metadata, rank)} silent for {seconds:.0f}s, "
            + (
                f"last at {self._last_at[rank][0]} step {self._last_at[rank][1]}"
                if rank in self._last_at
                else "no progress reported since its attempt began"
            )
            for rank, seconds in quiet
        )
        stacks = self.stacks()
        raise WorkerTimeoutError(
            f"workers made no progress within progress_timeout_s={timeout}: {ranks}. A deadlock, "
            "an endless loop, or a step, validation or checkpoint longer than the timeout; raise "
            "progress_timeout_s if the work is just slow.\n"
            + report(stacks, "Every rank's stack at the timeout:"),
            stacks=stacks,
        )


def _rank_on_node(metadata: list[WorkerMetadata], rank: int) -> str:
    return rank_on_node(rank, metadata[rank] if rank < len(metadata) else None)


def _no_call(ended: bool) -> str:
    """Why a rank's worker gave no stack though it answered: its call ended (a poll of this
    attempt said so), or none runs there yet."""
    if ended:
        return CALL_ENDED
    return "no call runs there yet (the call has not reached the worker, or the worker is busy)"


__all__ = ["OTHER_RANKS_INTERVAL_S", "PUMP_INTERVAL_S", "RunInbox"]
