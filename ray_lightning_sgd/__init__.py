"""Train unchanged PyTorch Lightning code on a Ray cluster by changing one line.

.. code-block:: python

    trainer = Trainer(strategy=RaySGDStrategy(num_workers=4), max_epochs=10)
    trainer.fit(model, datamodule=dm)

``RaySGDStrategy`` is all a Lightning user needs. ``WorkerGroup``, ``Backend``, ``BackendConfig``,
``TorchBackend`` and ``BackendExecutor`` are public for people who build other backends.
"""

from ray_lightning_sgd.backend import Backend, BackendConfig
from ray_lightning_sgd.environment import RayEnvironment
from ray_lightning_sgd.exceptions import (
    ConfigurationError,
    RaySGDError,
    ResourcesUnavailableError,
    SerializationError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerTimeoutError,
)
from ray_lightning_sgd.executor import BackendExecutor
from ray_lightning_sgd.pool import shutdown as shutdown_workers
from ray_lightning_sgd.ranks import WorkerMetadata, WorkerRank
from ray_lightning_sgd.strategy import RaySGDStrategy
from ray_lightning_sgd.torch_backend import TorchBackend, TorchConfig
from ray_lightning_sgd.worker_group import (
    WorkerContext,
    WorkerGroup,
    WorkerGroupConfig,
    get_worker_context,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendExecutor",
    "ConfigurationError",
    "RayEnvironment",
    "RaySGDError",
    "RaySGDStrategy",
    "ResourcesUnavailableError",
    "SerializationError",
    "TorchBackend",
    "TorchConfig",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerGroupConfig",
    "WorkerGroupError",
    "WorkerMetadata",
    "WorkerRank",
    "WorkerTimeoutError",
    "get_worker_context",
    "shutdown_workers",
]
