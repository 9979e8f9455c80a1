"""Runs on each worker during a call: its stdout and stderr, line by line, for the driver."""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import Any

from ray_lightning_sgd._boundary.channels import OUTPUT
from ray_lightning_sgd._worker.events import before_output
from ray_lightning_sgd._worker_group.outbox import get_outbox


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
    ``logging``, warnings) goes to the driver through the worker's outbox, and the driver prints
    it tagged with the rank, instead of through Ray's log forwarding (which tags it with a process
    id)."""

    def __init__(self) -> None:
        self._saved: tuple[Any, Any] | None = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        self._streams: list[_LineStream] = []

    def add(self, stream: str, lines: list[str]) -> None:
        before_output()  # rank 0's events before these lines go first
        get_outbox().append(OUTPUT, [(stream, line) for line in lines])

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
