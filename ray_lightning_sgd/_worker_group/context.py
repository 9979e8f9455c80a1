"""Runs on each worker: what a worker knows about itself once its group has started."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ray_lightning_sgd._worker_group.ranks import WorkerMetadata, WorkerRank
from ray_lightning_sgd.exceptions import WorkerGroupError


@dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about itself once the group has started."""

    metadata: WorkerMetadata
    rank: WorkerRank
    #: The CUDA device index this worker uses, or None without a GPU.
    device_index: int | None


_context: WorkerContext | None = None


def get_worker_context() -> WorkerContext:
    """Runs on each worker. Returns this worker's rank and device, as the group assigned them."""
    if _context is None:
        raise WorkerGroupError(
            "get_worker_context() was called outside a started worker group; "
            "call it only in functions that a WorkerGroup executes"
        )
    return _context


def set_context(context: WorkerContext, node_devices: tuple[str, ...]) -> None:
    """Runs on each worker. Stores the worker's context and shares its node's GPUs with it."""
    global _context
    _context = context
    if node_devices:
        # every worker on a node sees all GPUs of the node's workers; it picks its own by index
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(node_devices)


def current_context() -> WorkerContext | None:
    """Runs on each worker. This worker's context, or None before its group assigned one."""
    return _context
