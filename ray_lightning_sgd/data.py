"""Ray Data for Lightning: datasets stream from the cluster to the workers, never through the driver.

.. code-block:: python

    import ray.data
    from ray_lightning_sgd.data import RayDataLoader

    train = ray.data.read_parquet("/data/train").map_batches(preprocess)
    val = ray.data.read_parquet("/data/val")
    trainer = pl.Trainer(strategy=RaySGDStrategy(num_workers=4, num_cpus_per_worker=1))
    trainer.fit(model, RayDataLoader(train, batch_size=64), RayDataLoader(val, batch_size=256))

Or a DataModule: ``RayDataModule(train=train, val=val, batch_size=64)`` (each namespace module
has its own: ``ray_lightning_sgd.lightning.RayDataModule``; the one here is that of
``pytorch_lightning`` where it is installed). Needs Ray Data: ``pip install
"ray_lightning_sgd[data]"``. See the README's "Ray Data" section.

Ray Data starts a local Ray instance of its own (Ray's defaults) when a dataset is made before
any is connected; :func:`connect` first gives the one the strategy would start or join (see the
README's "Where Ray comes from").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._boundary.data_loader import DATA_EXTRA, RayDataLoader, RayDataModuleBase
from ray_lightning_sgd._worker_group.cluster import connect

if TYPE_CHECKING:
    from ray_lightning_sgd.pytorch_lightning import RayDataModule


def __getattr__(name: str) -> Any:
    if name == "RayDataModule":
        from ray_lightning_sgd import _default_flavour

        return _default_flavour().RayDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DATA_EXTRA", "RayDataLoader", "RayDataModule", "RayDataModuleBase", "connect"]
