"""Runs on each worker: the launcher's worker half.

:func:`run_on_worker` restores the driver's global state, takes the rank and device the group
assigned, has Lightning call this package's callbacks (hidden from ``trainer.callbacks``, as under
``ddp``: see :func:`ray_lightning_sgd._compat.hidden_callbacks`), runs the Trainer's entry point and
collects what goes back (:func:`_collect_results`). What crosses the process boundary (the
:class:`~ray_lightning_sgd._boundary.payload.Payload` that comes to every worker and the
:class:`~ray_lightning_sgd._boundary.results.WorkerOutput` that goes back) is in
:mod:`ray_lightning_sgd._boundary`.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import socket
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.backends.cudnn

from ray_lightning_sgd import _compat, _files
from ray_lightning_sgd._boundary.datasets import DatasetShard, DatasetSplit
from ray_lightning_sgd._boundary.environment import DEBUG_ENV, RayEnvironmentBase
from ray_lightning_sgd._boundary.payload import FITTING, PREDICTING, Payload, Shipped
from ray_lightning_sgd._boundary.precision import (
    WorkerHardware,
    make_plugin,
    matches,
    resolve_precision,
)
from ray_lightning_sgd._boundary.results import (
    Attributes,
    RankPredictions,
    RankZeroResults,
    WorkerOutput,
)
from ray_lightning_sgd._boundary.trainer_parts import (
    callbacks_of,
    loop_of,
    public_attributes,
    shared_objects,
)
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._serialization import Packed, in_band, pack, to_cpu, unpack
from ray_lightning_sgd._worker import artifacts
from ray_lightning_sgd._worker.events import EventForwarderBase, close_channel, open_channel
from ray_lightning_sgd._worker.output import OutputForwarder
from ray_lightning_sgd._worker.progress import ProgressReporterBase
from ray_lightning_sgd._worker.resume import BatchStartBase, ResumeCheckpointBase, logger_versions
from ray_lightning_sgd._worker.resume_from import forget, materialise, resolve_on_rank_zero
from ray_lightning_sgd._worker.storage import check_storage_from_worker
from ray_lightning_sgd._worker.trackers import LoggerReporterBase, end_runs, finalize_failed
from ray_lightning_sgd._worker_group.context import get_worker_context
from ray_lightning_sgd._worker_group.imports import import_modules
from ray_lightning_sgd._worker_group.outbox import get_outbox

if TYPE_CHECKING:
    import pytorch_lightning as pl


class _BatchIndexRecorderBase:
    """Runs on each worker. Records which samples each predicted batch held."""

    def __init__(self) -> None:
        super().__init__()
        self.indices: dict[int, list[list[int] | None]] = {}

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        indices: list[int] | None = None  # a Ray Data shard: rows in no order of the dataset's
        if not isinstance(
            getattr(_compat.predict_dataloader(trainer, dataloader_idx), "dataset", None),
            DatasetShard,
        ):
            indices = _compat.predict_batch_indices(trainer, batch_idx, dataloader_idx)
        self.indices.setdefault(dataloader_idx, []).append(indices)


def run_on_worker(
    shipped: Shipped, imports: Sequence[str], splits: Sequence[DatasetSplit], call_id: str
) -> Packed:
    """Runs on each worker. Runs the entry point under the assigned rank and collects results.

    ``shipped``: the packed payload's object, fetched here (a SIGTERM meanwhile is this call's
    notice, see :class:`Shipped`). ``imports`` are the modules the payload needs (the Trainer's
    Lightning namespace); they are imported before the payload is unpickled, see
    :func:`_freeze_what_imports_built`. ``splits`` are the call's Ray Data datasets, which the
    driver set aside from the payload: this rank's shard of each takes the dataset's place.
    ``call_id``: the attempt's id, under which the outbox opens first thing (a SIGTERM while the
    imports run or the payload arrives is this call's notice).
    """
    get_outbox().open(call_id)
    _freeze_what_imports_built(imports)
    packed = shipped.fetch()
    rank = get_worker_context().rank.global_rank
    shards = tuple(each.shard(rank) for each in splits)
    try:
        payload: Payload = unpack(packed, replacements=shards)
    except ModuleNotFoundError as err:
        raise _cannot_import(err) from err
    del packed
    results = pack(_run_payload(payload, shards))
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
    import_modules(imports)  # with the collector paused, as new workers imported torch
    if not gc.get_freeze_count():
        gc.freeze()


def _run_payload(payload: Payload, shards: tuple[DatasetShard, ...] = ()) -> WorkerOutput:
    """Runs on each worker: the call, prepared, run and its results collected (``shards``, the
    rank's shards of the call's Ray Data datasets, go back as the driver's datasets)."""
    started = time.time()  # files the call writes are newer (run_on_worker opened the outbox)
    payload.global_state.restore()
    if payload.trainer is None:  # a plain function: nothing to prepare or bring back
        try:
            return WorkerOutput(payload.function(*payload.args, **payload.kwargs), None, None)
        finally:
            close_channel()
    call = _prepare(payload, payload.trainer)
    results = _run_trainer_call(payload, call)
    return _results_of(payload, call, results, started, shards)


@dataclass
class _TrainerCall:
    """Runs on each worker: a Trainer's call as this worker runs it."""

    trainer: pl.Trainer
    flavour: Flavour
    global_rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: This package's callbacks that Lightning calls before the Trainer's own.
    first: list[Any] = field(default_factory=list)
    #: And those it calls after them.
    last: list[Any] = field(default_factory=list)
    #: A ``predict``'s record of each batch's sample indices.
    recorder: _BatchIndexRecorderBase | None = None
    #: The local path of the resume checkpoint a restarted ``fit`` resumes from.
    resume_file: str | None = None
    #: Rank 0's reporter of its loggers' runs (polled calls only).
    loggers: LoggerReporterBase | None = None

    @property
    def forwarder(self) -> EventForwarderBase | None:
        return next((cb for cb in self.last if isinstance(cb, EventForwarderBase)), None)

    @property
    def resume_callback(self) -> ResumeCheckpointBase | None:
        return next((cb for cb in self.last if isinstance(cb, ResumeCheckpointBase)), None)


def _prepare(payload: Payload, trainer: pl.Trainer) -> _TrainerCall:
    """Runs on each worker: the Trainer set up for this worker's rank, device and precision,
    this package's callbacks made, and a restarted ``fit`` pointed at its resume checkpoint."""
    strategy = trainer.strategy
    environment = getattr(strategy, "cluster_environment", None)
    if not isinstance(environment, RayEnvironmentBase):
        raise TypeError(f"the Trainer's strategy has no RayEnvironment, but {environment!r}")
    flavour: Flavour = strategy.flavour  # type: ignore[attr-defined]
    global_rank = get_worker_context().rank.global_rank
    if os.environ.get(DEBUG_ENV) == "1":  # the strategy's debug switch
        for name in (flavour.namespace, "torch.distributed"):
            logging.getLogger(name).setLevel(logging.DEBUG)
    use_own_hardware(strategy, environment, flavour, global_rank)
    strategy.set_world_ranks()  # type: ignore[attr-defined]
    if payload.global_batch_workers:
        # sizes that divide the most are the only ones such a run takes
        factor = payload.global_batch_workers // environment.world_size()
        trainer.accumulate_grad_batches *= factor
    call = _TrainerCall(trainer, flavour, global_rank, payload.args, payload.kwargs)
    if payload.resume_storage is not None and trainer.state.fn == FITTING:
        _files.use_storage_options(payload.resume_storage, payload.storage_options)
        if global_rank == 0:
            check_storage_from_worker(payload.resume_storage)
    _add_callbacks(payload, call)
    resume = None
    if trainer.state.fn == FITTING and payload.resume is not None:
        # the point, or an older one if its file is gone: rank 0 decides for every rank
        device = environment.device if environment.device.type == "cuda" else None
        resume = resolve_on_rank_zero(payload.resume, device)
        call.resume_file = materialise(resume)
        call.args, call.kwargs = _compat.with_ckpt_path(
            payload.function, call.args, call.kwargs, call.resume_file
        )
    if trainer.state.fn == FITTING and global_rank == 0:
        # the only rank whose loggers write: one folder or run a fit, across its restarts (from
        # the resume point's step on, trained again; from the start without one)
        versions = payload.logger_versions or (() if resume is None else resume.logger_versions)
        for logger, version in zip(trainer.loggers, versions, strict=False):
            _compat.continue_logger(logger, version, 0 if resume is None else resume.logged_step)
    return call


def _add_callbacks(payload: Payload, call: _TrainerCall) -> None:
    """Runs on each worker: makes this package's callbacks for the call (the Trainer's progress
    bars go: the driver shows rank 0's progress instead)."""
    trainer, flavour = call.trainer, call.flavour
    if trainer.state.fn == PREDICTING:
        call.recorder = _callback_class(flavour, _BatchIndexRecorderBase)()
        call.last.append(call.recorder)
    for bar in [cb for cb in callbacks_of(trainer) if isinstance(cb, flavour.progress_bar)]:
        callbacks_of(trainer).remove(bar)
    if payload.forward_events and call.global_rank == 0:
        call.last.append(_callback_class(flavour, EventForwarderBase)())
    if payload.report_progress:
        call.last.append(_callback_class(flavour, ProgressReporterBase)())
        if call.global_rank == 0:
            call.loggers = _callback_class(flavour, LoggerReporterBase)(payload.logged_steps)
            call.first.append(call.loggers)
    fitting = trainer.state.fn == FITTING
    if fitting and (payload.resume_every_n_epochs or payload.resume_on_preemption):
        resume_callback = _callback_class(flavour, ResumeCheckpointBase)(
            payload.resume_every_n_epochs,
            payload.resume_storage,
            keep_last=payload.resume_keep_last,
            at_fit_end=payload.resume_at_fit_end,
            on_preemption=payload.resume_on_preemption,
            resumed=payload.resume is not None,
            every_n_steps=payload.resume_every_n_steps,
            every_s=payload.resume_every_s,
        )
        call.last.append(resume_callback)  # last: an epoch's checkpoint holds the others' work
        # first: a fit stopped at a batch's start stops before the others' hooks for it
        call.first.append(_callback_class(flavour, BatchStartBase)(resume_callback))


def _run_trainer_call(payload: Payload, call: _TrainerCall) -> Any:
    """Runs on each worker: the Trainer's entry point, its output sent to the driver, this
    package's callbacks called by Lightning but hidden from user code (as under ``ddp``)."""
    trainer, namespace = call.trainer, call.flavour.namespace
    tuner_exits = (_compat.tuner_exit_exception(namespace),)
    forwarder = call.forwarder
    open_channel(forwarder)  # the driver polls a Trainer's call: send_to_driver works there
    hidden = _compat.hidden_callbacks(trainer, namespace, call.first, call.last)
    resume = call.resume_callback
    try:
        with OutputForwarder(), hidden:
            try:
                result = payload.function(*call.args, **call.kwargs)
            except tuner_exits:  # a tuner finished: end the call as Lightning's handler does
                _compat.end_after_tuner_exit(trainer, namespace)
                result = None
            if resume is not None:  # its last checkpoint's upload, before the results go
                resume.finish(trainer, payload.report_progress)
            return result
    except BaseException:
        if resume is not None:
            resume.uploads.abandon()
        if forwarder is not None:
            forwarder.send_now()  # the driver's view gets the steps before the error
        # as Lightning's handler in each ddp process
        finalize_failed(trainer, call.global_rank, call.loggers)
        raise
    finally:
        if call.loggers is not None:
            call.loggers.unwrap()
        close_channel()
        if call.resume_file is not None:
            forget(call.resume_file)  # a killed worker's copy: see _scratch.sweep


def _results_of(
    payload: Payload,
    call: _TrainerCall,
    results: Any,
    started: float,
    shards: tuple[DatasetShard, ...] = (),
) -> WorkerOutput:
    """Runs on each worker: what goes back to the driver; rank 0's with the files it wrote."""
    if call.global_rank == 0:
        end_runs(call.trainer)  # what the process would end at its exit under ddp
    collected = _collect_results(call.trainer, results, call.global_rank, call.recorder, shards)
    if collected.rank_zero is None:
        return collected
    files = artifacts.collect(payload.artifacts, call.trainer, started)
    checkpoint = collected.rank_zero.checkpoint
    if call.resume_file is not None and checkpoint[0] == call.resume_file:
        # a restarted fit restored our resume checkpoint (a copy deleted now, or a storage's
        # file): the driver holds the path the user's call gave, as without the restart
        given = _compat.ckpt_path_of(payload.function, payload.args, payload.kwargs)
        checkpoint = (None if given is None else str(given), checkpoint[1])
    return collected._replace(
        rank_zero=collected.rank_zero._replace(files=files, checkpoint=checkpoint)
    )


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
    trainer: pl.Trainer,
    results: Any,
    global_rank: int,
    recorder: _BatchIndexRecorderBase | None,
    shards: tuple[DatasetShard, ...] = (),
) -> WorkerOutput:
    """Runs on each worker. Gathers what the driver needs: everything from rank 0, and each
    rank's predictions."""
    # every rank computes the state dict, in case metrics in the model synchronise in it (and a
    # sharded strategy gathers it: a collective); after every call, as validate/test may change
    # buffers or load a checkpoint's weights (ckpt_path)
    # (none with return_weights=False: the weights stay in the cluster)
    wanted = getattr(trainer.strategy, "return_weights", True)
    model_state = trainer.strategy.full_state_dict() if wanted else None  # type: ignore[attr-defined]
    # and the buffers the state dict leaves out (every rank too: a sharded one is gathered)
    buffers = trainer.strategy.non_persistent_buffers() if wanted else None  # type: ignore[attr-defined]
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
        model_state=None if model_state is None else pack(to_cpu(model_state)),
        # tensors go back on the CPU: the driver may have no GPU to unpickle them onto
        loop_state=to_cpu(loop_of(trainer).state_dict()),
        callback_states={
            cb.state_key: to_cpu(cb.state_dict()) for cb in callbacks_of(trainer) if cb.state_dict()
        },
        attributes=_attributes(trainer, shards),
        # rank 0 alone reads them: the committed dicts, as the properties could start a collective
        callback_metrics=to_cpu(dict(callback_metrics)),
        logged_metrics=to_cpu(dict(logged_metrics)),
        progress_bar_metrics=to_cpu(dict(progress_bar_metrics)),
        should_stop=trainer.should_stop,
        files={},
        logger_versions=logger_versions(trainer),
        checkpoint=_compat.checkpoint_selection(trainer),
        batch_counts=_compat.batch_counts(trainer),
        buffers=None if buffers is None else to_cpu(buffers),
    )
    return WorkerOutput(to_cpu(results), rank_zero, predictions)


def _attributes(trainer: pl.Trainer, shards: tuple[DatasetShard, ...] = ()) -> Attributes:
    """Runs on rank 0. Packs :class:`Attributes`; what cannot be pickled is left out and named.
    A shard of a Ray Data dataset goes back as the name of the driver's dataset."""
    model = trainer.lightning_module
    datamodule = getattr(trainer, "datamodule", None)
    named = shared_objects(trainer, model, datamodule, shards)
    shared = {id(obj): name for name, obj in named.items()}
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
    # (and with return_weights=False they are as large as the model: neither comes back)
    fitted = (
        trainer.state.fn == FITTING
        and not getattr(trainer.strategy, "sharded", False)
        and getattr(trainer.strategy, "return_weights", True)
    )
    return Attributes(
        callbacks=[(key, state) for key, state in callbacks if state is not None],
        loggers=[
            item(_compat.trackers.portable_state(logger), f"logger {type(logger).__name__}")
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


def _per_dataloader(results: Any, num_dataloaders: int) -> list[list[Any]]:
    # Lightning returns a flat list of batches for one dataloader, a list of lists for several
    if num_dataloaders > 1:
        return [list(r) for r in results]
    return [list(results)]
