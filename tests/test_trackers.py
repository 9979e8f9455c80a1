"""Experiment trackers through failures and restarts: one run a fit, its status as Lightning's
``ddp`` leaves it, restarts that continue it with each step once, the driver's loggers naming it.

MLflow logs over HTTP to a tracking server on 127.0.0.1 started for this module; W&B runs offline
and is read back from its run folders (:mod:`tests.trackers`). What a fit that succeeds leaves is
compared with ``ddp`` in the parity suite (``tests/parity``, case ``experiment_trackers``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import MLFlowLogger, WandbLogger

from ray_lightning_sgd import RaySGDStrategy
from ray_lightning_sgd.exceptions import WorkerDiedError
from tests.helpers import TinyModel, loader
from tests.trackers import mlflow_runs, mlflow_server, wandb_runs

#: Steps an epoch: 64 samples, batches of 8, 2 workers.
STEPS = 4


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")


class _Stops(TinyModel):
    """Exits (``os._exit``) or raises on one rank at one global step (-1: in ``setup``); exits
    once if a marker file is given."""

    def __init__(self, rank: int, step: int, how: str, marker: str | None = None) -> None:
        super().__init__()
        self.rank, self.step, self.how, self.marker = rank, step, how, marker

    def setup(self, stage: str) -> None:
        if self.global_rank == self.rank and self.step == -1:
            os._exit(3)

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.rank and self.global_step == self.step:
            if self.how == "raise":
                raise ValueError(f"injected at step {self.step}")
            if self.marker is None or not os.path.exists(self.marker):
                if self.marker is not None:
                    open(self.marker, "w").close()
                os._exit(3)
        return super().training_step(batch, batch_idx)


def _fit(model, uri: str, experiment: str, folder: Path, epochs: int, **strategy):
    pl.seed_everything(0)
    loggers = [
        MLFlowLogger(experiment, tracking_uri=uri),
        WandbLogger(project=experiment, save_dir=str(folder), offline=True),
    ]
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2, **strategy),
        max_epochs=epochs,
        logger=loggers,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(folder),
    )
    return trainer, lambda: trainer.fit(model, loader(64), loader(32))


def _steps(history: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in history]


def test_a_fit_whose_rank_0_dies_leaves_one_failed_run_that_the_driver_names(
    ray_cluster, mlflow_uri, tmp_path
):
    """Rank 0 is lost in the model's ``setup``, just after Lightning made its runs (no
    restarts): its MLflow run is marked FAILED by the driver's ``finalize("failed")``, as
    ``ddp``'s handler marks it; the driver's loggers name the runs rank 0 made, and using them
    afterwards makes no new run. (Rank 0 waits at setup until the driver holds its runs' names:
    without that, a rank 0 lost before the driver's next poll left them unnamed, RUNNING.)"""
    trainer, fit = _fit(_Stops(0, -1, "exit"), mlflow_uri, "rank-0-dies", tmp_path, 1)
    with pytest.raises(WorkerDiedError):
        fit()
    (run,) = mlflow_runs(mlflow_uri, "rank-0-dies")
    assert run["status"] == "FAILED"
    mlflow, wandb = trainer.loggers
    assert mlflow.version == run["id"]
    mlflow.log_hyperparams({"after": 1})  # the driver logs into that run
    (run,) = mlflow_runs(mlflow_uri, "rank-0-dies")
    assert run["params"]["after"] == "1"
    (segment,) = wandb_runs(tmp_path)
    assert wandb.version == segment["id"]
    # a process killed with its W&B run open leaves it unfinished (crashed), under ddp too
    assert segment["exit"] is None


def test_a_fit_that_raises_on_rank_0_marks_its_runs_failed_there(ray_cluster, mlflow_uri, tmp_path):
    """Rank 0 raises: as in each ``ddp`` process, its loggers' ``finalize("failed")`` runs
    there, and its W&B run ends with exit code 1, as ddp's process that raised exits."""
    trainer, fit = _fit(_Stops(0, 2, "raise"), mlflow_uri, "rank-0-raises", tmp_path, 1)
    with pytest.raises(ValueError, match="injected at step 2"):
        fit()
    (run,) = mlflow_runs(mlflow_uri, "rank-0-raises")
    assert run["status"] == "FAILED"
    (segment,) = wandb_runs(tmp_path)
    assert segment["exit"] == 1
    assert trainer.loggers[1].version == segment["id"]


def test_a_restarted_fit_logs_each_step_once_into_the_same_runs(
    ray_cluster, mlflow_uri, tmp_path, monkeypatch
):
    """Rank 1 is lost in epoch 1 (step 6) and the fit restarts from the end of epoch 0: rank 0
    of the second attempt continues the same MLflow and W&B runs and leaves out the steps the
    first attempt logged (4 and 5, trained again). The driver's tracker settings reach the
    workers: Ray started them before the test set ``WANDB_NOTES``, which W&B reads there."""
    monkeypatch.setenv("WANDB_NOTES", "set on the driver")
    marker = str(tmp_path / "died")
    model = _Stops(1, STEPS + 2, "exit", marker)
    trainer, fit = _fit(model, mlflow_uri, "restarted", tmp_path, 3, max_failures=1)
    fit()
    assert os.path.exists(marker), "rank 1 was not lost"
    (run,) = mlflow_runs(mlflow_uri, "restarted")
    assert run["status"] == "FINISHED"
    assert _steps(run["metrics"]["train_loss"]) == list(range(3 * STEPS))
    assert _steps(run["metrics"]["val_loss"]) == [STEPS - 1, 2 * STEPS - 1, 3 * STEPS - 1]
    assert trainer.loggers[0].version == run["id"]
    segments = wandb_runs(tmp_path)
    assert len(segments) == 2, "one a attempt"
    assert {s["id"] for s in segments} == {trainer.loggers[1].version}
    steps = [
        row["trainer/global_step"] for s in segments for row in s["rows"] if "train_loss" in row
    ]
    assert steps == [float(step) for step in range(3 * STEPS)]
    assert segments[0]["notes"] == "set on the driver"
    assert segments[-1]["exit"] == 0
