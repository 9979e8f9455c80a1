"""The cluster environment: the ranks and device that the worker group assigned.

On the driver it only knows the world size; on each worker it reads the worker's context, which
the worker group set when it started the worker (one home for a worker's rank and device:
:func:`~ray_lightning_sgd._worker_group.context.get_worker_context`), and Lightning reads them
from here.

:class:`RayEnvironmentBase` is the implementation, for either Lightning namespace; the
``RayEnvironment`` of :mod:`ray_lightning_sgd.pytorch_lightning` and of
:mod:`ray_lightning_sgd.lightning` join it with that namespace's ``ClusterEnvironment``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from ray_lightning_sgd._worker_group.context import current_context
from ray_lightning_sgd._worker_group.ranks import WorkerRank

if TYPE_CHECKING:
    from lightning_fabric.plugins.environments import ClusterEnvironment as _Base
else:
    _Base = object


#: Set on every worker by the strategy's ``debug``: the worker turns its detailed logs on.
DEBUG_ENV = "RAY_LIGHTNING_SGD_DEBUG"


class RayEnvironmentBase(_Base):
    """Ranks that the worker group assigned; the driver is rank 0 of ``world_size`` until then."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self._world_size = world_size

    @property
    def _rank(self) -> WorkerRank | None:
        context = current_context()
        return None if context is None else context.rank

    @property
    def device(self) -> torch.device:
        """The device this worker trains on (the CPU on the driver)."""
        context = current_context()
        if context is None or context.device_index is None:
            return torch.device("cpu")
        return torch.device("cuda", context.device_index)

    @property
    def num_nodes(self) -> int:
        """How many nodes host the workers (1 on the driver)."""
        return 1 if self._rank is None else self._rank.num_nodes

    @property
    def local_world_size(self) -> int:
        """How many workers share this worker's node."""
        return 1 if self._rank is None else self._rank.local_world_size

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """Ray starts the processes; Lightning must not start any itself."""
        return True

    @property
    @override
    def main_address(self) -> str:
        """The rendezvous address that the torch backend set on every worker."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        """The rendezvous port that the torch backend set on every worker."""
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    @override
    def detect() -> bool:
        """Never chosen automatically: RaySGDStrategy brings it."""
        return False

    @override
    def world_size(self) -> int:
        """The number of workers."""
        return self._world_size if self._rank is None else self._rank.world_size

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: the worker group decides the world size."""

    def ran_with(self, world_size: int) -> None:
        """Driver side: the workers of the last call were ``world_size`` (an elastic run's size
        may differ from the most); the driver's Trainer reports it, as ddp's rank 0 would."""
        self._world_size = world_size

    @override
    def global_rank(self) -> int:
        """This worker's global rank (0 on the driver)."""
        return 0 if self._rank is None else self._rank.global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored: the worker group decides the ranks."""

    @override
    def local_rank(self) -> int:
        """This worker's rank among the workers of its node."""
        return 0 if self._rank is None else self._rank.local_rank

    @override
    def node_rank(self) -> int:
        """The rank of this worker's node."""
        return 0 if self._rank is None else self._rank.node_rank
