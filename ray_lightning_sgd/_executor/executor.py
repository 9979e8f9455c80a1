"""The backend executor: one lifecycle for a worker group and its backend.

Driver side. ``start`` connects to Ray, starts the worker group and runs the backend's ``on_start``;
``run`` executes a function on every worker; ``shutdown`` runs the backend's ``on_shutdown`` (after a
successful run) and then stops the workers, on every path. Users of the Lightning strategy never see
this class.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import ray

from ray_lightning_sgd._backend.base import Backend, BackendConfig
from ray_lightning_sgd._worker_group import cluster
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd._worker_group.group import WorkerGroup
from ray_lightning_sgd.exceptions import WorkerGroupError

log = logging.getLogger(__name__)

T = TypeVar("T")


class ExecutorState(enum.Enum):
    """Where a :class:`BackendExecutor` is in its life."""

    NEW = "new"
    RUNNING = "running"
    SHUT_DOWN = "shut down"


class BackendExecutor:
    """Driver side: starts a worker group, sets its backend up, runs functions, shuts it all down.

    Args:
        backend_config: The backend's configuration; it names the backend class.
        worker_group_config: How many workers and what each one reserves.
    """

    def __init__(
        self, backend_config: BackendConfig, worker_group_config: WorkerGroupConfig
    ) -> None:
        self._backend_config = backend_config
        self._backend = backend_config.backend_cls()
        self._worker_group = WorkerGroup(worker_group_config)
        self._state = ExecutorState.NEW

    @property
    def state(self) -> ExecutorState:
        """Where the executor is in its life."""
        return self._state

    @property
    def backend(self) -> Backend:
        """The backend whose hooks run at start and shutdown."""
        return self._backend

    @property
    def backend_config(self) -> BackendConfig:
        """The backend's configuration."""
        return self._backend_config

    @property
    def worker_group(self) -> WorkerGroup:
        """The worker group this executor drives."""
        return self._worker_group

    def start(self) -> None:
        """Driver side: connects to Ray, starts the workers and runs the backend's ``on_start``."""
        if self._state is not ExecutorState.NEW:
            raise WorkerGroupError(f"cannot start an executor that is {self._state.value}")
        cluster.connect()
        self._state = ExecutorState.RUNNING
        try:
            self._worker_group.start()
            self._backend.on_start(self._worker_group, self._backend_config)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def run_async(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Driver side: runs ``fn`` on every worker; returns their futures in rank order."""
        self._require_running()
        return self._worker_group.execute_async(fn, *args, **kwargs)

    def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        watch: Callable[[], None] | None = None,
        watch_interval_s: float = 1.0,
        **kwargs: Any,
    ) -> list[T]:
        """Driver side: runs ``fn`` on every worker and returns the results in rank order.

        The first failure on any worker is raised at once; the caller shuts the executor down.
        ``watch`` is called every ``watch_interval_s`` while the workers run (see
        ``WorkerGroup.get``).
        """
        refs = self.run_async(fn, *args, **kwargs)
        return self._worker_group.get(refs, watch=watch, watch_interval_s=watch_interval_s)

    def is_alive(self, timeout_s: float) -> bool:
        """Driver side: whether every worker answers within ``timeout_s``."""
        if self._state is not ExecutorState.RUNNING:
            return False
        try:
            self._worker_group.get(self._worker_group.execute_async(_ping), timeout_s=timeout_s)
        except (WorkerGroupError, ray.exceptions.RayError):
            return False
        return True

    def shutdown(self, graceful: bool = True) -> None:
        """Driver side: tears the backend down (if ``graceful``) and stops every worker.

        After a failure, pass ``graceful=False``: the surviving workers may be stuck in a
        collective and are killed without being asked to leave the process group first.
        """
        if self._state is ExecutorState.SHUT_DOWN:
            return
        was_running = self._state is ExecutorState.RUNNING
        self._state = ExecutorState.SHUT_DOWN
        try:
            if graceful and was_running:
                self._backend.on_shutdown(self._worker_group, self._backend_config)
        finally:
            self._worker_group.shutdown()

    def __enter__(self) -> BackendExecutor:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown(graceful=exc is None)

    def _require_running(self) -> None:
        if self._state is not ExecutorState.RUNNING:
            raise WorkerGroupError(
                f"cannot run on an executor that is {self._state.value}; call start() first"
            )


def _ping() -> None:
    """Runs on each worker. Does nothing; answering is the point."""
