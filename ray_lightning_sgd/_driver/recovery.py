"""Driver side: rank 0's results copied into the driver's Trainer and model; every rank's predictions merged."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.backends.cudnn
from torch import Tensor

from ray_lightning_sgd import _compat
from ray_lightning_sgd._serialization import unpack
from ray_lightning_sgd._worker import artifacts
from ray_lightning_sgd._worker.entry import (
    PREDICTING,
    RankPredictions,
    WorkerOutput,
    callbacks_of,
    loop_of,
)
from ray_lightning_sgd.exceptions import WorkerGroupError

if TYPE_CHECKING:
    import pytorch_lightning as pl


def recover_results_in_driver(trainer: pl.Trainer, outputs: Sequence[WorkerOutput]) -> Any:
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
    loop = loop_of(trainer)
    loop.load_state_dict(rank_zero.loop_state)
    _compat.mark_loop_finished(loop)
    for callback in callbacks_of(trainer):
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
    if trainer.state.fn == PREDICTING:
        ranks = [out.predictions for out in outputs]
        if any(p is None for p in ranks):
            return None
        merged = merge_predictions([p for p in ranks if p is not None])
        return merged[0] if len(merged) == 1 else merged
    return outputs[0].results


def merge_predictions(ranks: Sequence[RankPredictions]) -> list[list[Any]]:
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
