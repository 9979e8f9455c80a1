"""Exceptions raised by ray_lightning_sgd.

The hierarchy::

    RaySGDError                      base of everything this package raises itself
    ├── ConfigurationError           a bad argument, found before Ray is touched (also a ValueError)
    ├── SerializationError           the Trainer, model or data cannot be pickled (also a TypeError)
    ├── ClusterConnectionError       no Ray cluster answers at the address, or it refused us
    │                                (also a ConnectionError)
    ├── ResourcesUnavailableError    the cluster cannot give the requested workers
    └── WorkerGroupError             the worker group was used in a state that forbids the call
        ├── WorkerDiedError          a worker process died while running a call
        └── WorkerTimeoutError       workers did not answer within a deadline (also a TimeoutError)

An exception raised by user code on a worker is not wrapped: the driver re-raises it with its own
type and message, and a note that names the rank and carries the worker's traceback.
"""

from __future__ import annotations

from typing import Any


class RaySGDError(Exception):
    """Base class of the errors raised by ray_lightning_sgd."""


class ConfigurationError(RaySGDError, ValueError):
    """An argument or a Trainer setting that the strategy cannot work with."""


class SerializationError(RaySGDError, TypeError):
    """An object that must travel to the workers cannot be pickled."""


class ClusterConnectionError(RaySGDError, ConnectionError):
    """The driver could not join the Ray cluster it was pointed at."""


class ResourcesUnavailableError(RaySGDError):
    """The cluster cannot place the requested workers."""


class WorkerGroupError(RaySGDError):
    """The worker group is in a state that forbids the call."""


class WorkerError(RaySGDError):
    """An exception raised by code on a worker that cannot travel to the driver as itself (it
    does not pickle, or does not unpickle: an ``__init__`` that takes other arguments than the
    exception's ``args``), or a ``SystemExit`` (``sys.exit()`` called on a worker). Its message
    names the original type and message; its notes name the rank and hold the worker's
    traceback. Never retried, as the exception itself would not be."""


class WorkerDiedError(WorkerGroupError):
    """A worker's process died (or its node left the cluster) while it ran a call."""

    def __init__(self, message: str, *, rank: int, node_id: str, preempted: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.node_id = node_id
        #: Whether Ray reported the worker's node preempted (drained for preemption, as a spot
        #: node or an autoscaler's drain is): such restarts count against ``max_preemptions``.
        self.preempted = preempted

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # keyword-only arguments do not survive the default exception pickling
        return (
            _rebuild_worker_died,
            (type(self), str(self), self.rank, self.node_id, self.preempted),
        )


class WorkerTimeoutError(WorkerGroupError, TimeoutError):
    """Workers did not finish a call within its deadline (or made no progress within
    ``progress_timeout_s``: then ``stacks`` holds every rank's stack at that moment, as
    ``RaySGDStrategy.worker_stacks()`` gives them, and the message shows them)."""

    def __init__(self, message: str, stacks: list[Any] | None = None) -> None:
        super().__init__(message)
        self.stacks: list[Any] = list(stacks or [])


def _rebuild_worker_died(
    cls: type[WorkerDiedError], message: str, rank: int, node_id: str, preempted: bool = False
) -> WorkerDiedError:
    return cls(message, rank=rank, node_id=node_id, preempted=preempted)
