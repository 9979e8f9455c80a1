"""Driver side: what the workers of one launch send to the driver, polled from each worker.

There is no process in between: while the driver waits for a call's workers, :meth:`RunInbox.pump`
asks each worker for its outbox (:mod:`ray_lightning_sgd._worker_group.outbox`), rank 0 every
:data:`PUMP_INTERVAL_S` and the others every :data:`OTHER_RANKS_INTERVAL_S`, without blocking: a
worker is asked again only once its previous answer is in the driver's memory, and each poll
acknowledges the latest values the driver holds. The driver's own time in callbacks does not count
as any rank's silence. The answers give

- each rank's output lines, printed here tagged ``[rank R]``;
- rank 0's callback events (and functions any rank sent with ``send_to_driver``), replayed into
  the driver's callbacks by a :class:`~ray_lightning_sgd._driver.replay.DriverReplay`;
- the latest resume checkpoint (its bytes in the driver's memory, or its URI) and SIGTERM notices,
  delivered into the launch's :class:`~ray_lightning_sgd._driver.run.Run`;
- how long ago each rank last made progress, for ``progress_timeout_s``.
"""

from __future__ import annotations

import logging
import time

import ray

from ray_lightning_sgd._boundary.channels import EVENTS, OUTPUT, PROGRESS, RESUME, SIGTERM_NOTICE
from ray_lightning_sgd._driver.output import OutputPrinter
from ray_lightning_sgd._driver.replay import DriverReplay
from ray_lightning_sgd._driver.run import Run
from ray_lightning_sgd._worker_group.group import WorkerGroup
from ray_lightning_sgd._worker_group.outbox import Mail
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata, rank_on_node
from ray_lightning_sgd.exceptions import WorkerTimeoutError

log = logging.getLogger(__name__)

#: How often the driver asks rank 0 for its outbox while the workers run (seconds).
PUMP_INTERVAL_S = 0.1
#: How often the driver asks the other ranks (output lines and progress only).
OTHER_RANKS_INTERVAL_S = 0.5
#: How long the driver waits for the workers' last answers after an attempt succeeded.
_LAST_ANSWERS_S = 30.0
#: How long it waits, in all, for a failed attempt's survivors (their mail is a bonus).
_LOST_ANSWERS_S = 2.0


class RunInbox:
    """Driver side: polls the workers of each attempt of one launch and delivers what they send.

    Args:
        replay: Replays rank 0's events and runs sent functions; None for a call without a Trainer.
        progress_timeout_s: Raise :class:`WorkerTimeoutError` when a rank makes no progress for
            this long; None: never.
        run: The launch's state, which receives the resume points and SIGTERM notices.
    """

    def __init__(
        self, replay: DriverReplay | None, progress_timeout_s: float | None, run: Run
    ) -> None:
        self.replay = replay
        self.progress_timeout_s = progress_timeout_s
        self._run = run
        self._printer = OutputPrinter()
        self._group: WorkerGroup | None = None
        self._call_id = ""
        self._asked: dict[int, ray.ObjectRef] = {}
        self._next_ask: dict[int, float] = {}
        # per rank: when the driver last saw it progress (monotonic), and where it was
        self._progress_at: dict[int, float] = {}
        self._last_at: dict[int, tuple[str, int]] = {}
        # per rank: the numbers of the latest values the driver holds, sent with the next poll
        self._acknowledged: dict[int, dict[str, int]] = {}

    def attach(self, group: WorkerGroup, call_id: str) -> None:
        """Driver side: an attempt starts on ``group``; its workers open their outboxes under
        ``call_id``. Every rank's progress clock starts now."""
        now = time.monotonic()
        self._group, self._call_id = group, call_id
        self._asked = {}
        self._next_ask = dict.fromkeys(range(len(group)), now)
        self._progress_at = dict.fromkeys(range(len(group)), now)
        self._last_at = dict.fromkeys(range(len(group)), ("start", 0))
        self._acknowledged = {rank: {} for rank in range(len(group))}

    def pump(self) -> None:
        """Driver side, while the workers run: takes the answers that arrived, asks again those
        whose turn it is, and raises :class:`WorkerTimeoutError` if a rank has gone quiet for
        longer than the timeout. What a function sent by a worker raises comes out here."""
        if self._group is None:
            return
        started = time.monotonic()
        self._take_answers(timeout_s=0.0, run_calls=True)
        now = time.monotonic()
        # the driver's own work (callbacks, sent functions, large mail) is no rank's silence
        busy = now - started
        self._progress_at = {rank: at + busy for rank, at in self._progress_at.items()}
        for rank, due in self._next_ask.items():
            if rank not in self._asked and now >= due:
                self._asked[rank] = self._ask(rank)
                interval = PUMP_INTERVAL_S if rank == 0 else OTHER_RANKS_INTERVAL_S
                self._next_ask[rank] = now + interval
        self._check(now)

    def finish(self) -> None:
        """Driver side: the attempt succeeded; takes every worker's last mail (output, events,
        sent functions) before the call returns."""
        if self._group is None:
            return
        self._last_answers(timeout_s=_LAST_ANSWERS_S, run_calls=True)
        self._group = None

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
        self._group = None

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

    def _ask(self, rank: int) -> ray.ObjectRef:
        if self._group is None:
            raise RuntimeError("RunInbox asks the workers of an attempt only")
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
                continue  # a lost worker: the wait for the call's results reports it
            self._deliver(rank, mail, run_calls)

    def _deliver(self, rank: int, mail: Mail, run_calls: bool) -> None:
        if mail.call_id != self._call_id:
            return  # a warm worker's previous call, or this one not yet begun
        lines = mail.items.get(OUTPUT)
        if lines:
            self._printer.write(rank, lines)
        if RESUME in mail.latest:
            self._run.resume_point_arrived(mail.latest[RESUME])
            # in the driver's memory now: rank 0 trains on once the next poll says so
            self._acknowledged.setdefault(rank, {})[RESUME] = mail.sequences[RESUME]
        if SIGTERM_NOTICE in mail.latest:
            self._run.sigterm_received(rank)
            log.warning("%s received SIGTERM", _rank_on_node(self._run.metadata, rank))
            # the worker ends as soon as the driver holds the notice
            self._acknowledged.setdefault(rank, {})[SIGTERM_NOTICE] = mail.sequences[SIGTERM_NOTICE]
        if PROGRESS in mail.ages:
            self._progress_at[rank] = time.monotonic() - mail.ages[PROGRESS]
        if PROGRESS in mail.latest:
            self._last_at[rank] = mail.latest[PROGRESS]
        blobs = mail.items.get(EVENTS)
        if blobs and self.replay is not None:
            self.replay.replay(blobs, run_calls=run_calls)

    def _check(self, now: float) -> None:
        timeout = self.progress_timeout_s
        if timeout is None:
            return
        quiet = [
            (rank, now - at) for rank, at in sorted(self._progress_at.items()) if now - at > timeout
        ]
        if not quiet:
            return
        ranks = "; ".join(
            f"{_rank_on_node(self._run.metadata, rank)} silent for {seconds:.0f}s, last at "
            f"{self._last_at[rank][0]} step {self._last_at[rank][1]}"
            for rank, seconds in quiet
        )
        raise WorkerTimeoutError(
            f"workers made no progress within progress_timeout_s={timeout}: {ranks}. A deadlock, "
            "an endless loop, or a step, validation or checkpoint longer than the timeout; raise "
            "progress_timeout_s if the work is just slow"
        )


def _rank_on_node(metadata: list[WorkerMetadata], rank: int) -> str:
    return rank_on_node(rank, metadata[rank] if rank < len(metadata) else None)


__all__ = ["OTHER_RANKS_INTERVAL_S", "PUMP_INTERVAL_S", "RunInbox"]
