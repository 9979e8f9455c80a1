"""Train unchanged PyTorch Lightning code on a Ray cluster by changing one line.

.. code-block:: python

    trainer = Trainer(strategy=RaySGDStrategy(num_workers=4), max_epochs=10)
    trainer.fit(model, datamodule=dm)

``RaySGDStrategy`` is all a Lightning user needs. It comes in both Lightning namespaces:
``ray_lightning_sgd.pytorch_lightning.RaySGDStrategy`` for ``pytorch_lightning.Trainer`` and
``ray_lightning_sgd.lightning.RaySGDStrategy`` for ``lightning.pytorch.Trainer``;
``ray_lightning_sgd.RaySGDStrategy`` is the first where ``pytorch_lightning`` is installed, else the
second. Lightning is imported only when one of them is first used. Importing this package also
registers ``Trainer(strategy="ray_sgd")`` in both namespaces (:mod:`ray_lightning_sgd.registry`).

``WorkerGroup``, ``Backend``, ``BackendConfig``, ``TorchBackend`` and ``BackendExecutor`` are public
for people who build other backends.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._worker_group.imports import collector_paused as _collector_paused

# this package imports torch: a new worker process does so first, as it loads its actor class
with _collector_paused():
    from ray_lightning_sgd import registry as _registry
    from ray_lightning_sgd.backend import Backend, BackendConfig
    from ray_lightning_sgd.exceptions import (
        ClusterConnectionError,
        ConfigurationError,
        RaySGDError,
        ResourcesUnavailableError,
        SerializationError,
        WorkerDiedError,
        WorkerError,
        WorkerGroupError,
        WorkerTimeoutError,
    )
    from ray_lightning_sgd.executor import BackendExecutor
    from ray_lightning_sgd.ranks import WorkerMetadata, WorkerRank
    from ray_lightning_sgd.worker_group import (
        WorkerContext,
        WorkerGroup,
        WorkerGroupConfig,
        get_worker_context,
    )

if TYPE_CHECKING:
    from ray_lightning_sgd._executor.pool import shutdown as shutdown_workers
    from ray_lightning_sgd.pytorch_lightning import (
        RayEnvironment,
        RayFSDPStrategy,
        RayModelParallelStrategy,
        RaySGDStrategy,
    )
    from ray_lightning_sgd.torch_backend import TorchBackend, TorchConfig

#: The names that belong to a Lightning namespace, resolved on first use.
_FLAVOURED = ("RayEnvironment", "RayFSDPStrategy", "RayModelParallelStrategy", "RaySGDStrategy")
#: Names resolved on first use (the package imports torch anyway, through its serialization):
#: the backend's and the pool's modules, which the processes that only need the package's configs
#: and exceptions do not load.
_LAZY = {
    "TorchBackend": ("ray_lightning_sgd.torch_backend", "TorchBackend"),
    "TorchConfig": ("ray_lightning_sgd.torch_backend", "TorchConfig"),
    "shutdown_workers": ("ray_lightning_sgd._executor.pool", "shutdown"),
}


def __getattr__(name: str) -> Any:
    if name in _FLAVOURED:
        return getattr(_default_flavour(), name)
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _default_flavour() -> ModuleType:
    try:
        return importlib.import_module("ray_lightning_sgd.pytorch_lightning")
    except ModuleNotFoundError as err:
        if err.name not in ("pytorch_lightning", "lightning_fabric"):
            raise
    try:
        return importlib.import_module("ray_lightning_sgd.lightning")
    except ModuleNotFoundError as err:
        if err.name != "lightning":
            raise
        raise ImportError(
            "RaySGDStrategy needs Lightning, and neither pytorch_lightning nor lightning is "
            "installed; pip install 'ray_lightning_sgd[pytorch-lightning]' or "
            "'ray_lightning_sgd[lightning]'"
        ) from err


_registry.install()

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendExecutor",
    "ClusterConnectionError",
    "ConfigurationError",
    "RayEnvironment",
    "RayFSDPStrategy",
    "RayModelParallelStrategy",
    "RaySGDError",
    "RaySGDStrategy",
    "ResourcesUnavailableError",
    "SerializationError",
    "TorchBackend",
    "TorchConfig",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerGroupConfig",
    "WorkerGroupError",
    "WorkerMetadata",
    "WorkerRank",
    "WorkerTimeoutError",
    "get_worker_context",
    "shutdown_workers",
]
