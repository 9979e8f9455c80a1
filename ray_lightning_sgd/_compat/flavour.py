"""Lightning flavours: the two namespaces one implementation serves.

Lightning ships the same classes twice: in the standalone ``pytorch_lightning`` package (with
``lightning_fabric``) and inside the ``lightning`` package as ``lightning.pytorch`` (with
``lightning.fabric``). The two are distinct classes, and a Trainer of one refuses a strategy of the
other. The strategy, its launcher and its cluster environment are therefore written once, as mixins
(:class:`~ray_lightning_sgd._driver.variants.RaySGDStrategyBase`, ...) that take every Lightning class they
need from a :class:`Flavour`; :mod:`ray_lightning_sgd.pytorch_lightning` and
:mod:`ray_lightning_sgd.lightning` each join the mixins with one namespace's bases in a few lines.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from packaging.version import Version

from ray_lightning_sgd._compat.lightning import launcher_interface
from ray_lightning_sgd.exceptions import ConfigurationError

#: The Lightning releases this package is tested with (see the README's "Tested versions").
MIN_LIGHTNING = Version("2.5")

#: Each namespace's module, the distribution that installs it, and its fabric.
NAMESPACES = {
    "pytorch_lightning": ("pytorch-lightning", "lightning_fabric"),
    "lightning.pytorch": ("lightning", "lightning.fabric"),
}


@dataclass(frozen=True)
class Flavour:
    """The members of one Lightning namespace that the implementation uses."""

    #: ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
    namespace: str
    ddp_strategy: type
    model_parallel_strategy: type
    fsdp_strategy: type
    cpu_accelerator: type
    cuda_accelerator: type
    callback: type
    datamodule: type
    progress_bar: type
    cluster_environment: type
    launcher_interface: type
    rank_zero_only: Any
    #: The namespace's ``plugins`` module (its precision plugins).
    plugins: Any
    #: What Lightning raises on a process that got SIGTERM (a ``SystemExit``).
    sigterm_exception: type[BaseException]

    @classmethod
    def load(cls, namespace: str) -> Flavour:
        """Imports ``namespace`` and collects its members; refuses releases older than tested."""
        distribution, fabric_name = NAMESPACES[namespace]
        check_version(distribution)
        pl = importlib.import_module(namespace)
        fabric = importlib.import_module(fabric_name)
        importlib.import_module(f"{fabric_name}.plugins.environments")
        importlib.import_module(f"{namespace}.utilities.rank_zero")
        exceptions = importlib.import_module(f"{namespace}.utilities.exceptions")
        return cls(
            namespace=namespace,
            ddp_strategy=pl.strategies.DDPStrategy,
            model_parallel_strategy=pl.strategies.ModelParallelStrategy,
            fsdp_strategy=pl.strategies.FSDPStrategy,
            cpu_accelerator=pl.accelerators.CPUAccelerator,
            cuda_accelerator=pl.accelerators.CUDAAccelerator,
            callback=pl.callbacks.Callback,
            datamodule=pl.LightningDataModule,
            progress_bar=pl.callbacks.ProgressBar,
            cluster_environment=fabric.plugins.environments.ClusterEnvironment,
            launcher_interface=launcher_interface(namespace),
            rank_zero_only=pl.utilities.rank_zero.rank_zero_only,
            plugins=importlib.import_module(f"{namespace}.plugins"),
            sigterm_exception=exceptions.SIGTERMException,
        )


def check_version(distribution: str) -> None:
    """Raises if the installed ``distribution`` is older than the oldest release tested."""
    version = Version(metadata.version(distribution))
    if version < MIN_LIGHTNING:
        raise ConfigurationError(
            f"ray_lightning_sgd needs {distribution} >= {MIN_LIGHTNING}, found {version}; "
            f"upgrade it: pip install '{distribution}>={MIN_LIGHTNING}'"
        )
