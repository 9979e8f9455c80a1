"""The outbox channels: what a worker leaves for the driver's polls while a call runs (see
:mod:`ray_lightning_sgd._worker_group.outbox`), each under its name here."""

from __future__ import annotations

from typing import Any

from ray_lightning_sgd._worker_group.worker import RESUME_POINT, SIGTERM_NOTICE

#: The outbox channel of events (pickled lists of :data:`Event`).
EVENTS = "events"

#: One event: the hook's name, its index arguments, rank 0's counters, and (on the last event of
#: each batch) its metrics.
Event = tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any] | None]

#: The hook name of an event that asks the driver to run a function (:func:`send_to_driver`).
CALL = "__call__"

#: The outbox channel of output lines: (stream name, line).
OUTPUT = "output"

#: The outbox channel of a rank's progress: (stage, step, the rank's longest wait between two of
#: its reports so far, in seconds).
PROGRESS = "progress"

#: The outbox channel of a rank's step times: (training steps timed, the median seconds waiting
#: for a batch, the median seconds of a step's own work until its backward) over its latest
#: :data:`TIMED_STEPS` steps.
TIMINGS = "timings"

#: How many of its latest steps a rank's :data:`TIMINGS` take the median of.
TIMED_STEPS = 20

#: The outbox channel of the run's latest resume point (urgent: the driver polls at once).
RESUME = RESUME_POINT

#: The outbox channel of rank 0's loggers: (each logger's ``version``, the run it writes to; by
#: logger index, the last step it logged of each metric).
LOGGERS = "loggers"


__all__ = [
    "CALL",
    "EVENTS",
    "LOGGERS",
    "OUTPUT",
    "PROGRESS",
    "RESUME",
    "SIGTERM_NOTICE",
    "TIMED_STEPS",
    "TIMINGS",
    "Event",
]
