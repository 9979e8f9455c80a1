"""Runs on rank 0: resume checkpoints sent on in the background while training goes on.

Every rank takes part in a resume checkpoint's save (it synchronises), which writes the whole file
to rank 0's local disk; what follows happens in one thread of rank 0 (:class:`Uploads`): the upload
to ``checkpoint_storage`` (or the read of its bytes for the driver), the hand-over to the driver,
the deletion of older checkpoints. At most one checkpoint is sent at a time; a newer one that
arrives meanwhile waits, and replaces one that is still waiting (whose local copy goes), but for
an epoch's end, which an in-epoch checkpoint never replaces (an elastic run grows only from an
epoch's end): the in-epoch one is dropped then. A checkpoint is the run's resume point only once
it is sent: until then the driver holds the previous one. A send that fails is logged and leaves
the previous point.

The call's end waits for the last send and reports its failure (:meth:`Uploads.wait`,
:meth:`Uploads.failure`); a call
that fails drops what waits, lets the send in flight complete without handing it over (the driver
restarts from the point it holds), and returns at once (:meth:`Uploads.abandon`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Upload:
    """One checkpoint to send: ``send`` does it (``cancelled()`` tells it the call failed and
    nothing is to be handed over); ``discard`` removes its local copy, after ``send`` or
    instead of it."""

    label: str
    send: Callable[[Callable[[], bool]], None]
    discard: Callable[[], None]
    #: An epoch's end: never replaced by an in-epoch checkpoint while it waits.
    kept: bool = False


class Uploads:
    """Runs on rank 0: sends its resume checkpoints one at a time, in a thread of its own that
    lives while there is something to send."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._waiting: Upload | None = None
        self._running: Upload | None = None
        self._thread: threading.Thread | None = None
        self._cancelled = False
        #: The label and error of the last send, when it failed (a later success clears it).
        self._failure: tuple[str, BaseException] | None = None
        #: Seconds each send took, in order.
        self.durations: list[float] = []

    def make_room(self, kept: bool) -> None:
        """Before a new checkpoint is saved: drops the one that waits, which the new one (an
        epoch's end where ``kept``) would replace, so that rank 0's disk holds two at most."""
        with self._lock:
            waiting = self._waiting
            if waiting is None or (waiting.kept and not kept):
                return
            self._waiting = None
        log.info("The resume checkpoint %s is dropped before its upload: a newer one comes",
                 waiting.label)  # fmt: skip
        _discard(waiting)

    def submit(self, upload: Upload) -> None:
        """Sends ``upload`` after the one in flight; one that still waits is replaced, but for
        an epoch's end, which an in-epoch one never replaces (that one is dropped)."""
        with self._lock:
            if self._waiting is not None and self._waiting.kept and not upload.kept:
                replaced: Upload | None = upload  # the epoch's end goes first
                why = f"the epoch's end {self._waiting.label} waits for its upload"
            else:
                replaced, self._waiting = self._waiting, upload
                why = f"{upload.label} replaces it"
            self._cancelled = False
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ray_lightning_sgd-uploads", daemon=True
                )
                self._thread.start()
            self._lock.notify_all()
        if replaced is not None:
            log.info("The resume checkpoint %s is dropped before its upload: %s", replaced.label,
                     why)  # fmt: skip
            _discard(replaced)

    def busy(self) -> bool:
        """Whether a send is in flight or waits."""
        with self._lock:
            return self._running is not None or self._waiting is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits until nothing is in flight or waits; False when ``timeout_s`` passed first."""
        with self._lock:
            return self._lock.wait_for(
                lambda: self._running is None and self._waiting is None, timeout=timeout_s
            )

    def failure(self) -> tuple[str, BaseException] | None:
        """The label and error of the last send, when it failed."""
        with self._lock:
            return self._failure

    def abandon(self) -> None:
        """At a call's failure: drops the waiting checkpoint; the one in flight completes
        without being handed over. Returns at once."""
        with self._lock:
            dropped, self._waiting = self._waiting, None
            self._cancelled = True
            self._lock.notify_all()
        if dropped is not None:
            _discard(dropped)

    def _is_cancelled(self) -> bool:
        with self._lock:
            return self._cancelled

    def _run(self) -> None:
        while True:
            with self._lock:
                upload = self._waiting
                if upload is None:
                    self._thread = None  # a later submit starts another
                    self._lock.notify_all()
                    return
                self._waiting, self._running = None, upload
            started = time.monotonic()
            failure: tuple[str, BaseException] | None = None
            try:
                upload.send(self._is_cancelled)
            except BaseException as err:  # noqa: BLE001 - what the storage raises: logged, kept
                failure = (upload.label, err)
                log.warning(
                    "The resume checkpoint %s could not be sent (%s: %s); the run's resume point "
                    "stays the previous one",
                    upload.label,
                    type(err).__name__,
                    err,
                )
            finally:
                _discard(upload)
            with self._lock:
                self.durations.append(time.monotonic() - started)
                self._failure = failure
                self._running = None
                self._lock.notify_all()


def _discard(upload: Upload) -> None:
    try:
        upload.discard()
    except Exception as err:  # noqa: BLE001 - a local copy left is swept later (_scratch)
        log.warning("Could not remove the local copy of %s: %s", upload.label, err)
