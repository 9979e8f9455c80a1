"""Runs on each worker: the launcher's worker half.

:func:`run_on_worker` restores the driver's global state, takes the rank and device the group
assigned, has Lightning call this package's callbacks (hidden from ``trainer.callbacks``, as under
``ddp``: see :func:`ray_lightning_sgd._compat.hidden_callbacks`), runs the Trainer's entry point and
collects what goes back (:func:`_collect_results`). What crosses the process boundary is spelled out here as named tuples:
the :class:`Payload` that goes to every worker and the :class:`WorkerOutput` that comes back.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import random
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.backends.cudnn
from torch import Tensor

from ray_lightning_sgd import _compat
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._serialization import Packed, in_band, pack, to_cpu, unpack
from ray_lightning_sgd._worker import artifacts
from ray_lightning_sgd._worker.environment import RayEnvironmentBase
from ray_lightning_sgd._worker.events import EventForwarderBase, close_channel, open_channel
from ray_lightning_sgd._worker.hardware import (
    WorkerHardware,
    make_plugin,
    matches,
    resolve_precision,
)
from ray_lightning_sgd._worker.output import OutputForwarder
from ray_lightning_sgd._worker.progress import ProgressReporterBase
from ray_lightning_sgd._worker.resume import (
    BatchStartBase,
    ResumeCheckpointBase,
    ResumePoint,
    forget,
    logger_versions,
    materialise,
    resolve_on_rank_zero,
)
from ray_lightning_sgd._worker_group.context import get_worker_context
from ray_lightning_sgd._worker_group.outbox import get_outbox

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback


# the values of Lightning's TrainerFn, the same in both namespaces
FITTING, VALIDATING, TESTING, PREDICTING = "fit", "validate", "test", "predict"


#: Environment variables of the driver that Lightning's spawned processes inherit and read.
_INHERITED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")


class Payload(NamedTuple):
    """What goes to every worker, as one object in Ray's object store."""

    trainer: pl.Trainer | None
    function: Callable
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    global_state: GlobalState
    #: This attempt's id: the workers' outboxes are opened under it.
    call_id: str
    #: Where a restarted ``fit`` resumes from.
    resume: ResumePoint | None = None
    #: Whether rank 0 sends its callback events to the driver.
    forward_events: bool = False
    #: Whether each rank notes its progress, for the driver's progress timeout.
    report_progress: bool = False
    #: Epochs between resume checkpoints of a ``fit``; 0: none (no restarts).
    resume_every_n_epochs: int = 0
    #: Whether a ``fit`` writes a resume checkpoint at the step where a worker got SIGTERM.
    resume_on_preemption: bool = False
    #: Where rank 0 writes them: this launch's own folder of ``checkpoint_storage`` (runs that
    #: share the storage, Tune trials, never overwrite each other's), or None: to the driver.
    resume_storage: str | None = None
    #: How many resume checkpoints rank 0 keeps in ``resume_storage`` (older ones are deleted).
    resume_keep_last: int = 2
    #: Whether the storage folder outlives the fit (a named run, which a new driver resumes).
    resume_storage_kept: bool = False
    #: Where the driver expects rank 0's logs and checkpoints.
    artifacts: artifacts.Artifacts | None = None
    #: Whether the results travel without out-of-band buffers: the driver is a Ray Client,
    #: whose server pickles them once more and cannot pickle the buffers Ray hands it.
    results_in_band: bool = False
    #: An elastic run that keeps its global batch: the most workers it may have (0: it does
    #: not); each worker multiplies ``accumulate_grad_batches`` by that over the world size.
    global_batch_workers: int = 0


class RankZeroResults(NamedTuple):
    """What rank 0 sends back: everything the driver's Trainer and model need."""

    state: Any  # the TrainerState of the Trainer's namespace
    #: The model's state dict, packed on its own so that the driver can copy it into its model
    #: straight from Ray's object store (:func:`unpack` with ``copy=False``).
    model_state: Packed | None
    loop_state: dict[str, Any]
    #: Each callback's ``state_dict()``: what the driver's callback loads when
    #: :attr:`attributes` could not be packed for it.
    callback_states: dict[str, dict[str, Any]]
    #: Rank 0's objects as ``ddp``'s driver would hold them (see :func:`_attributes`).
    attributes: Attributes
    callback_metrics: dict[str, Any]
    logged_metrics: dict[str, Any]
    progress_bar_metrics: dict[str, Any]
    should_stop: bool
    #: Files rank 0 wrote that the driver cannot see (see :mod:`ray_lightning_sgd._worker.artifacts`).
    files: dict[str, bytes]
    #: Each logger's version, as rank 0 chose it.
    logger_versions: list[Any]
    #: ``Trainer.ckpt_path`` (the checkpoint the call restored) and whether the user set it
    #: (see :func:`ray_lightning_sgd._compat.checkpoint_selection`).
    checkpoint: tuple[Any, bool] = (None, False)


class RankPredictions(NamedTuple):
    """One rank's predictions: per dataloader, per batch, the outputs and the samples' indices."""

    outputs: list[list[Any]]
    indices: list[list[list[int]]]


class WorkerOutput(NamedTuple):
    """What one worker returns from :func:`run_on_worker`."""

    results: Any
    rank_zero: RankZeroResults | None
    predictions: RankPredictions | None


@dataclass(frozen=True)
class GlobalState:
    """The process-global state that Lightning's spawn launcher carries into its processes."""

    use_deterministic_algorithms: bool
    deterministic_warn_only: bool
    cudnn_benchmark: bool
    python_rng: Any
    numpy_rng: Any
    torch_rng: Tensor
    #: The seed of torch's default generator (``torch.manual_seed`` seeds every CUDA device with
    #: it too): a worker seeds its CUDA devices with it.
    torch_seed: int
    env: dict[str, str]

    @classmethod
    def capture(cls) -> GlobalState:
        """Driver side: captures the flags, RNG states and inherited environment variables."""
        return cls(
            use_deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            python_rng=random.getstate(),
            numpy_rng=np.random.get_state(),
            torch_rng=torch.get_rng_state(),
            torch_seed=torch.initial_seed(),
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
        if torch.cuda.is_available():
            # as a process of Lightning's ddp, which ran seed_everything itself: the CUDA
            # generators start from the seed (the driver may have no GPU, or other ones)
            torch.cuda.manual_seed_all(self.torch_seed)
        for key in _INHERITED_ENV:
            os.environ.pop(key, None)
        os.environ.update(self.env)


class _BatchIndexRecorderBase:
    """Runs on each worker. Records which samples each predicted batch held."""

    def __init__(self) -> None:
        super().__init__()
        self.indices: dict[int, list[list[int]]] = {}

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        indices = _compat.predict_batch_indices(trainer, batch_idx, dataloader_idx)
        self.indices.setdefault(dataloader_idx, []).append(indices)


def run_on_worker(packed: Packed, imports: Sequence[str] = ()) -> Packed:
    """Runs on each worker. Runs the entry point under the assigned rank and collects results.

    ``imports`` are the modules the payload needs (the Trainer's Lightning namespace); they are
    imported before the payload is unpickled, see :func:`_freeze_what_imports_built`.
    """
    _freeze_what_imports_built(imports)
    try:
        payload: Payload = unpack(packed)
    except ModuleNotFoundError as err:
        raise _cannot_import(err) from err
    del packed
    results = pack(_run_payload(payload))
    return in_band(results) if payload.results_in_band else results


def _cannot_import(err: ModuleNotFoundError) -> ModuleNotFoundError:
    """Runs on a worker that cannot import a module that the driver's objects need: the error
    names the module, this worker's node and what makes the module importable here."""
    import ray

    node = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
    error = ModuleNotFoundError(
        f"a worker on node {node} cannot import {err.name!r}, which the driver's Trainer, model "
        f"or data need ({err}). Install it on every node (pip install), or, for the driver's own "
        "code, keep ship_driver_code=True (the default): the driver's modules imported from "
        "folders outside site-packages reach every worker",
        name=err.name,
    )
    return error


def _freeze_what_imports_built(imports: Sequence[str]) -> None:
    """Runs on each worker. Imports ``imports``, then, once per process, freezes every object
    alive (``gc.freeze``): modules, classes, what the imports built, none of a call's objects.

    With Lightning imported a process tracks some 400,000 objects, and a full collection walks
    them all (0.2 s here): the one between two calls on warm workers (see
    :mod:`ray_lightning_sgd._executor.pool`) and those the interpreter starts during training.
    Frozen, they are skipped; what calls make is still collected, as nothing later is frozen.
    """
    for name in imports:
        importlib.import_module(name)
    if not gc.get_freeze_count():
        gc.freeze()


def _run_payload(payload: Payload) -> WorkerOutput:
    started = time.time()  # files the call writes are newer
    get_outbox().open(payload.call_id)
    global_rank = get_worker_context().rank.global_rank
    payload.global_state.restore()
    trainer = payload.trainer
    recorder = None
    args, kwargs = payload.args, payload.kwargs
    ours: list[Any] = []  # this package's callbacks, called after the Trainer's own
    first: list[Any] = []  # and those called before them
    hidden: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    resume_file = None
    tuner_exits: tuple[type[BaseException], ...] = ()
    if trainer is not None:
        strategy = trainer.strategy
        environment = getattr(strategy, "cluster_environment", None)
        if not isinstance(environment, RayEnvironmentBase):
            raise TypeError(f"the Trainer's strategy has no RayEnvironment, but {environment!r}")
        flavour: Flavour = strategy.flavour  # type: ignore[attr-defined]
        use_own_hardware(strategy, environment, flavour, global_rank)
        strategy.set_world_ranks()  # type: ignore[attr-defined]
        if payload.global_batch_workers:
            # sizes that divide the most are the only ones such a run takes
            factor = payload.global_batch_workers // environment.world_size()
            trainer.accumulate_grad_batches *= factor
        fitting = trainer.state.fn == FITTING
        tuner_exits = (_compat.tuner_exit_exception(flavour.namespace),)
        if trainer.state.fn == PREDICTING:
            recorder = _callback_class(flavour, _BatchIndexRecorderBase)()
            ours.append(recorder)
        for bar in [cb for cb in callbacks_of(trainer) if isinstance(cb, flavour.progress_bar)]:
            callbacks_of(trainer).remove(bar)  # the driver shows rank 0's progress instead
        if payload.forward_events and global_rank == 0:
            ours.append(_callback_class(flavour, EventForwarderBase)())
        if payload.report_progress:
            ours.append(_callback_class(flavour, ProgressReporterBase)())
        if fitting and (payload.resume_every_n_epochs or payload.resume_on_preemption):
            resume_callback = _callback_class(flavour, ResumeCheckpointBase)(
                payload.resume_every_n_epochs,
                payload.resume_storage,
                keep_last=payload.resume_keep_last,
                keep_folder=payload.resume_storage_kept,
                on_preemption=payload.resume_on_preemption,
                resumed=payload.resume is not None,
            )
            ours.append(resume_callback)  # last: an epoch's checkpoint holds the others' work
            # first: a fit stopped at a batch's start stops before the others' hooks for it
            first.append(_callback_class(flavour, BatchStartBase)(resume_callback))
        if fitting and payload.resume is not None:
            # the point, or an older one if its file is gone: rank 0 decides for every rank
            device = environment.device if environment.device.type == "cuda" else None
            resume = resolve_on_rank_zero(payload.resume, device)
            resume_file = materialise(resume)
            if global_rank == 0:  # the only rank whose loggers write: one folder a run
                for logger, version in zip(trainer.loggers, resume.logger_versions, strict=False):
                    _compat.continue_logger(logger, version, resume.logged_step)
            args, kwargs = _compat.with_ckpt_path(payload.function, args, kwargs, resume_file)
        # Lightning calls them, but user code does not see them in trainer.callbacks (ddp's)
        hidden = _compat.hidden_callbacks(trainer, flavour.namespace, first, ours)
    output: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if trainer is not None:  # a Trainer's call: its output to the driver
        output = OutputForwarder()
    forwarder = next((cb for cb in ours if isinstance(cb, EventForwarderBase)), None)
    if trainer is not None:  # the driver polls a Trainer's call: send_to_driver works there
        open_channel(forwarder)
    try:
        with output, hidden:
            try:
                results = payload.function(*args, **kwargs)
            except tuner_exits:  # a tuner finished: end the call as Lightning's handler does
                _compat.end_after_tuner_exit(trainer, flavour.namespace)
                results = None
    except BaseException:
        if forwarder is not None:
            forwarder.send_now()  # the driver's view gets the steps before the error
        raise
    finally:
        close_channel()
        if resume_file is not None and payload.resume is not None:
            forget(payload.resume, resume_file)  # a killed worker's copy: see scratch.sweep
    if trainer is None:
        return WorkerOutput(results, None, None)
    collected = _collect_results(trainer, results, global_rank, recorder)
    if collected.rank_zero is not None:
        files = artifacts.collect(payload.artifacts, trainer, started)
        checkpoint = collected.rank_zero.checkpoint
        if resume_file is not None and checkpoint[0] == resume_file:
            # a restarted fit restored our resume checkpoint (a copy deleted now, or a storage's
            # file): the driver holds the path the user's call gave, as without the restart
            given = _compat.ckpt_path_of(payload.function, payload.args, payload.kwargs)
            checkpoint = (None if given is None else str(given), checkpoint[1])
        collected = collected._replace(
            rank_zero=collected.rank_zero._replace(files=files, checkpoint=checkpoint)
        )
    return collected


def use_own_hardware(
    strategy: Any, environment: RayEnvironmentBase, flavour: Flavour, global_rank: int
) -> None:
    """Runs on each worker. Gives the strategy this worker's accelerator, devices and the
    precision plugin Lightning would pick on this machine for what the user asked for (the
    driver's Trainer picked them for the driver's machine).

    Raises:
        ConfigurationError: This worker's device cannot train with the precision asked for.
    """
    device = environment.device
    hardware = WorkerHardware.detect(device)
    on_gpu = device.type == "cuda"
    if on_gpu != isinstance(strategy.accelerator, flavour.cuda_accelerator):
        accelerator = flavour.cuda_accelerator if on_gpu else flavour.cpu_accelerator
        strategy.accelerator = accelerator()
    # a node's devices, as Lightning's DDP lists them: the GPUs of the node's workers (the
    # worker group made them visible to each), or one CPU per worker of the node
    strategy.parallel_devices = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if on_gpu
        else [device] * environment.local_world_size
    )
    request = strategy.precision_request
    family = strategy.precision_family
    choice = resolve_precision(request, hardware)
    if not matches(strategy.precision_plugin, choice, flavour.plugins, family):
        strategy.precision_plugin = make_plugin(choice, request, flavour.plugins, family)
        if choice.note and global_rank == 0:
            warnings.warn(choice.note, stacklevel=2)


@functools.cache
def _callback_class(flavour: Flavour, base: type) -> type:
    """``base`` as a Callback of the flavour's namespace."""
    return type(base.__name__.removesuffix("Base"), (base, flavour.callback), {})


def _collect_results(
    trainer: pl.Trainer, results: Any, global_rank: int, recorder: _BatchIndexRecorderBase | None
) -> WorkerOutput:
    """Runs on each worker. Gathers what the driver needs: everything from rank 0, and each
    rank's predictions."""
    # every rank computes the state dict, in case metrics in the model synchronise in it (and a
    # sharded strategy gathers it: a collective); after every call, as validate/test may change
    # buffers or load a checkpoint's weights (ckpt_path)
    model_state = trainer.strategy.full_state_dict()  # type: ignore[attr-defined]
    predictions = None
    if recorder is not None:
        if results is not None:
            outputs = _per_dataloader(results, trainer.predict_loop.num_dataloaders)
            indices = [recorder.indices.get(i, []) for i in range(len(outputs))]
            predictions = RankPredictions(outputs, indices)
        results = None  # the driver merges every rank's predictions instead
    if global_rank != 0:
        return WorkerOutput(None, None, predictions)
    progress_bar_metrics, callback_metrics, logged_metrics = _compat.committed_metrics(trainer)
    rank_zero = RankZeroResults(
        state=trainer.state,
        model_state=pack(to_cpu(model_state)),
        # tensors go back on the CPU: the driver may have no GPU to unpickle them onto
        loop_state=to_cpu(loop_of(trainer).state_dict()),
        callback_states={
            cb.state_key: to_cpu(cb.state_dict()) for cb in callbacks_of(trainer) if cb.state_dict()
        },
        attributes=_attributes(trainer),
        # rank 0 alone reads them: the committed dicts, as the properties could start a collective
        callback_metrics=to_cpu(dict(callback_metrics)),
        logged_metrics=to_cpu(dict(logged_metrics)),
        progress_bar_metrics=to_cpu(dict(progress_bar_metrics)),
        should_stop=trainer.should_stop,
        files={},
        logger_versions=logger_versions(trainer),
        checkpoint=_compat.checkpoint_selection(trainer),
    )
    return WorkerOutput(to_cpu(results), rank_zero, predictions)


class Attributes(NamedTuple):
    """Rank 0's objects that the driver holds copies of, as ``ddp``'s driver (rank 0) holds them.

    Each item is packed on its own (:func:`_attributes`), so that one the driver cannot rebuild
    costs only itself; references to the Trainer, its strategy and model, the datamodule, a layer
    or parameter of the model, a callback or a logger travel by name (:func:`shared_objects`).
    """

    #: Each callback's ``state_key`` and its attributes (``__getstate__()``): all its state,
    #: ``state_dict()`` or not (a checkpoint's current score, an LR finder's result).
    callbacks: list[tuple[str, Packed]]
    #: Each logger's attributes, or None (a CSV logger's writer appends to the fit's file).
    loggers: list[Packed | None]
    #: The model's and the datamodule's public attributes (and hyperparameters), set on rank 0
    #: (an LR finder's ``lr``, a batch size finder's ``batch_size``).
    model: dict[str, Packed]
    datamodule: dict[str, Packed] | None
    #: After ``fit``: the optimizers and LR scheduler configs together, over the driver's
    #: parameters (``trainer.optimizers`` and the driver's ``save_checkpoint`` hold them).
    optimizers: Packed | None
    #: The profiler's attributes (``ddp``'s driver holds rank 0's set-up profiler: its
    #: ``dirpath``, what it recorded); None where they could not be packed.
    profiler: Packed | None
    #: What could not be pickled and stayed on the workers (the driver warns, naming each).
    left_out: list[str]


def _attributes(trainer: pl.Trainer) -> Attributes:
    """Runs on rank 0. Packs :class:`Attributes`; what cannot be pickled is left out and named."""
    model = trainer.lightning_module
    datamodule = getattr(trainer, "datamodule", None)
    shared = {id(obj): name for name, obj in shared_objects(trainer, model, datamodule).items()}
    left_out: list[str] = []

    def item(value: Any, what: str) -> Packed | None:
        try:
            return pack(value, shared=shared, cpu=True)
        except Exception as err:  # noqa: BLE001  (a user's object that cannot be pickled)
            left_out.append(f"{what} ({type(err).__name__}: {err})")
            return None

    def items(attributes: dict[str, Any], owner: str) -> dict[str, Packed]:
        packed = {key: item(value, f"{owner}.{key}") for key, value in attributes.items()}
        return {key: value for key, value in packed.items() if value is not None}

    callbacks = [
        (cb.state_key, item(cb.__getstate__(), f"callback {cb.state_key}"))
        for cb in callbacks_of(trainer)
    ]
    # a sharded strategy's optimizers hold shards (gathering them is a collective on every rank)
    fitted = trainer.state.fn == FITTING and not getattr(trainer.strategy, "sharded", False)
    return Attributes(
        callbacks=[(key, state) for key, state in callbacks if state is not None],
        loggers=[
            item(logger.__getstate__(), f"logger {type(logger).__name__}")
            for logger in trainer.loggers
        ],
        model=items(public_attributes(model), "model"),
        datamodule=None
        if datamodule is None
        else items(public_attributes(datamodule), "datamodule"),
        optimizers=(
            item((list(trainer.optimizers), list(trainer.lr_scheduler_configs)), "the optimizers")
            if fitted
            else None
        ),
        profiler=item(
            _compat.profiler_state(trainer.profiler),  # type: ignore[attr-defined]
            "the profiler",
        ),
        left_out=left_out,
    )


def shared_objects(trainer: Any, model: Any, datamodule: Any) -> dict[str, Any]:
    """The objects that both the driver and rank 0 hold, by the name each travels under
    (:func:`~ray_lightning_sgd._serialization.pack`'s ``shared``): a reference to one of them
    comes back as the driver's own."""
    names = {"trainer": trainer, "strategy": trainer.strategy, "module:": model}
    # DDP's wrapper on a worker; the model itself on the driver
    names["wrapped model"] = getattr(trainer.strategy, "model", None) or model
    if datamodule is not None:
        names["datamodule"] = datamodule
    keys = [cb.state_key for cb in callbacks_of(trainer)]
    for callback in callbacks_of(trainer):
        if keys.count(callback.state_key) == 1:
            names[f"callback:{callback.state_key}"] = callback
    for index, logger in enumerate(trainer.loggers):
        names[f"logger:{index}"] = logger
    # a submodule compiled on the workers only (configure_model) has the driver's names
    for name, module in model.named_modules():
        names.setdefault(f"module:{name.replace('._orig_mod', '')}", module)
    for name, parameter in model.named_parameters():
        names[f"parameter:{name.replace('._orig_mod', '')}"] = parameter
    return names


def public_attributes(obj: Any) -> dict[str, Any]:
    """An object's attributes whose names do not start with ``_`` (but its hyperparameters): what
    user code sets on a model or datamodule. Less torch's module flag ``training`` and the
    object's own methods (DDP's forward redirection leaves ``forward`` in the model's
    ``__dict__``)."""
    return {
        key: value
        for key, value in vars(obj).items()
        if (not key.startswith("_") or key == "_hparams")
        and key != "training"
        and getattr(value, "__self__", None) is not obj
    }


def callbacks_of(trainer: pl.Trainer) -> list[Callback]:
    # the Trainer sets this attribute in its callback connector, where type checkers do not see it
    return trainer.callbacks  # type: ignore[attr-defined]


def loop_of(trainer: pl.Trainer) -> Any:
    return {
        FITTING: trainer.fit_loop,
        VALIDATING: trainer.validate_loop,
        TESTING: trainer.test_loop,
        PREDICTING: trainer.predict_loop,
    }[trainer.state.fn.value]  # type: ignore[union-attr]


def _per_dataloader(results: Any, num_dataloaders: int) -> list[list[Any]]:
    # Lightning returns a flat list of batches for one dataloader, a list of lists for several
    if num_dataloaders > 1:
        return [list(r) for r in results]
    return [list(results)]
