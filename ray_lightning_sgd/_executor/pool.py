"""Warm executors: started worker groups kept between calls, so later calls skip the start-up.

Driver side. The pool owns every executor a launch uses, idle or leased. A launcher asks
:func:`acquire` for an executor with its configs and gives it back with :func:`release`: to be kept
idle when the call succeeded and workers are reused, so that the next call with equal configs gets
the same actors and process group back; to be shut down otherwise (after a failure, without asking
the workers, which may be stuck in a collective).

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
from ray.exceptions import RayError

from ray_lightning_sgd._backend.base import BackendConfig
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
#: Executors lent to a running call.
_leased: list[BackendExecutor] = []
_atexit_registered = False


def acquire(
    backend_config: BackendConfig, worker_group_config: WorkerGroupConfig, reuse: bool = True
) -> tuple[BackendExecutor, bool]:
    """Driver side: lends a running executor for these configs; returns it and whether it was warm.

    With ``reuse``, an idle executor with equal configs in the same Ray session whose workers still
    answer is lent again; an elastic one only if the cluster has no room for a larger size now.
    Otherwise every idle executor is shut down (freeing its resources) and a new one is started.
    """
    return _find_or_start(backend_config, worker_group_config, reuse)


def _lease(executor: BackendExecutor) -> None:
    """Lists ``executor`` as lent, before it leaves this module: a Ctrl-C anywhere after it
    was found or started leaves it in a list that the exit clean-up stops."""
    with _lock:
        _leased.append(executor)


def _find_or_start(
    backend_config: BackendConfig, worker_group_config: WorkerGroupConfig, reuse: bool
) -> tuple[BackendExecutor, bool]:
    global _atexit_registered
    with _lock:
        if not _atexit_registered:
            atexit.register(_shutdown_all)
            _atexit_registered = True
    session = _session()
    with _lock:
        match = next(
            (
                idle
                for idle in _idle
                if reuse
                and idle.session == session
                and idle.backend_config == backend_config
                # whatever the call that used them last kept free (see _not_the_size_wanted)
                and idle.worker_group_config.same_settings(worker_group_config)
            ),
            None,
        )
        if match is not None and not _code_fits(match.worker_group_config, worker_group_config):
            _say_the_code_changed(match.worker_group_config, worker_group_config)
            match = None  # its workers imported the driver's code as it was
        if match is not None:
            _idle.remove(match)
        others = list(_idle)
        _idle.clear()
    try:
        _shut_down(others, session)
        if match is not None and _not_the_size_wanted(match.executor, worker_group_config):
            # a call starts with as many workers as the cluster places now, warm or not
            _shut_down([match], session)
            match = None
        if match is not None and match.executor.is_alive(_HEALTH_CHECK_S):
            log.debug("Reusing warm worker group %s", match.executor.worker_group.name)
            _lease(match.executor)
            return match.executor, True
    except BaseException:
        # interrupted (Ctrl-C) while it held groups no list knows of any more: none may leak
        with _lock:
            if match is not None and match.executor in _leased:  # leased, then interrupted
                _leased.remove(match.executor)
        for idle in [*others, *([match] if match is not None else [])]:
            if idle.session != session:
                continue  # its Ray session ended, and its actors with it
            try:
                idle.executor.shutdown(graceful=False)
            except Exception:
                log.debug("Could not stop %s", idle.executor.worker_group.name, exc_info=True)
        raise
    if match is not None:
        log.info(
            "The idle workers of %s stopped answering; starting new ones",
            match.executor.worker_group.name,
        )
        match.executor.shutdown(graceful=False)
    executor = BackendExecutor(backend_config, worker_group_config)
    _lease(executor)
    try:
        executor.start()  # shuts its workers down itself when it fails or is interrupted
    except BaseException:
        with _lock:
            _leased.remove(executor)
        raise
    return executor, False


def _not_the_size_wanted(executor: BackendExecutor, wanted: WorkerGroupConfig) -> bool:
    """Whether an idle elastic group is not the size a new group of ``wanted`` would take now:
    it took fewer than its most workers (the cluster was short when it started) and would now
    be placed at a larger size, or it leaves the cluster less than the call keeps free (Ray
    Data's CPU); it logs why it is replaced."""
    group = executor.worker_group
    if not wanted.elastic:
        return False
    if wanted.keep_free:
        try:
            totals = ray.cluster_resources()
        except RayError:
            totals = None
        if totals is not None and not wanted.leaves_free(len(group), totals):
            log.info(
                "The %d warm workers of %s would leave Ray Data's tasks less than %s of the "
                "cluster: starting a smaller group",
                len(group), group.name, dict(wanted.keep_free),
            )  # fmt: skip
            return True
    try:
        room = group.has_room_to_grow(config=wanted)
    except RayError:  # the cluster did not answer: the warm group is what it has
        log.debug("Could not probe for room beside %s", group.name, exc_info=True)
        return False
    if not room:
        return False
    log.info(
        "The cluster has room for more than the %d warm workers of %s (of up to %d): starting "
        "a larger group",
        len(group), group.name, group.config.num_workers,
    )  # fmt: skip
    return True


def _code_fits(idle: WorkerGroupConfig, wanted: WorkerGroupConfig) -> bool:
    """Whether idle workers hold the driver's code that a call needs (any, when it names none)."""
    return wanted.driver_code is None or idle.driver_code == wanted.driver_code


def _say_the_code_changed(idle: WorkerGroupConfig, wanted: WorkerGroupConfig) -> None:
    """Logs why idle workers with the call's settings are not reused."""
    changed = (
        []
        if idle.driver_code is None or wanted.driver_code is None
        else (wanted.driver_code.changed_files(idle.driver_code))
    )
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if changed[3:] else "")
    log.warning(
        "The driver's code changed since the warm workers started (%s): starting new workers, "
        "which import it as it is now",
        shown or "its sys.path",
    )


def release(executor: BackendExecutor, *, keep: bool, graceful: bool = True) -> None:
    """Driver side: takes a lent executor back: keeps it idle for the next call with the same
    configs (``keep``), or shuts it down (asking the workers to leave their process group first
    only if ``graceful``). An executor that cannot be kept is shut down: none is left running."""
    with _lock:
        if executor in _leased:
            _leased.remove(executor)
    if not keep or not ray.is_initialized():
        # after a failure the survivors may be stuck in a collective: kill, do not ask
        executor.shutdown(graceful=graceful and ray.is_initialized())
        return
    try:
        # the call's objects (Trainer, model, data) form reference cycles; free them on the
        # workers now, while they wait, rather than at the start of the next call
        executor.run_async(_collect_garbage)
        idle = _Idle(executor.backend_config, executor.worker_group.config, _session(), executor)
        with _lock:  # inside: a Ctrl-C before it is listed idle still stops it
            _idle.append(idle)
    except BaseException:
        with _lock:
            _idle[:] = [idle for idle in _idle if idle.executor is not executor]
        executor.shutdown(graceful=False)  # neither kept nor left running
        raise


def leased_group_names() -> list[str]:
    """Driver side: the names of the worker groups lent to running calls, for tests."""
    with _lock:
        return [executor.worker_group.name for executor in _leased]


def _shutdown_all() -> None:
    """At interpreter exit: every executor, idle or (a call cut short) leased."""
    shutdown()
    with _lock:
        leased, _leased[:] = list(_leased), []
    for executor in leased:
        try:
            executor.shutdown(graceful=False)
        except Exception:
            log.debug("Could not stop %s", executor.worker_group.name, exc_info=True)


def shutdown(worker_group_config: WorkerGroupConfig | None = None) -> int:
    """Driver side: shuts down idle workers (all, or those of one config's settings, whatever
    code of the driver's they hold and whatever a call kept free); returns how many groups.

    Workers that are running a call are not touched.
    """
    with _lock:
        chosen = [
            idle
            for idle in _idle
            if worker_group_config is None
            or idle.worker_group_config.same_settings(worker_group_config)
        ]
        for idle in chosen:
            _idle.remove(idle)
    _shut_down(chosen, _session() if ray.is_initialized() else None)
    return len(chosen)


def idle_group_names() -> list[str]:
    """Driver side: the names of the worker groups kept idle, for tests and diagnostics."""
    with _lock:
        return [idle.executor.worker_group.name for idle in _idle]


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
