"""The driver's view of a run: rank 0's callback events, replayed into callbacks on the driver.

Rank 0 runs :class:`EventForwarderBase`, a callback that notes each hook Lightning calls (setup,
the start and end of every stage and epoch, every batch) with the few counters a progress bar
reads, and sends them to the run monitor in small batches: every :data:`FLUSH_INTERVAL_S` and after
every stage or epoch boundary. Only the last event of a batch carries the metrics (progress bar,
callback and logged metrics), so the step loop pays for no extra device syncs.

The forwarder runs on rank 0 alone, so it must never start a collective: it reads only the metrics
Lightning has already committed on every rank (:func:`ray_lightning_sgd._compat.committed_metrics`),
never the Trainer's metric properties, which may sync ``sync_dist=True`` metrics across ranks. An
event's metrics are read at the next hook, after Lightning committed what that hook's step or epoch
logged: a driver callback's ``on_validation_epoch_end`` sees that validation's metrics.

On the driver, :class:`DriverReplay` takes the events while it waits for the workers and calls the
same hooks on the driver's callbacks: the Trainer's own progress bar (which the workers do not
run) and the strategy's ``driver_callbacks``. Their ``trainer`` argument is a :class:`TrainerView`:
rank 0's latest state over the driver's Trainer (whose settings it passes through). Batch hooks
get ``outputs=None`` and ``batch=None``: those stay on the workers.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import ray
from ray import cloudpickle

from ray_lightning_sgd import _compat
from ray_lightning_sgd._serialization import to_cpu

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

log = logging.getLogger(__name__)

#: How often rank 0 sends its events at most, between stage and epoch boundaries (seconds).
FLUSH_INTERVAL_S = 0.2
#: How often the driver looks for events while the workers run (seconds).
PUMP_INTERVAL_S = 0.1
_MONITOR_CALL_S = 30.0
#: How many distinct output lines the driver remembers for printing each one once across ranks.
_MAX_DISTINCT_LINES = 10_000

#: One event: the hook's name, its index arguments, rank 0's counters, and (on the last event of
#: each batch) its metrics.
Event = tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any] | None]


#: The hook name of an event that asks the driver to run a function (:func:`send_to_driver`).
_CALL = "__call__"
#: The run monitor's actor of the call a worker is running, while it runs one.
_channel: Any = None
#: Rank 0's event forwarder during a call that forwards events: what :func:`send_to_driver` sends
#: goes after the events it holds.
_forwarder: EventForwarderBase | None = None


def open_channel(monitor: Any, forwarder: EventForwarderBase | None = None) -> None:
    """Runs on each worker. Lets :func:`send_to_driver` reach the driver during the call."""
    global _channel, _forwarder
    _channel, _forwarder = monitor, forwarder


def close_channel() -> None:
    global _channel, _forwarder
    _channel, _forwarder = None, None


def send_to_driver(function: Any, *args: Any) -> None:
    """Runs on a worker, during a call: runs ``function(*args)`` on the driver within about 0.1 s
    (after the events the monitor already holds; ``function`` must be importable there). Waits
    until the monitor holds the request; what ``function`` raises on the driver fails the call.
    A call that failed runs no more of them."""
    if _channel is None:
        raise RuntimeError("send_to_driver works on the workers of a RaySGDStrategy call only")
    if _forwarder is not None:
        # the driver replays the events before this call, then runs it
        _forwarder.send_now(keep_last=True)
    event: Event = (_CALL, (function, args), {}, None)
    ray.get(_channel.add_events.remote(cloudpickle.dumps([event])), timeout=_MONITOR_CALL_S)


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
    """Runs on rank 0. A callback that sends every hook's event to the run monitor.

    Each event is sent at the next hook at the earliest: only then has Lightning committed, on
    every rank, the metrics logged up to the end of the event's hook (see :func:`_metrics`).
    """

    def __init__(self, monitor: Any) -> None:
        super().__init__()
        self._monitor = monitor
        self._trainer: pl.Trainer | None = None
        self._pending: list[Event] = []
        self._last_flush = 0.0
        #: Whether what is pending goes out at the next hook (decided as the last event came).
        self._due = False

    def _event(self, trainer: pl.Trainer, hook: str, *args: Any, boundary: bool = False) -> None:
        self._trainer = trainer
        if self._due:
            self._flush()
        self._pending.append((hook, args, _state(trainer), None))
        # decided now, not at the next hook: with slow steps, each batch's end goes out at the
        # next batch's start, with that batch's metrics
        self._due = boundary or time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S

    def _flush(self, wait: bool = False, keep_last: bool = False) -> None:
        keep_from = len(self._pending) - 1 if keep_last else len(self._pending)
        if keep_from <= 0 or self._trainer is None:
            return
        hook, args, state, _ = self._pending[keep_from - 1]
        self._pending[keep_from - 1] = (hook, args, state, _metrics(self._trainer))
        events, self._pending = self._pending[:keep_from], self._pending[keep_from:]
        self._last_flush = time.monotonic()
        self._due = False
        sent = self._monitor.add_events.remote(cloudpickle.dumps(events))
        if wait:
            # the run's last events reach the monitor before rank 0's result reaches the driver
            ray.get(sent, timeout=_MONITOR_CALL_S)

    def send_now(self, keep_last: bool = False) -> None:
        """Sends what is pending, with the metrics committed so far, and waits for it; never
        raises. Before a function sent to the driver, the latest event stays pending
        (``keep_last``): its hook is still running, and its metrics are not committed yet."""
        try:
            self._flush(wait=True, keep_last=keep_last)
        except Exception:
            log.debug("Could not send the last events", exc_info=True)

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self._event(trainer, "setup", stage, boundary=True)

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        # the last hook: every metric of the call is committed; one send for all that is pending
        self._trainer = trainer
        self._pending.append(("teardown", (stage,), _state(trainer), None))
        self._flush(wait=True)

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
        epoch_loop = SimpleNamespace(_should_check_val_epoch=lambda: should_check)
        return SimpleNamespace(epoch_loop=epoch_loop)

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
    """Driver side: replays rank 0's events into the driver's callbacks; prints worker output.

    Args:
        trainer: The driver's Trainer.
        callbacks: The callbacks to call (the progress bar, the strategy's driver callbacks).
        monitor: The run monitor (a ``RunMonitor``), where rank 0 sends its events.
    """

    def __init__(self, trainer: pl.Trainer, callbacks: list[Callback], monitor: Any) -> None:
        self._trainer = trainer
        self._callbacks = list(callbacks)
        self._monitor = monitor
        self.view = TrainerView(trainer)
        self._printer = OutputPrinter()

    def pump(self, run_calls: bool = True) -> None:
        """Driver side: prints the workers' output and replays the events that arrived since the
        last call (and runs the functions workers sent, unless ``run_calls`` is False)."""
        if not self._monitor.started:
            return  # the call failed before its workers were up: nothing was sent
        blobs, output = ray.get(self._monitor.actor.take.remote(), timeout=_MONITOR_CALL_S)
        for rank, lines in output:
            self._printer.write(rank, lines)
        events: list[Event] = [event for blob in blobs for event in cloudpickle.loads(blob)]
        for hook, args, counters, metrics in events:
            if hook == _CALL:
                if run_calls:
                    function, call_args = args
                    function(*call_args)  # what it raises ends the wait for the workers
                continue
            self.view.update(counters, metrics)
            for callback in list(self._callbacks):
                self._call(callback, hook, args)

    def drop_calls(self) -> None:
        """Driver side: an attempt was lost or the call failed; replays the events that arrived,
        but the functions its workers sent do not run."""
        try:
            self.pump(run_calls=False)
        except Exception:
            log.debug("Could not fetch the lost attempt's last events", exc_info=True)

    def fail(self, error: BaseException) -> None:
        """Driver side: the call failed; replays what arrived, then each ``on_exception``.

        Functions the workers sent to the driver and that have not run yet do not run: they
        belong to a call that failed (a Tune report of a step that is lost).
        """
        self.drop_calls()
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


class _LineStream(io.TextIOBase):
    """A worker's ``sys.stdout`` or ``sys.stderr`` during a call: keeps whole lines for the driver."""

    def __init__(self, forwarder: OutputForwarder, name: str, original: Any) -> None:
        super().__init__()
        self._forwarder = forwarder
        self._name = name
        self._original = original
        self._partial = ""
        self._pid = os.getpid()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return int(self._original.fileno())  # what writes to the descriptor goes Ray's way

    def write(self, text: str) -> int:
        if os.getpid() != self._pid:
            # a forked child (a DataLoader worker) has no sender: Ray's log forwarding takes it
            self._original.write(text)
            return len(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            self._forwarder.add(self._name, lines)
        return len(text)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        if self._partial:
            self._forwarder.add(self._name, [self._partial])
            self._partial = ""


class OutputForwarder:
    """Runs on each worker during a call: what Python writes to stdout and stderr (prints,
    ``logging``, warnings) goes to the driver through the run monitor, tagged with the rank,
    instead of through Ray's log forwarding (which tags it with a process id)."""

    def __init__(self, monitor: Any, rank: int) -> None:
        self._monitor = monitor
        self._rank = rank
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._sender = threading.Thread(
            target=self._send_every_interval, name="ray_lightning_sgd-output", daemon=True
        )
        self._saved: tuple[Any, Any] | None = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        self._streams: list[_LineStream] = []

    def add(self, stream: str, lines: list[str]) -> None:
        with self._lock:
            self._pending.extend((stream, line) for line in lines)

    def _send(self, wait: bool = False) -> None:
        with self._lock:
            lines, self._pending = self._pending, []
        if lines:
            sent = self._monitor.add_output.remote(self._rank, lines)
            if wait:
                ray.get(sent, timeout=_MONITOR_CALL_S)

    def _send_every_interval(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self._send()

    def __enter__(self) -> OutputForwarder:
        out, err = sys.stdout, sys.stderr
        self._saved = (out, err)
        new_out, new_err = _LineStream(self, "stdout", out), _LineStream(self, "stderr", err)
        self._streams = [new_out, new_err]
        # logging handlers hold the stream they were made with: point those at ours too
        for handler in _stream_handlers():
            if handler.stream is out or handler.stream is err:
                old = handler.setStream(new_out if handler.stream is out else new_err)
                self._handlers.append((handler, old))
        sys.stdout, sys.stderr = new_out, new_err
        self._sender.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            raise RuntimeError("OutputForwarder.__exit__ without __enter__")
        sys.stdout, sys.stderr = self._saved
        for handler, old in self._handlers:
            handler.setStream(old)
        # handlers made during the call (logging.basicConfig, ...) hold our streams: give them
        # the real ones, or a warm worker's later output would go nowhere
        originals = {id(stream): stream._original for stream in self._streams}
        for handler in _stream_handlers():
            if id(handler.stream) in originals:
                handler.setStream(originals[id(handler.stream)])
        for stream in self._streams:
            stream.finish()
        self._stop.set()
        self._sender.join()
        try:
            self._send(wait=True)
        except Exception:
            log.debug("Could not send the last output lines", exc_info=True)


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers: list[Any] = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return [
        h
        for lg in loggers
        for h in lg.handlers
        if type(h) is logging.StreamHandler
        or (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler))
    ]


class OutputPrinter:
    """Driver side: prints the workers' lines, each tagged ``[rank R]``; a line that several ranks
    print alike (a warning every rank emits) is printed once."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], dict[int, int]] = {}

    def write(self, rank: int, lines: list[tuple[str, str]]) -> None:
        for stream, line in lines:
            if len(self._counts) > _MAX_DISTINCT_LINES:
                self._counts.clear()  # a long run that prints per step: forget old lines
            counts = self._counts.setdefault((stream, line), {})
            seen_elsewhere = max((n for r, n in counts.items() if r != rank), default=0)
            counts[rank] = counts.get(rank, 0) + 1
            if counts[rank] > seen_elsewhere:
                target = sys.stdout if stream == "stdout" else sys.stderr
                target.write(f"[rank {rank}] {line}\n")
        sys.stdout.flush()
        sys.stderr.flush()
