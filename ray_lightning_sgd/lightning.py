"""RaySGDStrategy for ``lightning.pytorch`` (``import lightning as L``).

.. code-block:: python

    import lightning as L
    from ray_lightning_sgd.lightning import RaySGDStrategy

    trainer = L.Trainer(strategy=RaySGDStrategy(num_workers=4))

``from ray_lightning_sgd import RaySGDStrategy`` is this class too where ``pytorch_lightning`` is
not installed. The classes here only join the implementation (each strategy's worker half and driver half;
see :mod:`ray_lightning_sgd._compat.flavour`) with this namespace's Lightning bases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ray_lightning_sgd._boundary.data_loader import RayDataModuleBase
from ray_lightning_sgd._boundary.environment import RayEnvironmentBase
from ray_lightning_sgd._boundary.precision import WorkerPrecisionBase
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._driver.launcher import RayLauncherBase
from ray_lightning_sgd._driver.variants import (
    RayFSDPStrategyBase,
    RayModelParallelStrategyBase,
    RaySGDStrategyBase,
)
from ray_lightning_sgd._worker.entry import run_on_worker
from ray_lightning_sgd._worker.strategy import FSDPOnWorkers, ModelParallelOnWorkers, SGDOnWorkers
from ray_lightning_sgd._worker.tune import TuneReportCallbackBase

FLAVOUR = Flavour.load("lightning.pytorch")

if TYPE_CHECKING:
    # type-checked through the mixins; the Lightning bases come from the flavour at run time
    _ClusterEnvironment = object
    _Launcher = object
    _DDPStrategy = object
    _ModelParallelStrategy = object
    _FSDPStrategy = object
    _Callback = object
    _Precision = object
    _DataModule = object
else:
    _ClusterEnvironment = FLAVOUR.cluster_environment
    _Launcher = FLAVOUR.launcher_interface
    _DDPStrategy = FLAVOUR.ddp_strategy
    _ModelParallelStrategy = FLAVOUR.model_parallel_strategy
    _FSDPStrategy = FLAVOUR.fsdp_strategy
    _Callback = FLAVOUR.callback
    _Precision = FLAVOUR.plugins.Precision
    _DataModule = FLAVOUR.datamodule


class RayEnvironment(RayEnvironmentBase, _ClusterEnvironment):
    __doc__ = RayEnvironmentBase.__doc__


class RayLauncher(RayLauncherBase, _Launcher):
    __doc__ = RayLauncherBase.__doc__
    worker_half = staticmethod(run_on_worker)


class WorkerPrecision(WorkerPrecisionBase, _Precision):
    __doc__ = WorkerPrecisionBase.__doc__


class _ThisNamespace:
    """What each strategy of this namespace uses: the namespace, and its launcher, environment
    and precision stand-in."""

    flavour: ClassVar[Flavour] = FLAVOUR
    environment_class: ClassVar[type[RayEnvironmentBase]] = RayEnvironment
    launcher_class: ClassVar[type[RayLauncherBase]] = RayLauncher
    precision_class: ClassVar[type[WorkerPrecisionBase]] = WorkerPrecision


class RaySGDStrategy(_ThisNamespace, SGDOnWorkers, RaySGDStrategyBase, _DDPStrategy):
    __doc__ = RaySGDStrategyBase.__doc__


class RayModelParallelStrategy(
    _ThisNamespace, ModelParallelOnWorkers, RayModelParallelStrategyBase, _ModelParallelStrategy
):
    __doc__ = RayModelParallelStrategyBase.__doc__


class RayFSDPStrategy(_ThisNamespace, FSDPOnWorkers, RayFSDPStrategyBase, _FSDPStrategy):
    __doc__ = RayFSDPStrategyBase.__doc__


class TuneReportCallback(TuneReportCallbackBase, _Callback):
    __doc__ = TuneReportCallbackBase.__doc__


class RayDataModule(RayDataModuleBase, _DataModule):
    __doc__ = RayDataModuleBase.__doc__


__all__ = [
    "FLAVOUR",
    "RayDataModule",
    "RayEnvironment",
    "RayFSDPStrategy",
    "RayLauncher",
    "RayModelParallelStrategy",
    "RaySGDStrategy",
    "TuneReportCallback",
    "WorkerPrecision",
]
