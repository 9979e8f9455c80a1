"""The run controller: a call's attempts, its restarts and their budget, and clean-up on every path.

One call of a Trainer entry point is one *run*; each time the workers start and run it is an
*attempt*. The controller starts an executor (new or warm), runs the attempt, and stops or keeps
the executor, then decides what comes next from what the attempt raised:

```
NEW -> RUNNING -> SUCCEEDED
          |  ^
          v  |  a worker was lost, within max_failures; or the attempt asked to regroup (an
          |  |  elastic run with room to grow): the next attempt resumes
       RESTARTING
          |
          v  anything else (a user exception, a stall, the budget spent, Ctrl-C)
        FAILED
```

Only a lost worker (:class:`WorkerDiedError`) is retried, within ``max_failures``, or within
``max_preemptions`` when Ray reported its node preempted; an attempt that raises :class:`Regroup`
restarts without counting against either; an exception raised by user code on a
rank is raised at once, as a retry would raise it again. An error while stopping the executor never
replaces the error that ended the attempt: it is added to it as a note.

The controller knows nothing of Ray or Lightning: the launcher gives it functions, and the tests
give it fakes.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ray_lightning_sgd.exceptions import RaySGDError, WorkerDiedError

log = logging.getLogger(__name__)

E = TypeVar("E")  # an executor
R = TypeVar("R")  # an attempt's result
P = TypeVar("P")  # where a restarted attempt resumes from


class Regroup(Exception):
    """Raised by an attempt that should end so that the next one starts with other workers (an
    elastic run that can grow); not a failure."""


class RunState(enum.Enum):
    """Where a run stands."""

    NEW = "new"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class Attempts(Generic[E, R, P]):
    """What the controller does in each attempt; driver side.

    Args:
        start: Starts (or takes a warm) executor for an attempt that resumes from the given
            point (None: from the start).
        run: Runs the call on the executor's workers; returns their results.
        stop: Stops the executor, or keeps it warm when the attempt succeeded (the flag).
        resume_point: After a lost worker, where the next attempt resumes from (None: the start).
    """

    start: Callable[[P | None], E]
    run: Callable[[E], R]
    stop: Callable[[E, bool], None]
    resume_point: Callable[[], P | None]


class RunController(Generic[E, R, P]):
    """Driver side: runs a call's attempts until one succeeds, or the run fails.

    Args:
        attempts: How to start, run and stop each attempt.
        max_failures: How many lost-worker restarts are allowed (0: none, -1: no limit), as
            validated by ``FailureConfig``; preemptions do not count.
        max_preemptions: How many restarts after a preempted node are allowed (-1: no limit).
        on_restart: Called before each restart with what ended the attempt (a
            :class:`WorkerDiedError` or a :class:`Regroup`), how many of its kind so far, and
            the resume point (for the user's log).
    """

    def __init__(
        self,
        attempts: Attempts[E, R, P],
        max_failures: int = 0,
        on_restart: Callable[[WorkerDiedError | Regroup, int, P | None], None] | None = None,
        max_preemptions: int = -1,
    ) -> None:
        self._attempts = attempts
        self._max_failures = max_failures
        self._max_preemptions = max_preemptions
        self._on_restart = on_restart
        self.state = RunState.NEW
        #: How many attempts lost a worker (not to a preemption).
        self.failures = 0
        #: How many attempts lost a worker to a preempted node.
        self.preemptions = 0
        #: How many attempts ended to regroup.
        self.regroups = 0

    def run(self, resume: P | None = None) -> R:
        """Runs attempts until one succeeds (returns its result) or the run fails (raises); the
        first attempt resumes from ``resume`` (None: from the start)."""
        if self.state is not RunState.NEW:
            raise RaySGDError(f"a run controller runs once; this one is {self.state.value}")
        while True:
            self.state = RunState.RUNNING
            try:
                result = self._attempt(resume)
            except (WorkerDiedError, Regroup) as err:
                if isinstance(err, Regroup):
                    self.regroups += 1
                    count = self.regroups
                elif err.preempted:
                    self.preemptions += 1
                    count = self.preemptions
                else:
                    self.failures += 1
                    count = self.failures
                if not self._may_restart():
                    self.state = RunState.FAILED
                    raise
                self.state = RunState.RESTARTING
                try:
                    resume = self._attempts.resume_point()
                except BaseException:
                    self.state = RunState.FAILED
                    raise
                if self._on_restart is not None:
                    self._on_restart(err, count, resume)
                continue
            except BaseException:
                self.state = RunState.FAILED
                raise
            self.state = RunState.SUCCEEDED
            return result

    def _may_restart(self) -> bool:
        failures_ok = self._max_failures == -1 or self.failures <= self._max_failures
        preemptions_ok = self._max_preemptions == -1 or self.preemptions <= self._max_preemptions
        return failures_ok and preemptions_ok

    def _attempt(self, resume: P | None) -> R:
        executor = self._attempts.start(resume)
        try:
            result = self._attempts.run(executor)
        except BaseException as err:
            # after a failure the survivors may be stuck in a collective: the executor is killed
            self._stop(executor, succeeded=False, error=err)
            raise
        self._stop(executor, succeeded=True, error=None)
        return result

    def _stop(self, executor: E, succeeded: bool, error: BaseException | None) -> None:
        try:
            self._attempts.stop(executor, succeeded)
        except Exception as stop_error:
            if error is not None:
                # the error that ended the attempt is the one worth raising
                error.add_note(f"Stopping the workers afterwards failed too: {stop_error!r}")
                log.debug("Stopping the workers after a failed attempt failed", exc_info=True)
            else:
                # the call succeeded: its results stand; only keeping its workers failed
                log.warning("Could not keep or stop the workers after the call: %s", stop_error)


__all__ = ["Attempts", "Regroup", "RunController", "RunState"]
