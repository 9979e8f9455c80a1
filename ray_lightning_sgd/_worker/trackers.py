"""Runs on the workers: this package's part in the loggers' lifecycle, as under ``ddp``.

Under Lightning's ``ddp`` the driver is rank 0: the tracker's run lives in it from the first call
to the last, and Lightning's interrupt handling marks it failed when a call fails. Here rank 0 is
a worker, and a fit may restart on new workers, so rank 0:

- tells the driver which run each logger writes to once Lightning made them (the ``setup`` hook),
  and, with each step it logs, the last step logged of each metric (:class:`LoggerReporterBase`):
  a restarted attempt continues the same run and leaves out the steps it already holds;
- on a failed call, runs the loggers' ``finalize("failed")`` on every rank, as each ``ddp``
  process does (:func:`finalize_failed`);
- at the end of every call, ends what the process would end at its exit under ``ddp`` (a W&B
  run, with its exit code), so that the driver and the next call continue the run by its name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._boundary.channels import LOGGERS
from ray_lightning_sgd._compat import trackers
from ray_lightning_sgd._worker_group.outbox import get_outbox

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

#: How long rank 0 waits, once a call, for the driver to take its loggers' runs' names.
_DELIVERY_WAIT_S = 30.0


class LoggerReporterBase:
    """Runs on rank 0. A callback that reports its loggers' runs and the steps they logged to
    the driver (:data:`~ray_lightning_sgd._boundary.channels.LOGGERS`), and, in a restarted
    attempt, leaves out of a tracker's run the metrics it holds already (``logged``: the steps
    the attempts before logged, by logger and metric)."""

    def __init__(self, logged: Mapping[int, Mapping[str, int]] | None = None) -> None:
        super().__init__()
        #: What the attempts before logged (fixed), and what the runs hold now (reported).
        self._before = {index: dict(steps) for index, steps in (logged or {}).items()}
        self._logged = {index: dict(steps) for index, steps in self._before.items()}
        self._versions: tuple[Any, ...] = ()
        self._wrapped: list[Any] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning made each logger's experiment just before this hook
        self._versions = tuple(logger.version for logger in trainer.loggers)
        for index, logger in enumerate(trainer.loggers):
            if not trainers_replace(logger):
                self._wrap(index, logger)
        sequence = self._report()
        if trackers.tracked(trainer.loggers):
            # the driver holds the runs' names before any step: a rank 0 lost early (before
            # the driver's next poll, up to 0.5 s) would leave its runs unnamed there, and
            # unmarked (an MLflow run RUNNING for ever, a restart making a second one)
            if not get_outbox().wait_delivered(LOGGERS, sequence, _DELIVERY_WAIT_S):
                log.warning(
                    "The driver did not take the loggers' runs within %.0fs; training goes on",
                    _DELIVERY_WAIT_S,
                )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.unwrap()

    def unwrap(self) -> None:
        """The loggers' own ``log_metrics`` again (before their state goes to the driver)."""
        for logger in self._wrapped:
            vars(logger).pop("log_metrics", None)
        self._wrapped = []

    def _wrap(self, index: int, logger: Any) -> None:
        own = logger.log_metrics
        before = self._before.get(index, {})
        logged = self._logged.setdefault(index, {})

        def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> None:
            if step is not None:
                # an earlier attempt logged these (this attempt trains them again)
                metrics = {k: v for k, v in metrics.items() if step > before.get(k, -1)}
                if not metrics:
                    return
                for key in metrics:
                    logged[key] = max(step, logged.get(key, step))
            own(metrics, step)
            if step is not None:
                self._report()

        logger.log_metrics = log_metrics
        self._wrapped.append(logger)

    def report_before_setup(self, trainer: pl.Trainer) -> None:
        """The call failed before this callback's ``setup`` (a datamodule's ``setup``, the
        barrier before it): the runs Lightning made already are reported all the same."""
        if not self._versions:
            self._versions = tuple(trackers.known_version(lg) for lg in trainer.loggers)
            self._report()

    def _report(self) -> int:
        return get_outbox().put_latest(
            LOGGERS, (self._versions, {i: dict(steps) for i, steps in self._logged.items()})
        )


def trainers_replace(logger: Any) -> bool:
    """Whether a restarted attempt's ``logger`` replaces the steps trained again itself (a CSV
    file, TensorBoard's purge) rather than leaving them out."""
    return trackers.replaces_later_steps(logger)


def finalize_failed(
    trainer: pl.Trainer, global_rank: int, reporter: LoggerReporterBase | None = None
) -> None:
    """Runs on each worker whose call failed: the loggers' ``finalize("failed")``, as
    Lightning's interrupt handling runs it in each ``ddp`` process, and rank 0's runs ended as
    failed (and reported, ``reporter``, if the call failed before it did). A logger that fails
    here is logged: the call's own error is the one that counts."""
    if reporter is not None:
        try:
            reporter.report_before_setup(trainer)
        except Exception:
            log.exception("Could not report the loggers' runs to the driver")
    for logger in trainer.loggers:
        try:
            logger.finalize("failed")
            if global_rank == 0:
                trackers.end_run(logger, failed=True)
        except Exception:
            log.exception("%s could not finalize its run as failed", type(logger).__name__)


def end_runs(trainer: pl.Trainer) -> None:
    """Runs on rank 0 after a call that succeeded (Lightning finalized the loggers). A run that
    fails to end is logged: the call's results stand."""
    for logger in trainer.loggers:
        try:
            trackers.end_run(logger, failed=False)
        except Exception:
            log.exception("%s could not end its run", type(logger).__name__)


__all__ = ["LoggerReporterBase", "end_runs", "finalize_failed"]
