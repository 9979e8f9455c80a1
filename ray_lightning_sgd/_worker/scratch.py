"""Local temporary files of ours (copies of resume checkpoints) that no process outlives.

Each process that uses such a file holds a shared ``flock`` on it for as long as it does; the
kernel drops the lock when the process ends, however it ends (SIGKILL included). :func:`sweep`
removes every file of ours in the temporary folder that no process holds: workers sweep their
node's folder before they make a copy, and the driver sweeps its own node's after each attempt,
so what a killed worker left goes at the next attempt's end or start on that node.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile

log = logging.getLogger(__name__)

#: How the names of these files start.
PREFIX = "ray_lightning_sgd-resume-"

#: The files this process holds: path -> the open descriptor that holds its lock.
_held: dict[str, int] = {}


def folder() -> str:
    """The folder these files live in: the process's temporary folder."""
    return tempfile.gettempdir()


def create(suffix: str) -> str:
    """A new empty file of ours, held by this process until :func:`release`."""
    while True:
        fd, path = tempfile.mkstemp(prefix=PREFIX, suffix=suffix, dir=folder())
        fcntl.flock(fd, fcntl.LOCK_SH)
        if _still_there(fd, path):  # not swept between its creation and the lock
            _held[path] = fd
            return path
        os.close(fd)


def hold_copy(path: str, data: bytes) -> None:
    """Makes ``path`` a file with ``data``, held by this process; the processes of a node that
    make the same copy share one file (whoever comes first writes it whole)."""
    if path in _held:
        return
    while True:
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if _still_there(fd, path):
                _held[path] = fd
                return
            os.close(fd)
        partial = create(".part")
        try:
            with open(partial, "wb") as file:
                file.write(data)
            os.link(partial, path)  # fails where another process put its copy first
        except FileExistsError:
            _drop(partial)
            continue  # take that one
        except BaseException:
            _drop(partial)  # a failed write (a full disk) leaves no part behind
            raise
        # the part's descriptor holds the copy's file (one file, two names until this unlink)
        _held[path] = _held.pop(partial)
        os.unlink(partial)
        return


def release(path: str) -> None:
    """This process is done with ``path``: removed unless another process still holds it."""
    _drop(path)


def _drop(path: str) -> None:
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)  # our lock goes with it
    _remove_unheld(path)


def sweep() -> list[str]:
    """Removes the files of ours in :func:`folder` that no process holds; returns their paths."""
    removed: list[str] = []
    try:
        names = os.listdir(folder())
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder(), name)
        if name.startswith(PREFIX) and path not in _held and _remove_unheld(path):
            removed.append(path)
    return removed


def _remove_unheld(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            log.debug("Could not test %s: %s", path, err)
        os.close(fd)
        return False
    try:
        if _still_there(fd, path):
            os.unlink(path)
            return True
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def _still_there(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
