"""Driver side: rank 0's results copied into the driver's Trainer and model; every rank's predictions merged."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.backends.cudnn
from torch import Tensor

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.payload import PREDICTING
from ray_lightning_sgd._boundary.results import Attributes, RankPredictions, WorkerOutput
from ray_lightning_sgd._boundary.trainer_parts import callbacks_of, loop_of, shared_objects
from ray_lightning_sgd._driver import artifacts
from ray_lightning_sgd._serialization import Packed, unpack
from ray_lightning_sgd.exceptions import WorkerGroupError

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


def recover_results_in_driver(
    trainer: pl.Trainer,
    outputs: Sequence[WorkerOutput],
    datamodule: Any = None,
    datasets: Sequence[Any] = (),
) -> Any:
    """Driver side: leaves the Trainer, the model and the call's ``datamodule`` with what rank 0's
    hold, as a ``ddp`` run's driver (rank 0) holds them; returns the call's result. Where rank 0
    held its shard of a Ray Data dataset, the driver keeps its dataset (``datasets``: the
    call's, in the order the payload set them aside).
    """
    rank_zero = outputs[0].rank_zero
    if rank_zero is None:
        raise WorkerGroupError("rank 0 sent no results back: the worker's half is out of step")
    artifacts.write(rank_zero.files)
    model = trainer.lightning_module
    if rank_zero.model_state is not None:
        load_weights(model, unpack(rank_zero.model_state, copy=False), rank_zero.buffers)
    model.trainer = trainer
    trainer.state = rank_zero.state
    trainer.should_stop = rank_zero.should_stop
    _compat.set_checkpoint_selection(trainer, rank_zero.checkpoint)
    loop = loop_of(trainer)
    loop.load_state_dict(rank_zero.loop_state)
    _compat.mark_loop_finished(loop)
    _compat.set_batch_counts(trainer, rank_zero.batch_counts or {})
    restored = _restore_attributes(trainer, model, datamodule, rank_zero.attributes, datasets)
    for logger, version in zip(trainer.loggers, rank_zero.logger_versions, strict=False):
        if id(logger) not in restored:
            _compat.trackers.set_version(logger, version)
    for callback in callbacks_of(trainer):
        state = rank_zero.callback_states.get(callback.state_key)
        if state and id(callback) not in restored:
            if getattr(callback, "dirpath", False) is None and state.get("dirpath") is not None:
                # a ModelCheckpoint resolves its directory in setup, which ran on the workers
                # only; it restores its paths and scores only into the same directory
                callback.dirpath = state["dirpath"]  # type: ignore[attr-defined]
            callback.load_state_dict(state)
    if datamodule is not None:
        # as Lightning attaches it in the call, which ran on the workers
        trainer.datamodule = datamodule  # type: ignore[attr-defined]
        datamodule.trainer = trainer
    for target, source in (
        (trainer.callback_metrics, rank_zero.callback_metrics),
        (trainer.logged_metrics, rank_zero.logged_metrics),
        (trainer.progress_bar_metrics, rank_zero.progress_bar_metrics),
    ):
        target.clear()
        target.update(source)
    if trainer.state.fn == PREDICTING:
        ranks = [out.predictions for out in outputs]
        if any(p is None for p in ranks):
            return None
        merged = merge_predictions([p for p in ranks if p is not None])
        return merged[0] if len(merged) == 1 else merged
    return outputs[0].results


def load_weights(
    model: torch.nn.Module, state: dict[str, Tensor], buffers: dict[str, Tensor] | None = None
) -> None:
    """Driver side: copies rank 0's weights into the driver's model; never silently partial.

    A submodule that ``configure_model`` compiled on the workers names its weights
    ``<name>._orig_mod.<...>``; they load into the driver's uncompiled submodule. Other keys that
    do not match (layers a hook built or removed on the workers only) are named in a warning.
    """
    own = model.state_dict(keep_vars=True)  # the model's own tensors: parameters as such
    if state.keys() != own.keys():
        renamed = {_compat.torch.uncompiled_name(key): value for key, value in state.items()}
        if renamed.keys() == own.keys():
            state = renamed
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    reshaped = sorted(
        key
        for key in state.keys() & own.keys()
        if isinstance(own[key], Tensor)  # a module's extra state (get_extra_state) is any object
        and isinstance(state[key], Tensor)
        and own[key].shape != state[key].shape
    )
    state = {key: value for key, value in state.items() if key not in reshaped}
    # a model built on the meta device (``init_module(empty_init=True)``, ``torch.device("meta")``)
    # that the workers materialised: its tensors take rank 0's (owned copies: ``state`` views
    # Ray's object store), as copying into a meta tensor does nothing
    on_meta = [key for key in state if isinstance(own.get(key), Tensor) and own[key].is_meta]
    if on_meta:
        _assign(model, {key: state[key] for key in on_meta})
        state = {key: value for key, value in state.items() if key not in on_meta}
    _take_dtypes(model, own, state)  # the keys left hold the tensors ``own`` has
    if missing or unexpected or reshaped:
        warnings.warn(
            "The weights rank 0 sent back do not fit the driver's model, so only the matching ones "
            f"were loaded: missing {_few(missing)}, unexpected {_few(unexpected)}, of another "
            f"shape {_few(reshaped)}. A hook that "
            "ran on the workers only (configure_model, setup) changed the model's layers; build "
            "them in __init__, or load the weights from a checkpoint the run saved",
            RuntimeWarning,
            stacklevel=2,
        )
    model.load_state_dict(state, strict=False)
    for table, name, tensor in _buffer_slots(model, buffers or {}):  # load_state_dict skips them
        held = table[name]
        if held is None or held.is_meta or held.shape != tensor.shape or held.dtype != tensor.dtype:
            table[name] = tensor.clone()  # an owned copy (``tensor`` views Ray's object store)
        else:
            held.copy_(tensor)
    named = set(missing) | set(reshaped)  # named in the warning above already
    still = [name for name, tensor in _tensors(model) if tensor.is_meta and name not in named]
    if still:
        warnings.warn(
            f"The driver's model still has tensors on the meta device after rank 0's weights "
            f"were loaded: {_few(still)}. Rank 0's model has none of that name (a hook that ran "
            "on the workers only built or renamed them); the next call would send them on the "
            "meta device, and a sharded strategy would initialise the whole model anew: build "
            "them in __init__",
            RuntimeWarning,
            stacklevel=2,
        )


def _buffer_slots(
    model: torch.nn.Module, buffers: dict[str, Tensor]
) -> list[tuple[dict[str, Any], str, Tensor]]:
    """Driver side: where each of rank 0's buffers that the state dict leaves out
    (``persistent=False``) goes in the driver's model; those it has no such buffer for (made by
    a hook that ran on the workers only) are left out, as the state dict would leave them."""
    slots = {key: (table, name) for key, table, name in _compat.torch.non_persistent_buffers(model)}
    found = []
    for key, value in buffers.items():
        slot = slots.get(key) or slots.get(_compat.torch.uncompiled_name(key))
        if slot is not None:
            found.append((*slot, value))
    return found


def _tensors(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _assign(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Driver side: gives the model's meta tensors named in ``state`` new tensors, copies of
    ``state``'s; names of one tensor (tied weights: an embedding shared with the output layer)
    get one new tensor, the same object under each name, as they had one before."""
    held = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for key in state:
        aliases.setdefault(id(held[key]), []).append(key)
    firsts = [keys[0] for keys in aliases.values()]
    model.load_state_dict({key: state[key].clone() for key in firsts}, strict=False, assign=True)
    for first, *others in aliases.values():
        table, name = _slot(model, first)
        for key in others:
            alias_table, alias = _slot(model, key)
            alias_table[alias] = table[name]


def _take_dtypes(model: torch.nn.Module, held: dict[str, Any], state: dict[str, Tensor]) -> None:
    """Driver side: gives the model's floating-point tensors the dtype rank 0's hold, as rank 0's
    model is the driver's under ``ddp``: Lightning's plugin for a "true" precision (bf16-true,
    16-true, 64-true, Transformer Engine's) converts the model in place when a call sets up,
    and a hook may keep a layer in another dtype. Parameters stay the same objects. ``held``:
    the model's ``state_dict(keep_vars=True)``."""
    for key, value in state.items():
        tensor = held.get(key)
        if (
            not isinstance(tensor, Tensor)  # a module's extra state is any object
            or not isinstance(value, Tensor)
            or tensor.dtype == value.dtype
            or not (tensor.is_floating_point() and value.is_floating_point())
        ):
            continue  # tied weights: the second name finds the dtype taken already
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = tensor.data.to(value.dtype)  # as Module.to converts them
        else:
            table, name = _slot(model, key)
            table[name] = tensor.to(value.dtype)


def _slot(model: torch.nn.Module, key: str) -> tuple[dict[str, Any], str]:
    """Where the state dict's ``key`` lives: its module's parameters or buffers, and its name."""
    path, _, name = key.rpartition(".")
    owner = model.get_submodule(path) if path else model
    return (owner._parameters if name in owner._parameters else owner._buffers), name


def _few(keys: list[str]) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return ", ".join(keys[:5]) + more


def _restore_attributes(
    trainer: pl.Trainer,
    model: Any,
    datamodule: Any,
    attributes: Attributes,
    datasets: Sequence[Any] = (),
) -> set[int]:
    """Driver side: gives the driver's callbacks, loggers, model and datamodule rank 0's
    attributes, rank 0's profiler state, and after ``fit`` rank 0's optimizers and LR schedulers (see
    :class:`~ray_lightning_sgd._boundary.results.Attributes`); returns the ``id`` of each callback
    and logger restored this way. What the driver cannot rebuild (it references an object the
    driver lacks, or fails to unpickle here) is left out with a warning that names it."""
    shared = shared_objects(trainer, model, datamodule, datasets)
    left_out = list(attributes.left_out)

    def rebuilt(packed: Packed, what: str) -> tuple[bool, Any]:
        lacking = _Shared(shared)
        try:
            value = unpack(packed, shared=lacking)
        except Exception as err:  # noqa: BLE001  (what unpickles on a worker only)
            left_out.append(f"{what} ({type(err).__name__}: {err})")
            return False, None
        if lacking.missing:
            left_out.append(
                f"{what} (it refers to {_few(sorted(lacking.missing))}, not on the driver)"
            )
            return False, None
        return True, value

    restored: set[int] = set()
    states: dict[str, list[Packed]] = {}
    for key, state in attributes.callbacks:
        states.setdefault(key, []).append(state)
    for callback in callbacks_of(trainer):
        queue = states.get(callback.state_key)
        if queue:
            ok, state = rebuilt(queue.pop(0), f"callback {callback.state_key}")
            if ok and _set_state(callback, state):
                restored.add(id(callback))
    for index, (logger, packed) in enumerate(
        zip(trainer.loggers, attributes.loggers, strict=False)
    ):
        if packed is not None:
            ok, state = rebuilt(packed, f"logger {index} ({type(logger).__name__})")
            if ok and _set_state(logger, _compat.trackers.keep_own_handle(logger, state)):
                restored.add(id(logger))
    for owner, target, packed_attributes in (
        ("model", model, attributes.model),
        ("datamodule", datamodule, attributes.datamodule),
    ):
        if target is None or packed_attributes is None:
            continue
        for key, packed in packed_attributes.items():
            ok, value = rebuilt(packed, f"{owner}.{key}")
            if ok:
                vars(target)[key] = value
    if attributes.optimizers is not None:
        ok, value = rebuilt(attributes.optimizers, "the optimizers and LR schedulers")
        if ok:
            # after fit: rank 0's optimizers and schedulers, over the driver's parameters
            trainer.strategy.optimizers, trainer.strategy.lr_scheduler_configs = value
    if attributes.profiler is not None:
        ok, value = rebuilt(attributes.profiler, "the profiler")
        if ok:
            _compat.set_profiler_state(trainer.profiler, value)  # type: ignore[attr-defined]
    if left_out:
        optimizers = any(item.startswith("the optimizers") for item in left_out)
        warnings.warn(
            f"These stayed on the workers, and the driver keeps its own: {'; '.join(left_out)}. "
            "A callback among them still gets its state_dict()"
            + ("; trainer.optimizers stays empty on the driver" if optimizers else ""),
            RuntimeWarning,
            stacklevel=3,
        )
    return restored


class _Shared(dict[str, Any]):
    """The driver's shared objects; notes each name rank 0 referred to that the driver lacks
    (a layer or parameter that ``configure_model`` built on the workers only)."""

    def __init__(self, objects: dict[str, Any]) -> None:
        super().__init__(objects)
        self.missing: set[str] = set()

    def __missing__(self, key: str) -> None:
        self.missing.add(key.partition(":")[2] or key)


def adopt_logger_runs(trainer: pl.Trainer, versions: Sequence[Any]) -> None:
    """Driver side, after a call that failed: the driver's loggers name the runs rank 0's
    wrote to (as reported once it made them), so that Lightning's ``finalize("failed")`` that
    follows marks those runs failed and ``trainer.logger.version`` makes no new one."""
    for logger, version in zip(trainer.loggers, versions, strict=False):
        try:
            _compat.trackers.set_version(logger, version)
            _compat.trackers.attach(logger)
        except Exception as err:  # noqa: BLE001  (the call's own error is the one to raise)
            log.warning("The driver's %s cannot name rank 0's run: %r", type(logger).__name__, err)


def _set_state(obj: Any, state: Any) -> bool:
    """Gives ``obj`` the state ``__getstate__`` returned on rank 0; whether there was any."""
    setstate = getattr(obj, "__setstate__", None)
    if setstate is not None:
        setstate(state)
        return True
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__ or None, __slots__ values)
        attributes, slots = state
        for key, value in (slots or {}).items():
            setattr(obj, key, value)
        state = attributes
    if isinstance(state, dict):
        vars(obj).update(state)
        return True
    return False


def merge_predictions(ranks: Sequence[RankPredictions]) -> list[list[Any]]:
    """Merges every rank's predictions into the dataset's order, without padding duplicates.

    Each batch's output is split into samples, the samples are ordered by their index in the
    dataset (the first occurrence of an index wins: the sampler pads by repeating samples), and
    regrouped into batches of the dataloader's batch size. The result is what a single process
    returns. When outputs cannot be split by sample, or indices are unknown, the batches are
    returned rank after rank, with a warning; a Ray Data loader's (whose rows have no index in
    the dataset's order) rank after rank, without one.
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


def _pad(indices: list[list[int] | None], n: int) -> list[list[int] | None]:
    return indices + [[]] * (n - len(indices))


def _merge_one(batches: list[tuple[Any, list[int] | None]]) -> list[Any]:
    if batches and all(indices is None for _, indices in batches):
        # a Ray Data shard's rows come in no order of the dataset's: rank after rank, as read
        return [output for output, _ in batches]
    samples: dict[int, Any] = {}
    batch_size = 0
    for output, maybe in batches:
        indices = maybe or []
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


def _split(output: Any, n: int, top: bool = True) -> list[Any] | None:
    """Splits one batch's output into ``n`` per-sample pieces, or returns None if it cannot.
    ``top``: the batch's whole output, not a column of it."""
    if isinstance(output, Tensor):
        if output.dim() == 0 or output.shape[0] != n:
            return None
        return [output[i : i + 1] for i in range(n)]
    if isinstance(output, dict):
        parts = {key: _split(value, n, top=False) for key, value in output.items()}
        if any(p is None for p in parts.values()):
            return None
        return [{key: p[i] for key, p in parts.items()} for i in range(n)]  # type: ignore[index]
    if isinstance(output, (list, tuple)):
        columns = [_split(value, n, top=False) for value in output]
        if output and all(c is not None for c in columns):
            rows = [[c[i] for c in columns] for i in range(n)]  # type: ignore[index]
            return [_Row(type(output), row) for row in rows]
        record = top and isinstance(output, tuple)
        if len(output) == n and all(c is None for c in columns) and not record:
            # one entry per sample (a list, or a tuple in a column: a collate_fn's zip(*batch));
            # not a mix of batched and unbatched columns, nor a batch's whole output that is a
            # tuple of values that are no batches (a record, of the batch's size by chance)
            return [_Item(value, type(output)) for value in output]
    return None


class _Row(NamedTuple):
    """A sample's share of a list or tuple of batched outputs."""

    kind: type
    values: list[Any]


class _Item(NamedTuple):
    """A sample's entry of a per-sample list (or tuple) output."""

    value: Any
    kind: type = list


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
        return first.kind(p.value for p in pieces)
    if isinstance(first, dict):
        return {key: _join([p[key] for p in pieces]) for key in first}
    raise TypeError(f"cannot join prediction pieces of type {type(first).__name__}")
