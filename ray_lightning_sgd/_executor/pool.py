"""Warm executors: started worker groups kept between calls, so later calls skip the start-up.

Driver side. A launcher that reuses workers asks :func:`acquire` for an executor with its configs and
gives it back with :func:`release` when the call succeeded; the pool keeps it idle, and the next call
with equal configs gets the same actors and process group back. An executor whose call failed is shut
down instead. The pool holds idle executors only; one that is running a call belongs to its caller.

Idle executors are shut down by :func:`shutdown` (``ray_lightning_sgd.shutdown_workers``), by a miss
(a call with other configs frees the idle workers first, so their resources are available), at
interpreter exit, and implicitly by ``ray.shutdown()``, which ends the actors of the driver's job.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
from dataclasses import dataclass

import ray
import torch

from ray_lightning_sgd._backend.base import BackendConfig
from ray_lightning_sgd._driver.monitor import RunMonitor
from ray_lightning_sgd._executor.executor import BackendExecutor
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd.exceptions import RaySGDError

log = logging.getLogger(__name__)

#: How long an idle executor's workers have to answer before it is replaced by a new one.
_HEALTH_CHECK_S = 5.0


@dataclass
class _Idle:
    backend_config: BackendConfig
    worker_group_config: WorkerGroupConfig
    session: tuple[str, str]
    executor: BackendExecutor


_lock = threading.Lock()
_idle: list[_Idle] = []
_atexit_registered = False
#: A run monitor kept between calls (starting its actor costs a process), and its Ray session.
_idle_monitor: tuple[tuple[str, str], RunMonitor] | None = None


def acquire_monitor(progress_timeout_s: float | None) -> RunMonitor:
    """Driver side: the kept run monitor of this Ray session, reset, or a new one."""
    global _idle_monitor
    with _lock:
        kept, _idle_monitor = _idle_monitor, None
    if kept is not None and kept[0] == _session():
        try:
            kept[1].reset(progress_timeout_s)
            return kept[1]
        except ray.exceptions.RayError:
            log.debug("The kept run monitor is gone; starting a new one")
    return RunMonitor(progress_timeout_s)


def release_monitor(monitor: RunMonitor) -> None:
    """Driver side: keeps the run monitor of a call that succeeded, for the next call."""
    global _idle_monitor, _atexit_registered
    if not ray.is_initialized():
        return
    with _lock:
        previous, _idle_monitor = _idle_monitor, (_session(), monitor)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    if previous is not None and previous[0] == _session():
        previous[1].shutdown()


def acquire(
    backend_config: BackendConfig, worker_group_config: WorkerGroupConfig
) -> tuple[BackendExecutor, bool]:
    """Driver side: returns a running executor for these configs, and whether it was warm.

    An idle executor with equal configs in the same Ray session whose workers still answer is reused.
    Otherwise every idle executor is shut down (freeing its resources) and a new one is started.
    """
    session = _session()
    with _lock:
        match = next(
            (
                idle
                for idle in _idle
                if idle.session == session
                and idle.backend_config == backend_config
                and idle.worker_group_config == worker_group_config
            ),
            None,
        )
        if match is not None:
            _idle.remove(match)
        others = list(_idle)
        _idle.clear()
    try:
        _shut_down(others, session)
        if match is not None and match.executor.is_alive(_HEALTH_CHECK_S):
            log.debug("Reusing warm worker group %s", match.executor.worker_group.name)
            return match.executor, True
    except BaseException:
        # interrupted (Ctrl-C) while it held groups no list knows of any more: none may leak
        for idle in [*others, *([match] if match is not None else [])]:
            if idle.session != session:
                continue  # its Ray session ended, and its actors with it
            try:
                idle.executor.shutdown(graceful=False)
            except Exception:
                log.debug("Could not stop %s", idle.executor.worker_group.name, exc_info=True)
        _drop_monitor_if_unused()
        raise
    if match is not None:
        log.info(
            "The idle workers of %s stopped answering; starting new ones",
            match.executor.worker_group.name,
        )
        match.executor.shutdown(graceful=False)
    executor = BackendExecutor(backend_config, worker_group_config)
    executor.start()  # shuts its workers down itself when it fails or is interrupted
    return executor, False


def release(executor: BackendExecutor) -> None:
    """Driver side: keeps a running executor idle for the next call with the same configs."""
    global _atexit_registered
    if not ray.is_initialized():
        return  # the cluster went away during the call; there is nothing left to keep
    # the call's objects (Trainer, model, data) form reference cycles; free them on the workers
    # now, while they wait, rather than at the start of the next call
    executor.run_async(_collect_garbage)
    idle = _Idle(executor.backend_config, executor.worker_group.config, _session(), executor)
    with _lock:
        _idle.append(idle)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def shutdown(worker_group_config: WorkerGroupConfig | None = None) -> int:
    """Driver side: shuts down idle workers (all, or those of one config); returns how many groups.

    Workers that are running a call are not touched.
    """
    with _lock:
        chosen = [
            idle
            for idle in _idle
            if worker_group_config is None or idle.worker_group_config == worker_group_config
        ]
        for idle in chosen:
            _idle.remove(idle)
    _shut_down(chosen, _session() if ray.is_initialized() else None)
    _drop_monitor_if_unused()
    return len(chosen)


def _drop_monitor_if_unused() -> None:
    # the monitor stays while warm workers do: it goes with the last of them
    global _idle_monitor
    with _lock:
        if _idle:
            return
        kept, _idle_monitor = _idle_monitor, None
    if kept is not None and ray.is_initialized() and kept[0] == _session():
        kept[1].shutdown()


def idle_group_names() -> list[str]:
    """Driver side: the names of the worker groups kept idle, for tests and diagnostics."""
    with _lock:
        return [idle.executor.worker_group.name for idle in _idle]


def idle_monitor_name() -> str | None:
    """Driver side: the name of the run monitor's actor kept with the idle workers, if any."""
    with _lock:
        return None if _idle_monitor is None else _idle_monitor[1].name


def _shut_down(idle: list[_Idle], session: tuple[str, str] | None) -> None:
    for item in idle:
        if item.session != session:
            continue  # its Ray session ended, and its actors with it
        try:
            # an executor that is shut down already (an earlier interrupted attempt) returns
            item.executor.shutdown(graceful=True)
        except RaySGDError as err:  # a worker died while idle; shutdown killed the rest
            log.debug(
                "Idle worker group %s did not stop cleanly: %s",
                item.executor.worker_group.name,
                err,
            )


def _collect_garbage() -> None:
    """Runs on each worker. Frees what the last call left in reference cycles."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _session() -> tuple[str, str]:
    # a new local cluster has a new node; a new connection to the same cluster is a new job
    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_node_id()
