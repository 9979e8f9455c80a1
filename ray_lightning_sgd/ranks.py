"""Rank assignment: pure functions over the metadata the workers report.

Public names; the implementation lives in :mod:`ray_lightning_sgd._worker_group.ranks`.
"""

from __future__ import annotations

from ray_lightning_sgd._worker_group.ranks import (
    WorkerMetadata,
    WorkerRank,
    assign_ranks,
    device_index,
    rank_order,
    visible_devices,
)

__all__ = [
    "WorkerMetadata",
    "WorkerRank",
    "assign_ranks",
    "device_index",
    "rank_order",
    "visible_devices",
]
