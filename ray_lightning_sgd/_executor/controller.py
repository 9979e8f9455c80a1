"""The run controller: a call's attempts, its restarts and resizes, and clean-up on every path.

One call of a Trainer entry point is one *run*; each time the workers start and run it is an
*attempt*. The controller starts an executor (new or warm), waits for the attempt while it asks
the run's scaling policy whether to resize, and stops or keeps the executor, then decides what
comes next:

```
NEW -> RUNNING -> SUCCEEDED
        | ^  ^
        | |  +-- RESIZING: the scaling policy decided on other workers (an elastic run with
        | |      room to grow): the attempt ends, the next resumes from the run's resume point
        v |
     RESTARTING: a worker was lost, within max_failures (or max_preemptions): the next
        |        attempt resumes
        v  anything else (a user exception, a stall, the budget spent, Ctrl-C)
      FAILED
```

Only a lost worker (:class:`WorkerDiedError`) is retried, within ``max_failures``, or within
``max_preemptions`` when its node was preempted; a resize counts against neither; an exception
raised by user code on a rank is raised at once, as a retry would raise it again. An error while
stopping the executor never replaces the error that ended the attempt: it is added to it as a
note.

The controller knows nothing of Ray or Lightning: the launcher gives it functions and a policy,
and the tests give it fakes.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ray_lightning_sgd.exceptions import RaySGDError, WorkerDiedError

log = logging.getLogger(__name__)

E = TypeVar("E")  # an executor
R = TypeVar("R")  # an attempt's result
P = TypeVar("P")  # where a restarted attempt resumes from


@dataclass(frozen=True)
class Resize:
    """A scaling policy's decision: end this attempt, and start the next one (from the run's
    resume point) with as many workers as the cluster places then."""

    #: Why, for the driver's log.
    reason: str

    def __str__(self) -> str:
        return self.reason


class ScalingPolicy(Protocol):
    """What the controller asks, while an attempt runs, whether the run should take other
    workers (Ray Train v2's ``ScalingPolicy``); driver side."""

    def decide(self) -> Resize | None:
        """Asked about every ``decide_every_s`` while the attempt runs: a :class:`Resize`
        ends it; None lets it run on."""

    def close(self) -> None:
        """The attempt ended: frees what the policy holds for it."""


class RunState(enum.Enum):
    """Where a run stands."""

    NEW = "new"
    RUNNING = "running"
    RESTARTING = "restarting"
    RESIZING = "resizing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class Attempts(Generic[E, R, P]):
    """What the controller does in each attempt; driver side.

    Args:
        start: Starts (or takes a warm) executor for an attempt that resumes from the given
            point (None: from the start), and sends it the call.
        wait: Waits for the attempt's results up to the given seconds (None: until they are
            in); returns them, or None while the workers still run; raises what ended it.
        stop: Stops the executor, or keeps it warm when the attempt succeeded (the flag); told
            the error that ended the attempt, or None.
        resume_point: After a lost worker or a resize, where the next attempt resumes from
            (None: the start).
    """

    start: Callable[[P | None], E]
    wait: Callable[[E, float | None], R | None]
    stop: Callable[[E, bool, BaseException | None], None]
    resume_point: Callable[[], P | None]


class RunController(Generic[E, R, P]):
    """Driver side: runs a call's attempts until one succeeds, or the run fails.

    Args:
        attempts: How to start, run and stop each attempt.
        max_failures: How many lost-worker restarts are allowed (0: none, -1: no limit), as
            validated by ``RunConfig``; preemptions do not count.
        max_preemptions: How many restarts after a preempted node are allowed (-1: no limit).
        on_restart: Called before each restart with what ended the attempt (a
            :class:`WorkerDiedError` or a :class:`Resize`), how many of its kind so far, and
            the resume point (for the user's log).
        scaling: Asked while an attempt runs whether the run should take other workers; None:
            its size stays.
        decide_every_s: About how often the scaling policy is asked.
    """

    def __init__(
        self,
        attempts: Attempts[E, R, P],
        max_failures: int = 0,
        on_restart: Callable[[WorkerDiedError | Resize, int, P | None], None] | None = None,
        max_preemptions: int = -1,
        scaling: ScalingPolicy | None = None,
        decide_every_s: float = 1.0,
    ) -> None:
        self._attempts = attempts
        self._scaling = scaling
        self._decide_every_s = decide_every_s
        self._max_failures = max_failures
        self._max_preemptions = max_preemptions
        self._on_restart = on_restart
        self.state = RunState.NEW
        #: How many attempts lost a worker (not to a preemption).
        self.failures = 0
        #: How many attempts lost a worker to a preempted node.
        self.preemptions = 0
        #: How many attempts ended to resize.
        self.resizes = 0

    def run(self, resume: P | None = None) -> R:
        """Runs attempts until one succeeds (returns its result) or the run fails (raises); the
        first attempt resumes from ``resume`` (None: from the start)."""
        if self.state is not RunState.NEW:
            raise RaySGDError(f"a run controller runs once; this one is {self.state.value}")
        while True:
            self.state = RunState.RUNNING
            try:
                outcome = self._attempt(resume)
            except WorkerDiedError as err:
                if err.preempted:
                    self.preemptions += 1
                    count = self.preemptions
                else:
                    self.failures += 1
                    count = self.failures
                if not self._may_restart():
                    self.state = RunState.FAILED
                    raise
                resume = self._next(RunState.RESTARTING, err, count)
                continue
            except BaseException:
                self.state = RunState.FAILED
                raise
            if isinstance(outcome, Resize):
                self.resizes += 1
                resume = self._next(RunState.RESIZING, outcome, self.resizes)
                continue
            self.state = RunState.SUCCEEDED
            return outcome

    def _next(self, state: RunState, cause: WorkerDiedError | Resize, count: int) -> P | None:
        """Between two attempts: where the next one resumes from, told to ``on_restart``."""
        self.state = state
        try:
            resume = self._attempts.resume_point()
        except BaseException:
            self.state = RunState.FAILED
            raise
        if self._on_restart is not None:
            self._on_restart(cause, count, resume)
        return resume

    def _may_restart(self) -> bool:
        failures_ok = self._max_failures == -1 or self.failures <= self._max_failures
        preemptions_ok = self._max_preemptions == -1 or self.preemptions <= self._max_preemptions
        return failures_ok and preemptions_ok

    def _attempt(self, resume: P | None) -> R | Resize:
        """One attempt: its results, or the scaling policy's decision that ended it."""
        executor = self._attempts.start(resume)
        try:
            outcome = self._wait(executor)
        except BaseException as err:
            # after a failure the survivors may be stuck in a collective: the executor is killed
            try:
                self._stop(executor, succeeded=False, error=err)
            finally:  # also when an interrupt lands while the workers stop
                self._close_scaling(err)
            raise
        # a resized attempt's workers are mid-training: stopped, never kept
        resized = isinstance(outcome, Resize)
        try:
            self._stop(
                executor, succeeded=not resized, error=None, after="resize" if resized else "call"
            )
        finally:
            self._close_scaling(None)
        return outcome

    def _close_scaling(self, error: BaseException | None) -> None:
        """The attempt ended: the scaling policy frees what it holds for it. What fails here
        never replaces the attempt's error, nor its results."""
        if self._scaling is None:
            return
        try:
            self._scaling.close()
        except Exception as close_error:  # noqa: BLE001 - a cluster's error, whatever it is
            if error is not None:
                error.add_note(f"Closing the scaling policy afterwards failed too: {close_error!r}")
            log.warning("Could not close the scaling policy after the attempt: %s", close_error)

    def _wait(self, executor: E) -> R | Resize:
        if self._scaling is None:
            result = self._attempts.wait(executor, None)
            if result is None:
                raise RaySGDError("an attempt waited for without a time limit returned nothing")
            return result
        while True:
            result = self._attempts.wait(executor, self._decide_every_s)
            if result is not None:
                return result
            decision = self._scaling.decide()
            if decision is not None:
                return decision

    def _stop(
        self, executor: E, succeeded: bool, error: BaseException | None, after: str = "call"
    ) -> None:
        try:
            self._attempts.stop(executor, succeeded, error)
        except Exception as stop_error:
            if error is not None:
                # the error that ended the attempt is the one worth raising
                error.add_note(f"Stopping the workers afterwards failed too: {stop_error!r}")
                log.debug("Stopping the workers after a failed attempt failed", exc_info=True)
            else:
                # the call succeeded (or resizes): its results stand; only stopping failed
                log.warning(
                    "Could not keep or stop the workers after the %s: %s", after, stop_error
                )


__all__ = ["Attempts", "Resize", "RunController", "RunState", "ScalingPolicy"]
