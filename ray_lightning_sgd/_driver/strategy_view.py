"""Driver side: what a launch reads from its strategy, as an interface.

The launcher and the checks depend on this protocol, not on the strategy class, so that the strategy
(which makes the launcher) sits above them in the import graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ray_lightning_sgd._backend.torch import TorchConfig
from ray_lightning_sgd._boundary.precision import PrecisionRequest
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._driver.run_config import RunConfig
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata


class StrategyView(Protocol):
    """The strategy's settings that a launch uses."""

    @property
    def flavour(self) -> Flavour:
        """The strategy's Lightning namespace."""

    @property
    def worker_group_config(self) -> WorkerGroupConfig:
        """How many workers to start and what each one reserves."""

    @property
    def backend_config(self) -> TorchConfig:
        """How the workers form their process group."""

    @property
    def run_config(self) -> RunConfig:
        """Restarts, progress timeout and resume checkpoints."""

    @property
    def reuse_workers(self) -> bool:
        """Whether workers stay up between calls."""

    @property
    def debug(self) -> bool:
        """Whether the workers log in detail and the driver keeps each rank's output in a file."""

    @property
    def keep_global_batch_size(self) -> bool:
        """Whether an elastic run scales ``accumulate_grad_batches`` to keep the global batch."""

    @property
    def driver_callbacks(self) -> list[Any]:
        """Callbacks that run on the driver."""

    @property
    def precision_request(self) -> PrecisionRequest:
        """The precision the user asked the Trainer for."""

    @property
    def sharded(self) -> bool:
        """Whether the model's parameters are sharded across the workers."""

    def tensor_parallel_size(self, metadata: Sequence[WorkerMetadata] = ()) -> int | None:
        """The tensor-parallel size the workers take where ``metadata`` placed them (None: not
        known before they are placed)."""

    def check_placed(self, metadata: Sequence[WorkerMetadata]) -> None:
        """Raises for settings that cannot train where the attempt's workers landed."""
