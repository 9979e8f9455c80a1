"""Runs on each worker: a callback that notes where this rank is and how long its steps take.

The notes go to the worker's outbox (dict writes); the driver reads their age at each poll, for
``progress_timeout_s`` and the hang report, and each rank's step times, to name a rank slower
than the others (a straggler) and whether its time goes to data loading or to the step.

A step's own work is timed from the batch's start to its backward: in DDP the backward waits for
every rank's gradients (an all-reduce), so a fast rank's whole step is as long as the slowest's;
the forward and ``training_step`` before it are the rank's own.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._boundary.channels import PROGRESS, TIMED_STEPS, TIMINGS
from ray_lightning_sgd._worker_group.outbox import get_outbox

if TYPE_CHECKING:
    import pytorch_lightning as pl


class ProgressReporterBase:
    """Runs on each worker. A callback that notes, at each batch and stage, where this rank is,
    and the times of its latest training steps."""

    def __init__(self) -> None:
        super().__init__()
        self._steps = 0
        self._data: deque[float] = deque(maxlen=TIMED_STEPS)
        self._work: deque[float] = deque(maxlen=TIMED_STEPS)
        self._ended: float | None = None  # when the previous batch ended
        self._started: float | None = None  # when this batch started (None: not timed)
        self._backward: float | None = None  # when its backward started
        # when this rank last reported, and its longest wait between two reports so far
        self._reported_at: float | None = None
        self._longest_wait = 0.0

    def _report(self, stage: str, step: int) -> None:
        # the wait measured here, not where the driver sees it: the driver asks each rank but
        # rank 0 seldom in a large group (every N/10 s), which its view of the wait would add
        now = time.perf_counter()
        if self._reported_at is not None:
            self._longest_wait = max(self._longest_wait, now - self._reported_at)
        self._reported_at = now
        get_outbox().put_latest(PROGRESS, (stage, step, self._longest_wait))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._report(f"setup ({getattr(stage, 'value', stage)})", 0)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._ended = None  # the first batch's wait includes the epoch's start

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        self._started = None if self._ended is None else now
        if self._ended is not None:
            self._data.append(now - self._ended)
        self._backward = None

    def on_before_backward(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self._backward is None:
            self._backward = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        if self._started is not None:
            self._work.append((self._backward or now) - self._started)
            self._steps += 1
            get_outbox().put_latest(
                TIMINGS,
                (self._steps, statistics.median(self._data), statistics.median(self._work)),
            )
        self._ended = now
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
