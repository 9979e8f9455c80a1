"""Runs on each worker: a callback that notes where this rank is, for the driver's progress timeout."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._worker_group.context import get_worker_context

if TYPE_CHECKING:
    import pytorch_lightning as pl


#: How often a worker reports its progress, at most (seconds).
REPORT_INTERVAL_S = 1.0


class ProgressReporterBase:
    """Runs on each worker. A callback that tells the monitor where this rank is, once a second."""

    def __init__(self, monitor: Any) -> None:
        super().__init__()
        self._monitor = monitor
        self._rank = get_worker_context().rank.global_rank
        self._last = 0.0

    def _report(self, stage: str, step: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= REPORT_INTERVAL_S:
            self._last = now
            self._monitor.report.remote(self._rank, stage, step)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._report(f"setup ({stage})", 0, force=True)

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
