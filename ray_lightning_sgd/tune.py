"""Ray Tune: a Lightning run with RaySGDStrategy as one Tune trial.

.. code-block:: python

    from ray import tune
    from ray_lightning_sgd import RaySGDStrategy
    from ray_lightning_sgd.tune import TuneReportCallback

    def train(config):
        trainer = pl.Trainer(
            strategy=RaySGDStrategy(num_workers=2),
            callbacks=[TuneReportCallback({"acc": "val_acc"}, save_checkpoints=True)],
        )
        trainer.fit(Model(lr=config["lr"]), datamodule=dm)

    resources = RaySGDStrategy(num_workers=2).tune_resources()
    tune.Tuner(tune.with_resources(train, resources), param_space={...}).fit()

The trial's process is the run's driver. ``tune_resources()`` asks Tune for a placement group with
one bundle per worker (the driver itself needs none), and the strategy starts its workers in the
bundles of the trial's placement group instead of asking for a second one.
:class:`TuneReportCallback` runs on the workers: at each validation end (or train epoch end) rank
0 sends the chosen metrics, and if asked a checkpoint, to the driver, which reports them to Tune.

``TuneReportCallback`` here is the one of ``pytorch_lightning`` where it is installed, else of
``lightning``; each namespace module has its own (``ray_lightning_sgd.lightning.TuneReportCallback``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._boundary.tune import report_to_tune
from ray_lightning_sgd._worker.tune import REPORT_ON, TuneReportCallbackBase

if TYPE_CHECKING:
    from ray_lightning_sgd.pytorch_lightning import TuneReportCallback


def __getattr__(name: str) -> Any:
    if name == "TuneReportCallback":
        from ray_lightning_sgd import _default_flavour

        return _default_flavour().TuneReportCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["REPORT_ON", "TuneReportCallback", "TuneReportCallbackBase", "report_to_tune"]
