"""The launcher: runs a Trainer entry point (fit, validate, test, predict) on a Ray worker group.

Driver half: check the Trainer against the strategy, pickle the Trainer, model, data and global
state, put them into Ray's object store once while a :class:`BackendExecutor` starts (or a warm one
is taken from :mod:`ray_lightning_sgd._executor.pool`), run :func:`run_on_worker` on every worker, stop or
keep the workers on every path, and copy what rank 0 produced back into the driver's Trainer and
model (:func:`recover_results_in_driver`).

Worker half (:func:`run_on_worker`): restore the global state, take the rank and device the group
assigned, run the entry point, and collect what goes back (:func:`_collect_results`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from typing_extensions import override

from ray_lightning_sgd._driver.checks import check_trainer, pack_payload
from ray_lightning_sgd._driver.monitor import RunMonitor
from ray_lightning_sgd._driver.recovery import recover_results_in_driver
from ray_lightning_sgd._driver.replay import PUMP_INTERVAL_S, DriverReplay
from ray_lightning_sgd._driver.settings import LaunchSettings
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._executor.controller import Attempts, RunController
from ray_lightning_sgd._executor.executor import BackendExecutor
from ray_lightning_sgd._serialization import unpack
from ray_lightning_sgd._worker import artifacts
from ray_lightning_sgd._worker.entry import (
    FITTING,
    GlobalState,
    Payload,
    WorkerOutput,
    run_on_worker,
)
from ray_lightning_sgd._worker.resume import ResumePoint
from ray_lightning_sgd._worker_group import cluster
from ray_lightning_sgd.exceptions import WorkerDiedError, WorkerGroupError

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.strategies.launchers.launcher import _Launcher as _Base
else:
    _Base = object

log = logging.getLogger(__name__)


class RayLauncherBase(_Base):
    """Driver side: launches a Trainer entry point on a gang of Ray actors and brings results back.

    The implementation for either Lightning namespace; the ``RayLauncher`` of
    :mod:`ray_lightning_sgd.pytorch_lightning` and :mod:`ray_lightning_sgd.lightning` join it with
    that namespace's launcher interface.

    Args:
        strategy: The strategy whose worker group and backend configs the launch uses.
    """

    def __init__(self, strategy: LaunchSettings) -> None:
        self._strategy = strategy
        self._executor: BackendExecutor | None = None

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        # Ray actors are separate processes started by Ray, so notebooks work
        return True

    @override
    def launch(
        self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any
    ) -> Any:
        """Driver side: runs ``function`` on every worker and returns rank 0's result.

        With a Trainer, the driver's Trainer and model afterwards hold what the workers produced.
        """
        strategy = self._strategy
        if trainer is not None:
            check_trainer(trainer, strategy)
        cluster.connect()
        failure = strategy.failure_config
        fitting = trainer is not None and trainer.state.fn == FITTING
        global_state = GlobalState.capture()
        callbacks = _driver_callbacks(trainer, strategy) if trainer is not None else []
        monitor = self._monitor_for(trainer)
        run_id = uuid.uuid4().hex[:12]
        replay, mirror, succeeded = None, None, False
        try:
            if monitor is not None and trainer is not None:
                replay = DriverReplay(trainer, callbacks, monitor)
            mirror = artifacts.prepare(trainer) if trainer is not None else None

            def payload(resume: ResumePoint | None) -> Payload:
                forward_events = replay is not None and bool(callbacks)
                return Payload(
                    trainer, function, args, kwargs, global_state, monitor, failure, resume,
                    forward_events, mirror, run_id,
                )  # fmt: skip

            attempts: Attempts[_Attempt, list[WorkerOutput], ResumePoint] = Attempts(
                start=lambda resume: self._start_attempt(payload(resume)),
                run=functools.partial(self._run_attempt, monitor=monitor, replay=replay),
                stop=self._stop_attempt,
                resume_point=lambda: monitor.resume() if fitting and monitor is not None else None,
            )

            def on_restart(err: WorkerDiedError, failures: int, resume: Any) -> None:
                if replay is not None:
                    replay.drop_calls()
                _log_restart(err, failures, resume, failure.max_failures, fitting)

            controller = RunController(
                attempts,
                max_failures=failure.max_failures,
                on_restart=on_restart,
            )
            with _sigterm_raises(strategy.flavour.sigterm_exception):
                try:
                    outputs = controller.run()
                except BaseException as err:
                    if replay is not None:
                        replay.fail(err)
                    raise
            succeeded = True
        finally:
            _finish_launch(monitor, mirror, keep_monitor=succeeded and strategy.reuse_workers)
        if trainer is None:
            return outputs[0].results
        return recover_results_in_driver(trainer, outputs)

    def _monitor_for(self, trainer: pl.Trainer | None) -> RunMonitor | None:
        """Driver side: the run monitor of a call (kept with warm workers), or None.

        A Trainer's call always has one: the workers' output and rank 0's events reach the driver
        through it.
        """
        failure = self._strategy.failure_config
        if not failure.monitored and trainer is None:
            return None
        timeout = failure.progress_timeout_s
        return (
            pool.acquire_monitor(timeout) if self._strategy.reuse_workers else RunMonitor(timeout)
        )

    def _start_attempt(self, payload: Payload) -> _Attempt:
        """Driver side: pickles the payload, puts it into the object store and, meanwhile, starts
        (or takes warm) workers."""
        # pickled here, so that what cannot be pickled fails before any worker starts; the monitor
        # stays here: its actor handle goes with the call, made once the workers are up
        packed = pack_payload(payload._replace(monitor=None))
        putter = ThreadPoolExecutor(1, thread_name_prefix="ray_lightning_sgd-put")
        shipped = putter.submit(ray.put, packed)  # the copy overlaps the workers' start
        putter.shutdown(wait=False)
        del packed
        return _Attempt(self._start_executor(), shipped)

    def _run_attempt(
        self, attempt: _Attempt, monitor: RunMonitor | None, replay: DriverReplay | None
    ) -> list[WorkerOutput]:
        """Driver side: runs the payload on every worker; replays events while it waits."""
        executor = attempt.executor
        watch = None
        if monitor is not None:
            monitor.start_attempt(len(executor.worker_group))
            watch = functools.partial(_watch, monitor, executor.worker_group.metadata, replay)
        interval = PUMP_INTERVAL_S if replay is not None else 1.0
        actor = None if monitor is None else monitor.actor
        if attempt.shipped is None:
            raise WorkerGroupError("an attempt runs once")
        packed = attempt.shipped.result()
        results = executor.run(run_on_worker, packed, actor, watch=watch, watch_interval_s=interval)
        if replay is not None:
            replay.pump()  # the last events: rank 0 sent them before it returned
        return [unpack(out) for out in results]

    def _stop_attempt(self, attempt: _Attempt, succeeded: bool) -> None:
        attempt.shipped = None  # the payload may leave the object store
        self._stop_executor(reuse=succeeded)

    def _start_executor(self) -> BackendExecutor:
        strategy = self._strategy
        if strategy.reuse_workers:
            executor, warm = pool.acquire(strategy.backend_config, strategy.worker_group_config)
            log.debug("%s workers for this call", "warm" if warm else "new")
        else:
            # at most one group per process: idle warm workers would hold the resources
            pool.shutdown()
            executor = BackendExecutor(strategy.backend_config, strategy.worker_group_config)
            self._executor = executor
            executor.start()
        self._executor = executor
        return executor

    def _stop_executor(self, reuse: bool) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        if reuse and self._strategy.reuse_workers:
            try:
                pool.release(executor)
            except BaseException:
                executor.shutdown(graceful=False)  # neither kept nor left running
                raise
        else:
            # after a failure the survivors may be stuck in a collective: kill, do not ask
            executor.shutdown(graceful=reuse)

    @override
    def kill(self, signum: int) -> None:
        """Driver side: stops every worker at once."""
        if self._executor is not None:
            self._executor.shutdown(graceful=False)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_executor"] = None  # the driver's handles stay on the driver
        return state


@dataclass
class _Attempt:
    """Driver side: one attempt's running workers and its payload in the object store."""

    executor: BackendExecutor
    shipped: Future[ray.ObjectRef] | None


def _finish_launch(monitor: RunMonitor | None, mirror: Any, keep_monitor: bool) -> None:
    """Driver side, on every path out of a launch: ends the artifacts' probe and keeps or stops
    the run monitor. What fails here is logged: it must not replace the call's own error."""
    try:
        artifacts.finish(mirror)
    except Exception:
        log.warning("Could not remove the artifacts' probe file", exc_info=True)
    if monitor is None:
        return
    try:
        if keep_monitor:
            pool.release_monitor(monitor)  # kept with the warm workers
        else:
            monitor.shutdown()
    except Exception:
        log.warning("Could not stop the run monitor", exc_info=True)


def _watch(monitor: RunMonitor, metadata: list[Any], replay: DriverReplay | None) -> None:
    """Driver side, while the workers run: live events to the driver's callbacks, and stalls."""
    if replay is not None:
        replay.pump()
    monitor.check(metadata)


def _driver_callbacks(trainer: pl.Trainer, strategy: LaunchSettings) -> list[Callback]:
    """Driver side: the callbacks that run on the driver: the Trainer's progress bar (the workers
    run none) and the strategy's ``driver_callbacks``."""
    bar = trainer.progress_bar_callback
    return ([] if bar is None else [bar]) + list(strategy.driver_callbacks)


@contextlib.contextmanager
def _sigterm_raises(exception: type[BaseException]) -> Iterator[None]:
    """Driver side: SIGTERM during a launch raises ``exception`` (Lightning's SIGTERMException),
    so that the launch stops its workers on the way out, as Ctrl-C does.

    Without it, the default action would end the driver at once and leave the workers to Ray's
    clean-up of a dead driver. A handler the user installed runs first (not the one ``ray.init``
    installs, which only exits: the exception does that after the clean-up); an ignored SIGTERM
    stays ignored. Only the main thread can install handlers; elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:
        yield
        return

    chained = previous if callable(previous) and not _from_ray(previous) else None

    def handler(signum: int, frame: Any) -> None:
        log.info("Received SIGTERM on the driver: stopping the workers")
        # a second SIGTERM must not interrupt the clean-up this one starts
        signal.signal(signal.SIGTERM, previous)
        if chained is not None:
            chained(signum, frame)
        raise exception(128 + signum)  # the exit status of a process ended by the signal

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _from_ray(handler: Callable[..., Any]) -> bool:
    return getattr(handler, "__module__", "").split(".")[0] == "ray"


def _log_restart(
    err: WorkerDiedError,
    failures: int,
    resume: ResumePoint | None,
    max_failures: int,
    fitting: bool,
) -> None:
    limit = "no limit" if max_failures == -1 else f"of max_failures={max_failures}"
    if not fitting:
        where = "running the call again"
    elif resume is None:
        where = "fit starts over: no resume checkpoint was written yet"
    else:
        where = f"fit resumes after epoch {resume.epoch} (global step {resume.global_step})"
    log.warning("Restart %d (%s) after a worker failure: %s; %s", failures, limit, err, where)
