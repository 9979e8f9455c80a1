"""The launcher: runs a Trainer entry point (fit, validate, test, predict) on a Ray worker group.

Driver half: check the Trainer against the strategy, pickle the Trainer, model, data and global
state, put them into Ray's object store once while a :class:`BackendExecutor` starts (or a warm one
is taken from :mod:`ray_lightning_sgd.pool`), run :func:`_run_on_worker` on every worker, stop or
keep the workers on every path, and copy what rank 0 produced back into the driver's Trainer and
model (:func:`_recover_results_in_driver`).

Worker half (:func:`_run_on_worker`): restore the global state, take the rank and device the group
assigned, run the entry point, and collect what goes back (:func:`_collect_results`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import random
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import ray
import torch
import torch.backends.cudnn
from ray import cloudpickle
from torch import Tensor
from typing_extensions import override

from ray_lightning_sgd import _compat, artifacts, cluster, pool
from ray_lightning_sgd._serialization import Packed, pack, unpack
from ray_lightning_sgd._serialization import to_cpu as _to_cpu
from ray_lightning_sgd.controller import Attempts, RunController
from ray_lightning_sgd.driver_view import (
    PUMP_INTERVAL_S,
    DriverReplay,
    EventForwarderBase,
    OutputForwarder,
    close_channel,
    open_channel,
)
from ray_lightning_sgd.environment import RayEnvironmentBase
from ray_lightning_sgd.exceptions import (
    ConfigurationError,
    SerializationError,
    WorkerDiedError,
    WorkerGroupError,
)
from ray_lightning_sgd.executor import BackendExecutor
from ray_lightning_sgd.flavour import Flavour
from ray_lightning_sgd.monitor import (
    FailureConfig,
    ProgressReporterBase,
    ResumeCheckpointBase,
    ResumePoint,
    RunMonitor,
    materialise,
)
from ray_lightning_sgd.worker_group import get_worker_context

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

    from ray_lightning_sgd.strategy import RaySGDStrategyBase

    _Base = _compat.Launcher
else:
    _Base = object

# the values of Lightning's TrainerFn, the same in both namespaces
_FITTING, _VALIDATING, _TESTING, _PREDICTING = "fit", "validate", "test", "predict"

log = logging.getLogger(__name__)

#: Environment variables of the driver that Lightning's spawned processes inherit and read.
_INHERITED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")


class RayLauncherBase(_Base):
    """Driver side: launches a Trainer entry point on a gang of Ray actors and brings results back.

    The implementation for either Lightning namespace; the ``RayLauncher`` of
    :mod:`ray_lightning_sgd.pytorch_lightning` and :mod:`ray_lightning_sgd.lightning` join it with
    that namespace's launcher interface.

    Args:
        strategy: The strategy whose worker group and backend configs the launch uses.
    """

    def __init__(self, strategy: RaySGDStrategyBase) -> None:
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
            _check_trainer(trainer, strategy)
        cluster.connect()
        failure = strategy.failure_config
        fitting = trainer is not None and trainer.state.fn == _FITTING
        global_state = _GlobalState.capture()
        callbacks = _driver_callbacks(trainer, strategy) if trainer is not None else []
        monitor = self._monitor_for(trainer)
        run_id = uuid.uuid4().hex[:12]
        replay, mirror, succeeded = None, None, False
        try:
            if monitor is not None and trainer is not None:
                replay = DriverReplay(trainer, callbacks, monitor)
            mirror = artifacts.prepare(trainer) if trainer is not None else None

            def payload(resume: ResumePoint | None) -> _Payload:
                forward_events = replay is not None and bool(callbacks)
                return _Payload(
                    trainer, function, args, kwargs, global_state, monitor, failure, resume,
                    forward_events, mirror, run_id,
                )  # fmt: skip

            attempts: Attempts[_Attempt, list[_WorkerOutput], ResumePoint] = Attempts(
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
        return _recover_results_in_driver(trainer, outputs)

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

    def _start_attempt(self, payload: _Payload) -> _Attempt:
        """Driver side: pickles the payload, puts it into the object store and, meanwhile, starts
        (or takes warm) workers."""
        # pickled here, so that what cannot be pickled fails before any worker starts; the monitor
        # stays here: its actor handle goes with the call, made once the workers are up
        packed = _pack(payload._replace(monitor=None))
        putter = ThreadPoolExecutor(1, thread_name_prefix="ray_lightning_sgd-put")
        shipped = putter.submit(ray.put, packed)  # the copy overlaps the workers' start
        putter.shutdown(wait=False)
        del packed
        return _Attempt(self._start_executor(), shipped)

    def _run_attempt(
        self, attempt: _Attempt, monitor: RunMonitor | None, replay: DriverReplay | None
    ) -> list[_WorkerOutput]:
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
        results = executor.run(
            _run_on_worker, packed, actor, watch=watch, watch_interval_s=interval
        )
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


def _driver_callbacks(trainer: pl.Trainer, strategy: RaySGDStrategyBase) -> list[Callback]:
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


class _Payload(NamedTuple):
    """What goes to every worker, as one object in Ray's object store."""

    trainer: pl.Trainer | None
    function: Callable
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    global_state: _GlobalState
    #: The run monitor (restarts, a progress timeout, or events for the driver), or None; on the
    #: driver only (the workers get its actor as the call's argument).
    monitor: RunMonitor | None
    failure: FailureConfig
    #: Where a restarted ``fit`` resumes from.
    resume: ResumePoint | None
    #: Whether rank 0 sends its callback events to the driver (through the monitor).
    forward_events: bool = False
    #: Where the driver expects rank 0's logs and checkpoints.
    artifacts: artifacts.Artifacts | None = None
    #: This launch's own name: its resume checkpoints in ``checkpoint_storage`` go in a folder of
    #: that name, so that runs sharing the storage (Tune trials) never overwrite each other's.
    run_id: str = ""


class _RankZeroResults(NamedTuple):
    """What rank 0 sends back: everything the driver's Trainer and model need."""

    state: Any  # the TrainerState of the Trainer's namespace
    #: The model's state dict, packed on its own so that the driver can copy it into its model
    #: straight from Ray's object store (:func:`unpack` with ``copy=False``).
    model_state: Packed | None
    loop_state: dict[str, Any]
    callback_states: dict[str, dict[str, Any]]
    callback_metrics: dict[str, Any]
    logged_metrics: dict[str, Any]
    progress_bar_metrics: dict[str, Any]
    should_stop: bool
    #: Files rank 0 wrote that the driver cannot see (see :mod:`ray_lightning_sgd.artifacts`).
    files: dict[str, bytes]
    #: Each logger's version, as rank 0 chose it.
    logger_versions: list[Any]


class _RankPredictions(NamedTuple):
    """One rank's predictions: per dataloader, per batch, the outputs and the samples' indices."""

    outputs: list[list[Any]]
    indices: list[list[list[int]]]


class _WorkerOutput(NamedTuple):
    """What one worker returns from :func:`_run_on_worker`."""

    results: Any
    rank_zero: _RankZeroResults | None
    predictions: _RankPredictions | None


@dataclass(frozen=True)
class _GlobalState:
    """The process-global state that Lightning's spawn launcher carries into its processes."""

    use_deterministic_algorithms: bool
    deterministic_warn_only: bool
    cudnn_benchmark: bool
    python_rng: Any
    numpy_rng: Any
    torch_rng: Tensor
    env: dict[str, str]

    @classmethod
    def capture(cls) -> _GlobalState:
        """Driver side: captures the flags, RNG states and inherited environment variables."""
        return cls(
            use_deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            python_rng=random.getstate(),
            numpy_rng=np.random.get_state(),
            torch_rng=torch.get_rng_state(),
            env={key: os.environ[key] for key in _INHERITED_ENV if key in os.environ},
        )

    def restore(self) -> None:
        """Runs on each worker. Restores what :meth:`capture` captured."""
        torch.use_deterministic_algorithms(
            self.use_deterministic_algorithms, warn_only=self.deterministic_warn_only
        )
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        for key in _INHERITED_ENV:
            os.environ.pop(key, None)
        os.environ.update(self.env)


class _BatchIndexRecorderBase:
    """Runs on each worker. Records which samples each predicted batch held."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")  # type: ignore[call-arg]
        self.indices: dict[int, list[list[int]]] = {}

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.indices.setdefault(dataloader_idx, []).append(list(batch_indices or []))


@functools.cache
def _batch_index_recorder(flavour: Flavour) -> type[_BatchIndexRecorderBase]:
    """The recorder for one namespace: Lightning keeps batch indices only for its own writers."""
    return type("_BatchIndexRecorder", (_BatchIndexRecorderBase, flavour.prediction_writer), {})


def _check_trainer(trainer: pl.Trainer, strategy: RaySGDStrategyBase) -> None:
    """Driver side: rejects Trainer settings that conflict with the strategy, before Ray starts."""
    accelerator = trainer.accelerator
    cpu, cuda = strategy.flavour.cpu_accelerator, strategy.flavour.cuda_accelerator
    if not isinstance(accelerator, (cpu, cuda)):
        raise ConfigurationError(
            f"RaySGDStrategy trains on CPUs or CUDA GPUs, but the Trainer chose "
            f"{type(accelerator).__name__}; use Trainer(accelerator='auto') or 'cpu', and "
            "RaySGDStrategy(use_gpu=True) for GPUs"
        )
    if isinstance(accelerator, cpu) and trainer.num_devices > 1:
        raise ConfigurationError(
            f"Trainer(devices={trainer.num_devices}) conflicts with RaySGDStrategy, which runs one "
            "device per worker: remove devices and set "
            f"RaySGDStrategy(num_workers={trainer.num_devices})"
        )
    if isinstance(accelerator, cuda) and not strategy.worker_group_config.use_gpu:
        warnings.warn(
            "The driver's Trainer chose the CUDA accelerator, but RaySGDStrategy(use_gpu=False) "
            "gives the workers no GPU, so they train on CPUs; pass use_gpu=True to give each "
            "worker a GPU",
            stacklevel=4,
        )


def _pack(payload: _Payload) -> Packed:
    """Driver side: pickles the payload for the object store, naming what cannot be pickled.

    Tensors travel as out-of-band buffers (see :mod:`ray_lightning_sgd._serialization`): a
    dataset in memory is written into the object store once, however many workers read it.
    """
    try:
        return pack(payload)
    except Exception as err:  # Ray raises TypeError, pickle.PicklingError and others
        culprit = _find_unpicklable(payload, "payload")
        if culprit is None:
            raise
        raise SerializationError(
            f"cannot send the Trainer to the workers: {culprit} cannot be pickled. "
            "Create it inside the LightningModule or DataModule hooks (setup, "
            "configure_model) instead, or keep it out of the objects that are sent"
        ) from err


def _find_unpicklable(
    obj: Any, path: str, depth: int = 0, ancestors: set[int] | None = None
) -> str | None:
    """Returns the attribute path of the innermost object that cannot be pickled, if any.

    An object that fails only because it refers back to an object being searched (a connector that
    holds its Trainer) is not the culprit: the search goes on in its ancestor's other attributes.
    """
    ancestors = set() if ancestors is None else ancestors
    if depth > 40:
        return None
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception:  # noqa: BLE001 - any failure means "look inside"
        pass
    ancestors.add(id(obj))
    refers_back = False
    try:
        for child_path, child in _children(obj, path):
            if id(child) in ancestors:
                refers_back = True
                continue
            found = _find_unpicklable(child, child_path, depth + 1, ancestors)
            if found is not None:
                return found
    finally:
        ancestors.discard(id(obj))
    return None if refers_back else f"{path} (a {type(obj).__module__}.{type(obj).__qualname__})"


def _children(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"{path}[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
    if hasattr(obj, "_fields"):  # a NamedTuple is a tuple; handled above
        return []
    try:
        state = obj.__getstate__()
    except Exception:  # noqa: BLE001 - objects that refuse to give their state have no children
        return []
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots) form
    if isinstance(state, dict):
        return [(f"{path}.{key}", value) for key, value in state.items()]
    return []


def _run_on_worker(packed: Packed, monitor: Any) -> Packed:
    """Runs on each worker. Runs the entry point under the assigned rank and collects results.

    ``monitor`` is the run monitor's actor handle, or None.
    """
    payload: _Payload = unpack(packed)
    del packed
    return pack(_run_payload(payload, monitor))


def _run_payload(payload: _Payload, monitor: Any) -> _WorkerOutput:
    started = time.time()  # files the call writes are newer
    context = get_worker_context()
    payload.global_state.restore()
    trainer = payload.trainer
    recorder = None
    args, kwargs = payload.args, payload.kwargs
    ours: list[Any] = []
    resume_file = None
    if trainer is not None:
        strategy = trainer.strategy
        environment = getattr(strategy, "cluster_environment", None)
        if not isinstance(environment, RayEnvironmentBase):
            raise TypeError(f"the Trainer's strategy has no RayEnvironment, but {environment!r}")
        flavour: Flavour = strategy.flavour  # type: ignore[attr-defined]
        environment.assign(context.rank, context.device_index)
        on_gpu = context.device_index is not None
        if on_gpu != isinstance(strategy.accelerator, flavour.cuda_accelerator):
            accelerator = flavour.cuda_accelerator if on_gpu else flavour.cpu_accelerator
            strategy.accelerator = accelerator()
        strategy.set_world_ranks()  # type: ignore[attr-defined]
        if trainer.state.fn == _PREDICTING:
            recorder = _batch_index_recorder(flavour)()
            ours.append(recorder)
        for bar in [cb for cb in _callbacks(trainer) if isinstance(cb, flavour.progress_bar)]:
            _callbacks(trainer).remove(bar)  # the driver shows rank 0's progress instead
        if monitor is not None and payload.forward_events and context.rank.global_rank == 0:
            ours.append(_callback_class(flavour, EventForwarderBase)(monitor))
        if monitor is not None and payload.failure.monitored:
            ours.append(_callback_class(flavour, ProgressReporterBase)(monitor))
            fitting = trainer.state.fn == _FITTING
            if fitting and payload.failure.max_failures != 0:
                failure = payload.failure
                resume_callback = _callback_class(flavour, ResumeCheckpointBase)
                every, storage = failure.checkpoint_every_n_epochs, failure.checkpoint_storage
                if storage is not None:
                    storage = f"{storage.rstrip('/')}/run-{payload.run_id}"
                ours.append(resume_callback(monitor, every, storage))
            if fitting and payload.resume is not None:
                resume_file = materialise(payload.resume)
                args, kwargs = _with_ckpt_path(payload.function, args, kwargs, resume_file)
        _callbacks(trainer).extend(ours)
    output: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if monitor is not None and trainer is not None:  # a Trainer's call: its output to the driver
        output = OutputForwarder(monitor, context.rank.global_rank)
    forwarder = next((cb for cb in ours if isinstance(cb, EventForwarderBase)), None)
    if monitor is not None:
        open_channel(monitor, forwarder)
    try:
        with output:
            results = payload.function(*args, **kwargs)
    except BaseException:
        if forwarder is not None:
            forwarder.send_now()  # the driver's view gets the steps before the error
        raise
    finally:
        close_channel()
        if resume_file is not None and payload.resume and payload.resume.uri is None:
            os.unlink(resume_file)
    if trainer is None:
        return _WorkerOutput(results, None, None)
    for callback in ours:
        _callbacks(trainer).remove(callback)
    collected = _collect_results(trainer, results, context.rank.global_rank, recorder)
    if collected.rank_zero is not None:
        files = artifacts.collect(payload.artifacts, trainer, started)
        collected = collected._replace(rank_zero=collected.rank_zero._replace(files=files))
    return collected


@functools.cache
def _callback_class(flavour: Flavour, base: type) -> type:
    """``base`` as a Callback of the flavour's namespace."""
    return type(base.__name__.removesuffix("Base"), (base, flavour.callback), {})


def _with_ckpt_path(
    function: Callable, args: tuple[Any, ...], kwargs: dict[str, Any], path: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Returns the entry point's arguments with ``ckpt_path`` set to ``path``."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.arguments["ckpt_path"] = path
    return bound.args, bound.kwargs


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


def _collect_results(
    trainer: pl.Trainer, results: Any, global_rank: int, recorder: _BatchIndexRecorderBase | None
) -> _WorkerOutput:
    """Runs on each worker. Gathers what the driver needs: everything from rank 0, and each
    rank's predictions."""
    fn = trainer.state.fn
    # every rank computes the state dict, in case metrics in the model synchronise in it
    model_state = _to_cpu(trainer.lightning_module.state_dict()) if fn == _FITTING else None
    predictions = None
    if recorder is not None:
        if results is not None:
            outputs = _per_dataloader(results, trainer.predict_loop.num_dataloaders)
            indices = [recorder.indices.get(i, []) for i in range(len(outputs))]
            predictions = _RankPredictions(outputs, indices)
        results = None  # the driver merges every rank's predictions instead
    if global_rank != 0:
        return _WorkerOutput(None, None, predictions)
    progress_bar_metrics, callback_metrics, logged_metrics = _compat.committed_metrics(trainer)
    rank_zero = _RankZeroResults(
        state=trainer.state,
        model_state=None if model_state is None else pack(model_state),
        # tensors go back on the CPU: the driver may have no GPU to unpickle them onto
        loop_state=_to_cpu(_loop_of(trainer).state_dict()),
        callback_states={
            cb.state_key: _to_cpu(cb.state_dict()) for cb in _callbacks(trainer) if cb.state_dict()
        },
        # rank 0 alone reads them: the committed dicts, as the properties could start a collective
        callback_metrics=_to_cpu(dict(callback_metrics)),
        logged_metrics=_to_cpu(dict(logged_metrics)),
        progress_bar_metrics=_to_cpu(dict(progress_bar_metrics)),
        should_stop=trainer.should_stop,
        files={},
        logger_versions=[getattr(logger, "version", None) for logger in trainer.loggers],
    )
    return _WorkerOutput(_to_cpu(results), rank_zero, predictions)


def _recover_results_in_driver(trainer: pl.Trainer, outputs: Sequence[_WorkerOutput]) -> Any:
    """Driver side: copies rank 0's results into the Trainer and model; returns the call's result."""
    rank_zero = outputs[0].rank_zero
    if rank_zero is None:
        raise WorkerGroupError("rank 0 sent no results back: the worker's half is out of step")
    artifacts.write(rank_zero.files)
    for logger, version in zip(trainer.loggers, rank_zero.logger_versions, strict=False):
        _compat.set_logger_version(logger, version)
    model = trainer.lightning_module
    if rank_zero.model_state is not None:
        # not strict, as Lightning's spawn launcher: hooks on the worker may have changed layers
        model.load_state_dict(unpack(rank_zero.model_state, copy=False), strict=False)
    model.trainer = trainer
    trainer.state = rank_zero.state
    trainer.should_stop = rank_zero.should_stop
    loop = _loop_of(trainer)
    loop.load_state_dict(rank_zero.loop_state)
    loop.restarting = False  # the loop finished on the workers; it is not resuming
    for callback in _callbacks(trainer):
        state = rank_zero.callback_states.get(callback.state_key)
        if state:
            if getattr(callback, "dirpath", False) is None and state.get("dirpath") is not None:
                # a ModelCheckpoint resolves its directory in setup, which ran on the workers only
                callback.dirpath = state["dirpath"]  # type: ignore[attr-defined]
            callback.load_state_dict(state)
    for target, source in (
        (trainer.callback_metrics, rank_zero.callback_metrics),
        (trainer.logged_metrics, rank_zero.logged_metrics),
        (trainer.progress_bar_metrics, rank_zero.progress_bar_metrics),
    ):
        target.clear()
        target.update(source)
    if trainer.state.fn == _PREDICTING:
        ranks = [out.predictions for out in outputs]
        if any(p is None for p in ranks):
            return None
        merged = merge_predictions([p for p in ranks if p is not None])
        return merged[0] if len(merged) == 1 else merged
    return outputs[0].results


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    # the Trainer sets this attribute in its callback connector, where type checkers do not see it
    return trainer.callbacks  # type: ignore[attr-defined]


def _loop_of(trainer: pl.Trainer) -> Any:
    return {
        _FITTING: trainer.fit_loop,
        _VALIDATING: trainer.validate_loop,
        _TESTING: trainer.test_loop,
        _PREDICTING: trainer.predict_loop,
    }[trainer.state.fn.value]  # type: ignore[union-attr]


def _per_dataloader(results: Any, num_dataloaders: int) -> list[list[Any]]:
    # Lightning returns a flat list of batches for one dataloader, a list of lists for several
    if num_dataloaders > 1:
        return [list(r) for r in results]
    return [list(results)]


def merge_predictions(ranks: Sequence[_RankPredictions]) -> list[list[Any]]:
    """Merges every rank's predictions into the dataset's order, without padding duplicates.

    Each batch's output is split into samples, the samples are ordered by their index in the
    dataset (the first occurrence of an index wins: the sampler pads by repeating samples), and
    regrouped into batches of the dataloader's batch size. The result is what a single process
    returns. When outputs cannot be split by sample, or indices are unknown, the batches are
    returned rank after rank, with a warning.
    """
    num_dataloaders = max(len(r.outputs) for r in ranks)
    merged = []
    for dl in range(num_dataloaders):
        batches = [
            (out, idx)
            for rank in ranks
            if dl < len(rank.outputs)
            for out, idx in zip(
                rank.outputs[dl], _pad(rank.indices[dl], len(rank.outputs[dl])), strict=True
            )
        ]
        merged.append(_merge_one(batches))
    return merged


def _pad(indices: list[list[int]], n: int) -> list[list[int]]:
    return indices + [[]] * (n - len(indices))


def _merge_one(batches: list[tuple[Any, list[int]]]) -> list[Any]:
    samples: dict[int, Any] = {}
    batch_size = 0
    for output, indices in batches:
        pieces = _split(output, len(indices)) if indices else None
        if pieces is None:
            warnings.warn(
                "RaySGDStrategy could not split predictions by sample (the outputs have no batch "
                "dimension, or the dataloader gives no sample indices); predict returns the "
                "batches of rank 0, then rank 1, and so on",
                stacklevel=2,
            )
            return [output for output, _ in batches]
        batch_size = max(batch_size, len(indices))
        for index, piece in zip(indices, pieces, strict=True):
            samples.setdefault(index, piece)
    ordered = [samples[i] for i in sorted(samples)]
    if not ordered:
        return []
    return [_join(ordered[i : i + batch_size]) for i in range(0, len(ordered), batch_size)]


def _split(output: Any, n: int) -> list[Any] | None:
    """Splits one batch's output into ``n`` per-sample pieces, or returns None if it cannot."""
    if isinstance(output, Tensor):
        if output.dim() == 0 or output.shape[0] != n:
            return None
        return [output[i : i + 1] for i in range(n)]
    if isinstance(output, dict):
        parts = {key: _split(value, n) for key, value in output.items()}
        if any(p is None for p in parts.values()):
            return None
        return [{key: p[i] for key, p in parts.items()} for i in range(n)]  # type: ignore[index]
    if isinstance(output, (list, tuple)):
        columns = [_split(value, n) for value in output]
        if output and all(c is not None for c in columns):
            rows = [[c[i] for c in columns] for i in range(n)]  # type: ignore[index]
            return [_Row(type(output), row) for row in rows]
        if len(output) == n and all(c is None for c in columns):
            # a list with one entry per sample; a mix of batched and unbatched columns is not
            return [_Item(value) for value in output]
    return None


class _Row(NamedTuple):
    """A sample's share of a list or tuple of batched outputs."""

    kind: type
    values: list[Any]


class _Item(NamedTuple):
    """A sample's entry of a per-sample list output."""

    value: Any


def _join(pieces: list[Any]) -> Any:
    """Joins per-sample pieces made by :func:`_split` back into one batch output."""
    first = pieces[0]
    if isinstance(first, Tensor):
        return torch.cat(pieces)
    if isinstance(first, _Row):
        columns = [_join([p.values[i] for p in pieces]) for i in range(len(first.values))]
        if first.kind is list:
            return columns
        if hasattr(first.kind, "_fields"):  # a NamedTuple takes its fields one by one
            return first.kind(*columns)
        return first.kind(columns)
    if isinstance(first, _Item):
        return [p.value for p in pieces]
    if isinstance(first, dict):
        return {key: _join([p[key] for p in pieces]) for key in first}
    raise TypeError(f"cannot join prediction pieces of type {type(first).__name__}")
