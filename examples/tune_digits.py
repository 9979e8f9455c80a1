"""Tune the digits classifier's learning rate with Ray Tune; every trial trains with RaySGDStrategy.

Each trial is a Lightning run whose workers live inside the trial's own placement group: the
strategy tells Tune what one trial needs (``strategy.tune_resources()``), and
``TuneReportCallback`` reports rank 0's validation metrics, with a checkpoint, after every
validation. Run it with ``python examples/tune_digits.py`` (embedded local Ray); it prints each
trial's accuracy and the best learning rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import pytorch_lightning as pl
from ray import cloudpickle, tune

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits
from digits import DigitsClassifier, DigitsData, load_digits

from ray_lightning_sgd import RaySGDStrategy
from ray_lightning_sgd.tune import TuneReportCallback

# the trials and their workers cannot import examples/digits.py: it travels with what uses it
cloudpickle.register_pickle_by_value(digits)


def make_strategy(num_workers: int) -> RaySGDStrategy:
    return RaySGDStrategy(num_workers=num_workers, num_cpus_per_worker=1)


def train_digits(config: dict, digits: tuple) -> None:
    """One trial: the driver of a Lightning run, inside the trial's process (on any node: the
    data comes through Ray's object store, not from this machine's disk)."""
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=make_strategy(config["num_workers"]),
        max_epochs=config["max_epochs"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            TuneReportCallback({"acc": "val_acc", "loss": "val_loss"}, save_checkpoints=True)
        ],
    )
    trainer.fit(DigitsClassifier(lr=config["lr"]), datamodule=DigitsData(digits=digits))


def tune_digits(
    lrs: list[float], num_workers: int, max_epochs: int, storage: str
) -> tune.ResultGrid:
    tuner = tune.Tuner(
        tune.with_resources(
            tune.with_parameters(train_digits, digits=load_digits()),
            make_strategy(num_workers).tune_resources(),
        ),
        param_space={
            "lr": tune.grid_search(lrs),
            "num_workers": num_workers,
            "max_epochs": max_epochs,
        },
        tune_config=tune.TuneConfig(metric="acc", mode="max"),
        run_config=tune.RunConfig(name="tune_digits", storage_path=storage, verbose=0),
    )
    return tuner.fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tune_digits-") as storage:
        results = tune_digits(args.lrs, args.num_workers, args.max_epochs, storage)
        for result in results:
            print(
                f"lr={result.config['lr']:g}: val_acc {result.metrics['acc']:.4f} after "
                f"{result.metrics['training_iteration']} validations"
            )
        best = results.get_best_result()
        print(f"best lr: {best.config['lr']:g} (val_acc {best.metrics['acc']:.4f})")


if __name__ == "__main__":
    main()
