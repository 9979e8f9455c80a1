"""``Trainer(strategy="ray_sgd")``: the strategy's name in Lightning's strategy registries.

Importing :mod:`ray_lightning_sgd` registers the name in each Lightning namespace: at once in one
that is already imported, else as soon as its ``strategies`` module is, so that importing this
package still imports no Lightning. The registered entry builds the namespace's
:class:`RaySGDStrategy` with its defaults (one worker); pass an instance for other settings.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: The name that ``Trainer(strategy=...)`` and ``--trainer.strategy=`` accept.
STRATEGY_NAME = "ray_sgd"
#: Every registered name, the class it builds in each namespace, and what Lightning lists.
STRATEGIES = {
    STRATEGY_NAME: ("RaySGDStrategy", "DDP across a gang of Ray actors"),
    "ray_model_parallel": (
        "RayModelParallelStrategy",
        "ModelParallelStrategy (FSDP2, tensor parallelism) across a gang of Ray actors",
    ),
    "ray_fsdp": ("RayFSDPStrategy", "FSDPStrategy across a gang of Ray actors with GPUs"),
}

#: Each namespace's strategies module, and our module for that namespace.
_NAMESPACES = {
    "pytorch_lightning.strategies": "ray_lightning_sgd.pytorch_lightning",
    "lightning.pytorch.strategies": "ray_lightning_sgd.lightning",
}

_lock = threading.Lock()


def _factory(module: str, cls: str) -> Callable[..., Any]:
    def build(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), cls)(**kwargs)

    return build


def register(strategies: ModuleType) -> None:
    """Adds this package's names to the ``StrategyRegistry`` of one namespace's strategies
    module."""
    registry = getattr(strategies, "StrategyRegistry", None)
    if registry is None:
        return
    for name, (cls, description) in STRATEGIES.items():
        if name not in registry:
            registry.register(
                name,
                _factory(_NAMESPACES[strategies.__name__], cls),
                description=f"{description} (ray_lightning_sgd.{cls})",
            )


class _Registering(importlib.abc.Loader):
    """Runs a strategies module's own loader, then registers the name in it."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        register(module)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds Lightning's strategies modules as the path finder would, with a registering loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _NAMESPACES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Registering(spec.loader)
        return spec


def install() -> None:
    """Registers the name in every Lightning namespace, now or when it is imported."""
    with _lock:
        if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
        for name in _NAMESPACES:
            if name in sys.modules:
                register(sys.modules[name])
