"""The worker group: a gang of Ray actors, reserved together in one placement group.

Public names for people who build other backends; the implementation lives in
:mod:`ray_lightning_sgd._worker_group`.
"""

from __future__ import annotations

from ray_lightning_sgd._worker_group.config import (
    NAME_PREFIX,
    PLACEMENT_STRATEGIES,
    WorkerGroupConfig,
)
from ray_lightning_sgd._worker_group.context import WorkerContext, get_worker_context
from ray_lightning_sgd._worker_group.group import WorkerGroup
from ray_lightning_sgd._worker_group.placement import bundles_for_workers

__all__ = [
    "NAME_PREFIX",
    "PLACEMENT_STRATEGIES",
    "WorkerContext",
    "WorkerGroup",
    "WorkerGroupConfig",
    "bundles_for_workers",
    "get_worker_context",
]
