"""Runs on each worker: the Tune report callback (see :mod:`ray_lightning_sgd.tune` for its use).

Rank 0 sends each report (and the checkpoint's bytes) to the driver, the trial's process, where
:func:`~ray_lightning_sgd._boundary.tune.report_to_tune` hands it to Tune.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._boundary.tune import report_to_tune
from ray_lightning_sgd._worker.events import send_to_driver
from ray_lightning_sgd._worker.resume import checkpoint_bytes
from ray_lightning_sgd._worker_group.config import flag
from ray_lightning_sgd.exceptions import ConfigurationError

if TYPE_CHECKING:
    import pytorch_lightning as pl


#: The hooks at which TuneReportCallback can report.
REPORT_ON = ("validation_end", "train_epoch_end")


def _metric_names(metrics: Any) -> dict[str, str] | None:
    """``metrics`` as Tune's name to Lightning's (None: all); raises unless names are strings."""
    if metrics is None:
        return None
    names: Any = metrics
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Mapping) and isinstance(names, Iterable):
        listed = list(names)
        names = {name: name for name in listed} if all(isinstance(n, str) for n in listed) else None
    if not isinstance(names, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) and key and value
        for key, value in names.items()
    ):
        raise ConfigurationError(
            f"TuneReportCallback(metrics={metrics!r}): a metric's name, a list of names, a dict "
            "of Tune's name to the name the model logs, or None for all of them"
        )
    return dict(names)


class TuneReportCallbackBase:
    """Runs on the workers. Reports rank 0's metrics (and optionally a checkpoint) to Tune.

    Args:
        metrics: Which of ``trainer.callback_metrics`` to report: a name, a list of names, a
            mapping of Tune's name to Lightning's, or None for all of them.
        on: When: ``"validation_end"`` (after every validation, not the sanity check) or
            ``"train_epoch_end"``, or a list of both.
        save_checkpoints: Also report a Lightning checkpoint of the run at that point (every rank
            takes part in writing it, as in ``Trainer.save_checkpoint``).
        filename: The checkpoint's file name inside Tune's checkpoint directory.
    """

    def __init__(
        self,
        metrics: str | Sequence[str] | Mapping[str, str] | None = None,
        on: str | Sequence[str] = "validation_end",
        save_checkpoints: bool = False,
        filename: str = "checkpoint.ckpt",
    ) -> None:
        super().__init__()
        self._metrics = _metric_names(metrics)
        hooks = [on] if isinstance(on, str) else list(on) if isinstance(on, Iterable) else []
        unknown = [hook for hook in hooks if hook not in REPORT_ON]
        if unknown or not hooks:
            raise ConfigurationError(
                f"TuneReportCallback(on={on!r}): report on one or both of {', '.join(REPORT_ON)}"
            )
        self._on = frozenset(hooks)
        self._save_checkpoints = flag("save_checkpoints", save_checkpoints)
        plain = isinstance(filename, str) and os.path.basename(filename) == filename
        if not plain or filename in ("", ".", ".."):
            raise ConfigurationError(
                f"TuneReportCallback(filename={filename!r}): a file name without folders, such "
                "as 'checkpoint.ckpt' (the checkpoint goes into the folder Tune gives it)"
            )
        self._filename = filename

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if "validation_end" in self._on and not trainer.sanity_checking:
            self._report(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if "train_epoch_end" in self._on:
            self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        available = trainer.callback_metrics
        wanted = self._metrics if self._metrics is not None else {k: k for k in available}
        missing = [name for name in wanted.values() if name not in available]
        if missing:
            raise KeyError(
                f"TuneReportCallback reports {missing}, which the model has not logged; logged "
                f"are {sorted(available)}"
            )
        metrics = {tune_name: float(available[name]) for tune_name, name in wanted.items()}
        # one whole file on every strategy (a sharded one's too), in a temporary folder that
        # the node's next sweep removes when a worker is killed while it saves
        data = checkpoint_bytes(trainer, self._filename) if self._save_checkpoints else None
        if trainer.global_rank == 0:
            send_to_driver(report_to_tune, metrics, data, self._filename)
