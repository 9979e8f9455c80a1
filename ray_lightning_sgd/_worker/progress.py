"""Runs on each worker: a callback that notes where this rank is, for the driver's progress timeout.

The note goes to the worker's outbox (a dict write); the driver reads its age at each poll and
raises ``WorkerTimeoutError`` when a rank has gone quiet for longer than ``progress_timeout_s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._boundary.channels import PROGRESS
from ray_lightning_sgd._worker_group.outbox import get_outbox

if TYPE_CHECKING:
    import pytorch_lightning as pl


class ProgressReporterBase:
    """Runs on each worker. A callback that notes, at each batch and stage, where this rank is."""

    def _report(self, stage: str, step: int) -> None:
        get_outbox().put_latest(PROGRESS, (stage, step))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._report(f"setup ({stage})", 0)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._report("training", trainer.global_step)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._report("validation", batch_idx)

    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._report("test", batch_idx)

    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._report("predict", batch_idx)
