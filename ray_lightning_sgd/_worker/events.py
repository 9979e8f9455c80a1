"""Runs on rank 0: its callback events, for the driver's progress bar and driver callbacks.

Rank 0 runs :class:`EventForwarderBase`, a callback that notes each hook Lightning calls (setup,
the start and end of every stage and epoch, every batch) with the few counters a progress bar
reads, and sends them to the driver in small batches: every :data:`FLUSH_INTERVAL_S` and after
every stage or epoch boundary. Only the last event of a batch carries the metrics (progress bar,
callback and logged metrics), so the step loop pays for no extra device syncs.

The forwarder runs on rank 0 alone, so it must never start a collective: it reads only the metrics
Lightning has already committed on every rank (:func:`ray_lightning_sgd._compat.committed_metrics`),
never the Trainer's metric properties, which may sync ``sync_dist=True`` metrics across ranks. An
event's metrics are read at the next hook, after Lightning committed what that hook's step or epoch
logged: a driver callback's ``on_validation_epoch_end`` sees that validation's metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ray import cloudpickle

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.channels import CALL, EVENTS, Event
from ray_lightning_sgd._serialization import to_cpu
from ray_lightning_sgd._worker_group.outbox import get_outbox

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


#: How often rank 0 hands its events to the outbox at most, between stage and epoch boundaries
#: (seconds).
FLUSH_INTERVAL_S = 0.2


#: Whether a call of a RaySGDStrategy runs in this worker now.
_open = False
#: Rank 0's event forwarder during a call that forwards events: what :func:`send_to_driver` sends
#: goes after the events it holds.
_forwarder: EventForwarderBase | None = None


def open_channel(forwarder: EventForwarderBase | None = None) -> None:
    """Runs on each worker. Lets :func:`send_to_driver` reach the driver during the call."""
    global _open, _forwarder
    _open, _forwarder = True, forwarder


def close_channel() -> None:
    global _open, _forwarder
    _open, _forwarder = False, None


def before_output() -> None:
    """Runs on rank 0, as a line of its output goes to the outbox: the events before it go
    first (all but the running hook's, whose metrics are not committed yet), so that the driver
    shows them in the order they happened. From the thread whose hooks make the events only
    (a line another thread prints waits for no event)."""
    forwarder = _forwarder
    if forwarder is not None and forwarder.in_its_thread():
        forwarder.before_line()


def send_to_driver(function: Any, *args: Any) -> None:
    """Runs on a worker, during a Trainer's call: runs ``function(*args)`` on the driver, within
    about 0.1 s from rank 0 while the driver shows its events live (a progress bar, driver
    callbacks; else 0.5 s), after the events before it, and about 0.5 s from other ranks
    (through the driver's news question, see :mod:`ray_lightning_sgd._driver.inbox`);
    ``function`` must be importable there. Does not
    wait for it. What ``function`` raises on the driver fails the call. A call that failed runs
    no more of them."""
    if not _open:
        raise RuntimeError("send_to_driver works on the workers of a RaySGDStrategy call only")
    if _forwarder is not None:
        # the driver replays the events before this call, then runs it
        _forwarder.send_now(keep_last=True)
    event: Event = (CALL, (function, args), {}, None)
    get_outbox().append(EVENTS, [cloudpickle.dumps([event])])


def _state(trainer: pl.Trainer) -> dict[str, Any]:
    state = trainer.state
    fitting = state.fn is not None and state.fn.value == "fit"
    return {
        "fn": None if state.fn is None else state.fn.value,
        "stage": None if state.stage is None else state.stage.value,
        "status": state.status.value,
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "num_training_batches": trainer.num_training_batches,
        "num_val_batches": list(trainer.num_val_batches),
        "num_sanity_val_batches": list(trainer.num_sanity_val_batches),
        "num_test_batches": list(trainer.num_test_batches),
        "num_predict_batches": list(trainer.num_predict_batches),
        "should_check_val_epoch": fitting and _compat.should_check_val_epoch(trainer),
        "should_stop": trainer.should_stop,
    }


def _metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """Runs on rank 0 alone: reads only committed metrics, which starts no collective."""
    progress_bar, callback, logged = _compat.committed_metrics(trainer)
    loggers = trainer.loggers
    return {
        "progress_bar": dict(progress_bar),
        "callback": to_cpu(dict(callback)),
        "logged": to_cpu(dict(logged)),
        "logger_version": loggers[0].version if loggers else None,
    }


class EventForwarderBase:
    """Runs on rank 0. A callback that hands every hook's event to the outbox, for the driver.

    Each event is sent at the next hook at the earliest: only then has Lightning committed, on
    every rank, the metrics logged up to the end of the event's hook (see :func:`_metrics`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: pl.Trainer | None = None
        #: The thread whose hooks make the events.
        self._thread: int | None = None
        #: Whether a flush runs now (what it prints, a warning say, must not flush again).
        self._flushing = False
        self._pending: list[Event] = []
        self._last_flush = 0.0
        #: Whether what is pending goes out at the next hook (decided as the last event came).
        self._due = False

    def before_line(self) -> None:
        """A line of output is about to go to the outbox: the events before it go first, when
        an event at a boundary waits or the flush interval passed (where a line falls among one
        interval's batch events is not worth a flush a line); all of them between two hooks
        ("`Trainer.fit` stopped" after the last epoch's end), all but the running hook's
        inside one (its metrics are not committed yet)."""
        if self._due or time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.send_now(keep_last=_compat.in_a_hook(self._trainer))

    def in_its_thread(self) -> bool:
        """Whether the calling thread is the one whose hooks make the events."""
        return self._thread == threading.get_ident()

    def _event(self, trainer: pl.Trainer, hook: str, *args: Any, boundary: bool = False) -> None:
        self._trainer, self._thread = trainer, threading.get_ident()
        if self._due:
            self._flush()
        self._pending.append((hook, args, _state(trainer), None))
        # decided now, not at the next hook: with slow steps, each batch's end goes out at the
        # next batch's start, with that batch's metrics
        self._due = boundary or time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S

    def _flush(self, keep_last: bool = False) -> None:
        if self._flushing:
            return
        self._flushing = True
        try:
            self._flush_now(keep_last)
        finally:
            self._flushing = False

    def _flush_now(self, keep_last: bool) -> None:
        keep_from = len(self._pending) - 1 if keep_last else len(self._pending)
        if keep_from <= 0 or self._trainer is None:
            return
        hook, args, state, _ = self._pending[keep_from - 1]
        self._pending[keep_from - 1] = (hook, args, state, _metrics(self._trainer))
        events, self._pending = self._pending[:keep_from], self._pending[keep_from:]
        self._last_flush = time.monotonic()
        if not keep_last:  # the event held back goes out at the next hook, if it was due
            self._due = False
        # pickled now: the metrics as they are at this hook, whenever the driver takes them
        get_outbox().append(EVENTS, [cloudpickle.dumps(events)])

    def send_now(self, keep_last: bool = False) -> None:
        """Hands what is pending to the outbox, with the metrics committed so far; never raises. Before a function sent to the driver, the latest event stays pending
        (``keep_last``): its hook is still running, and its metrics are not committed yet."""
        try:
            self._flush(keep_last=keep_last)
        except Exception:
            log.debug("Could not send the last events", exc_info=True)

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self._event(trainer, "setup", stage, boundary=True)

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        # the last hook: every metric of the call is committed; one send for all that is pending
        self._trainer = trainer
        self._pending.append(("teardown", (stage,), _state(trainer), None))
        self._flush()

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_sanity_check_start", boundary=True)

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_sanity_check_end", boundary=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_train_start", boundary=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_train_end", boundary=True)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_train_epoch_start", boundary=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_train_epoch_end", boundary=True)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._event(trainer, "on_train_batch_start", batch_idx)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._event(trainer, "on_train_batch_end", batch_idx)

    # validation, test and predict have the same hooks; each is spelled out, as Lightning calls
    # only the hooks a callback's class defines
    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_validation_start", boundary=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_validation_end", boundary=True)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_validation_epoch_start", boundary=True)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_validation_epoch_end", boundary=True)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._event(trainer, "on_validation_batch_start", batch_idx, dataloader_idx)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._event(trainer, "on_validation_batch_end", batch_idx, dataloader_idx)

    def on_test_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_test_start", boundary=True)

    def on_test_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_test_end", boundary=True)

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_test_epoch_start", boundary=True)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_test_epoch_end", boundary=True)

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._event(trainer, "on_test_batch_start", batch_idx, dataloader_idx)

    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._event(trainer, "on_test_batch_end", batch_idx, dataloader_idx)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_predict_start", boundary=True)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_predict_end", boundary=True)

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_predict_epoch_start", boundary=True)

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._event(trainer, "on_predict_epoch_end", boundary=True)

    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._event(trainer, "on_predict_batch_start", batch_idx, dataloader_idx)

    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._event(trainer, "on_predict_batch_end", batch_idx, dataloader_idx)
