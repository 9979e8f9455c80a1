"""Driver side: a SIGTERM to the driver during a launch stops its workers on the way out."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


@contextlib.contextmanager
def sigterm_raises(exception: type[BaseException]) -> Iterator[None]:
    """Driver side: SIGTERM during a launch raises ``exception`` (Lightning's SIGTERMException),
    so that the launch stops its workers on the way out, as Ctrl-C does.

    Without it, the default action would end the driver at once and leave the workers to Ray's
    clean-up of a dead driver. A handler the user installed runs first (not the one ``ray.init``
    installs, which only exits: the exception does that after the clean-up); an ignored SIGTERM
    stays ignored. Only the main thread can install handlers; elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None or _handled_outside_python(signal.SIGTERM):
        yield
        return

    chained = previous if callable(previous) and not _from_ray(previous) else None

    def handler(signum: int, frame: Any) -> None:
        log.info("Received SIGTERM on the driver: stopping the workers")
        # a second SIGTERM must not interrupt the clean-up this one starts (the previous
        # handler, Ray's exit or the default action, would end it halfway); SIGKILL still does
        signal.signal(signal.SIGTERM, _stopping_already)
        if chained is not None:
            chained(signum, frame)
        raise exception(128 + signum)  # the exit status of a process ended by the signal

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopping_already(signum: int, frame: Any) -> None:
    log.info("Received SIGTERM again on the driver: the workers are being stopped already")


def _handled_outside_python(number: int) -> bool:
    """Whether a handler that Python does not know of takes signal ``number``: one installed in
    C, such as ``faulthandler.register``'s, which ``signal.getsignal`` shows as ``SIG_DFL`` and
    ``signal.signal`` would replace for good. Read from the kernel (Linux); False where it
    cannot be read."""
    if signal.getsignal(number) is not signal.SIG_DFL or os.name != "posix":
        return False  # Python's own handler (the kernel has Python's trampoline), or ignored
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(256)  # struct sigaction: its handler comes first
        if libc.sigaction(number, None, action) != 0:
            return False
        handler = int.from_bytes(action.raw[: ctypes.sizeof(ctypes.c_void_p)], sys.byteorder)
    except Exception:  # noqa: BLE001 - unreadable: as Python sees it
        return False
    return handler != 0  # SIG_DFL is 0


def _from_ray(handler: Callable[..., Any]) -> bool:
    return getattr(handler, "__module__", "").split(".")[0] == "ray"


@contextlib.contextmanager
def sigusr1_calls(action: Callable[[], None]) -> Iterator[None]:
    """Driver side: SIGUSR1 during a launch calls ``action`` (which only starts a thread: that
    thread prints every rank's stack); a handler the user installed runs too. Only
    the main thread can install handlers, and only where the signal exists."""
    number = getattr(signal, "SIGUSR1", None)
    if number is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(number)
    if previous is None or _handled_outside_python(number):  # it could not be put back
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        action()
        if callable(previous):
            previous(signum, frame)

    signal.signal(number, handler)
    try:
        yield
    finally:
        signal.signal(number, previous)
