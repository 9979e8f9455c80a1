"""Driver side: rank 0's callback events, replayed into callbacks on the driver.

:class:`DriverReplay` takes the events that the run's inbox (:mod:`ray_lightning_sgd._driver.inbox`)
polled from rank 0 while the driver waits for the workers, and calls the same hooks on
the driver's callbacks: the Trainer's own progress bar (which the workers do not run) and the
strategy's ``driver_callbacks``. Their ``trainer`` argument is a :class:`TrainerView`: rank 0's
latest state over the driver's Trainer (whose settings it passes through). Batch hooks get
``outputs=None`` and ``batch=None``: those stay on the workers.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ray import cloudpickle

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.channels import CALL, Event

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

log = logging.getLogger(__name__)


class _Versioned:
    """A driver logger whose ``version`` is the one rank 0's logger used."""

    def __init__(self, logger: Any, version: Any) -> None:
        self._logger = logger
        self.version = version

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def _same(trainer: Any) -> Any:
    return trainer


class TrainerView:
    """What a driver callback gets as ``trainer``: rank 0's latest state over the driver's Trainer.

    Counters (epoch, step, batch counts, stage) and metrics come from rank 0's events; everything
    else (``max_epochs``, ``callbacks``, ``lightning_module``, ...) is the driver Trainer's own.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        # the enums of the Trainer's namespace
        states = sys.modules[type(trainer.state.status).__module__]
        self._enums = (states.TrainerStatus, states.TrainerFn, states.RunningStage)
        state = trainer.state
        self._counters: dict[str, Any] = {
            "fn": None if state.fn is None else state.fn.value,
            "stage": None if state.stage is None else state.stage.value,
            "status": state.status.value,
            "current_epoch": 0,
            "global_step": 0,
            "num_training_batches": float("inf"),
            "num_val_batches": [],
            "num_sanity_val_batches": [],
            "num_test_batches": [],
            "num_predict_batches": [],
            "should_check_val_epoch": False,
            "should_stop": False,
        }
        self.progress_bar_metrics: dict[str, Any] = {}
        self.callback_metrics: dict[str, Any] = {}
        self.logged_metrics: dict[str, Any] = {}
        self._logger_version: Any = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_trainer", "_counters", "_enums"):
            raise AttributeError(name)  # not set yet (while unpickling, for one)
        return getattr(self._trainer, name)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # a callback that kept its view (a progress bar does) travels with the Trainer itself
        return (_same, (self._trainer,))

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "a driver callback called trainer.save_checkpoint: the model trains on the "
            "workers, and the driver's is not trained yet; save checkpoints from a callback "
            "given to the Trainer (Trainer(callbacks=[...])), which runs on rank 0"
        )

    def update(self, counters: dict[str, Any], metrics: dict[str, Any] | None) -> None:
        self._counters = counters
        if metrics is not None:
            self.progress_bar_metrics = metrics["progress_bar"]
            self.callback_metrics = metrics["callback"]
            self.logged_metrics = metrics["logged"]
            self._logger_version = metrics["logger_version"]

    @property
    def state(self) -> Any:
        status, fn, stage = self._enums
        counters = self._counters
        return SimpleNamespace(
            status=status(counters["status"]),
            fn=None if counters["fn"] is None else fn(counters["fn"]),
            stage=None if counters["stage"] is None else stage(counters["stage"]),
        )

    def _stage_is(self, value: str) -> bool:
        return self._counters["stage"] == value

    sanity_checking = property(lambda self: self._stage_is("sanity_check"))
    training = property(lambda self: self._stage_is("train"))
    validating = property(lambda self: self._stage_is("validate"))
    testing = property(lambda self: self._stage_is("test"))
    predicting = property(lambda self: self._stage_is("predict"))
    current_epoch = property(lambda self: self._counters["current_epoch"])
    global_step = property(lambda self: self._counters["global_step"])
    num_training_batches = property(lambda self: self._counters["num_training_batches"])
    num_val_batches = property(lambda self: self._counters["num_val_batches"])
    num_sanity_val_batches = property(lambda self: self._counters["num_sanity_val_batches"])
    num_test_batches = property(lambda self: self._counters["num_test_batches"])
    num_predict_batches = property(lambda self: self._counters["num_predict_batches"])
    should_stop = property(lambda self: self._counters["should_stop"])
    is_global_zero = True
    global_rank = 0
    local_rank = 0
    node_rank = 0

    @property
    def fit_loop(self) -> Any:
        should_check = self._counters["should_check_val_epoch"]
        return _compat.val_check_view(should_check)

    @property
    def loggers(self) -> list[Any]:
        loggers = self._trainer.loggers
        if not loggers or self._logger_version is None:
            return loggers
        return [_Versioned(loggers[0], self._logger_version), *loggers[1:]]

    @property
    def logger(self) -> Any:
        loggers = self.loggers
        return loggers[0] if loggers else None


class DriverReplay:
    """Driver side: replays rank 0's events into the driver's callbacks, and runs the functions
    workers sent with ``send_to_driver``.

    Args:
        trainer: The driver's Trainer.
        callbacks: The callbacks to call (the progress bar, the strategy's driver callbacks).
    """

    def __init__(self, trainer: pl.Trainer, callbacks: list[Callback]) -> None:
        self._trainer = trainer
        self._callbacks = list(callbacks)
        self.view = TrainerView(trainer)

    @property
    def shows_live(self) -> bool:
        """Whether a callback on the driver shows rank 0's events as they come (the driver then
        asks rank 0 for them more often)."""
        return bool(self._callbacks)

    def replay(self, blobs: list[bytes], run_calls: bool = True) -> None:
        """Driver side: replays the events of ``blobs`` (pickled lists of events, in order), and
        runs the functions workers sent, unless ``run_calls`` is False (they belong to an attempt
        that was lost or a call that failed: a Tune report of a step that is lost)."""
        events: list[Event] = [event for blob in blobs for event in cloudpickle.loads(blob)]
        for hook, args, counters, metrics in events:
            if hook == CALL:
                if run_calls:
                    function, call_args = args
                    function(*call_args)  # what it raises ends the wait for the workers
                continue
            self.view.update(counters, metrics)
            for callback in list(self._callbacks):
                self._call(callback, hook, args)

    def fail(self, error: BaseException) -> None:
        """Driver side: the call failed; calls each callback's ``on_exception``."""
        for callback in list(self._callbacks):
            self._call(callback, "on_exception", (error,))

    def _call(self, callback: Callback, hook: str, args: tuple[Any, ...]) -> None:
        module = self._trainer.lightning_module
        if hook.endswith("_batch_start"):
            args = (None, *args)  # batch
        elif hook.endswith("_batch_end"):
            args = (None, None, *args)  # outputs, batch
        try:
            getattr(callback, hook)(self.view, module, *args)
        except Exception:
            log.warning(
                "The driver callback %s failed in %s and is off for the rest of this call",
                type(callback).__name__,
                hook,
                exc_info=True,
            )
            self._callbacks.remove(callback)
