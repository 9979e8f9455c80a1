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
import shutil
import tempfile
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: How the names of these files start.
PREFIX = "ray_lightning_sgd-resume-"

#: The files this process holds: path -> the open descriptor that holds its lock.
_held: dict[str, int] = {}
#: Of those, the folders of :func:`create_folder`: this process's alone.
_folders: set[str] = set()

#: flock's errors that say the file system has no such locks (some NFS, Lustre, FUSE mounts).
_NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})
#: Whether the folder's file system refused a lock: files then go when their process releases
#: them, as before locks (a killed process's file stays), and nothing is swept.
_unlocked = False


def _lock_shared(fd: int) -> None:
    """Holds ``fd``'s file for this process; nothing where the file system has no locks."""
    global _unlocked
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        if not _unlocked:
            log.warning(
                "%s has no file locks (%s): copies of resume checkpoints that a killed worker "
                "leaves there stay; set TMPDIR to a local folder in worker_env to clean them",
                folder(),
                err,
            )
        _unlocked = True


def folder() -> str:
    """The folder these files live in: the process's temporary folder."""
    return tempfile.gettempdir()


def create(suffix: str) -> str:
    """A new empty file of ours, held by this process until :func:`release`."""
    while True:
        fd, path = tempfile.mkstemp(prefix=PREFIX, suffix=suffix, dir=folder())
        _lock_shared(fd)
        if still_there(fd, path):  # not swept between its creation and the lock
            _held[path] = fd
            return path
        os.close(fd)


def create_folder() -> str:
    """A new empty folder of ours, held by this process until :func:`release`: for files that
    another writer replaces by name (Lightning's save renames its own temporary file into
    place, a new file the lock on the old one would not hold)."""
    while True:
        path = tempfile.mkdtemp(prefix=PREFIX, dir=folder())
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # another process's sweep took it before the lock: make another
        _lock_shared(fd)
        if still_there(fd, path):
            _held[path] = fd
            _folders.add(path)
            return path
        os.close(fd)


def hold_copy(path: str, data: bytes | Callable[[str], None]) -> None:
    """Makes ``path`` a file with ``data`` (or what it writes to the path it is called with:
    called only where no other process of the node made the copy yet), held by this process;
    the processes of a node that make the same copy share one file (whoever comes first writes
    it whole)."""
    if path in _held:
        return
    while True:
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(path, os.O_RDONLY)
            _lock_shared(fd)
            if still_there(fd, path):
                _held[path] = fd
                return
            os.close(fd)
        partial = create(".part")
        try:
            if callable(data):
                data(partial)
            else:
                with open(partial, "wb") as file:
                    file.write(data)
            _link(partial, path)  # fails where another process put its copy first
        except FileExistsError:
            _drop(partial)
            continue  # take that one
        except BaseException:
            _drop(partial)  # a failed write (a full disk) leaves no part behind
            raise
        # the part's descriptor holds the copy's file (one file, two names until this unlink)
        _held[path] = _held.pop(partial)
        with contextlib.suppress(FileNotFoundError):  # gone where it was renamed
            os.unlink(partial)
        return


def _link(partial: str, path: str) -> None:
    """Gives the part its final name too, unless another process gave its own first."""
    try:
        os.link(partial, path)
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.replace(partial, path)  # no hard links here: the last one wins, each one whole


def holds(path: str) -> bool:
    """Whether this process holds ``path``, a file or folder of ours."""
    return path in _held


def release(path: str) -> None:
    """This process is done with ``path``: removed unless another process still holds it."""
    _drop(path)


def _drop(path: str) -> None:
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)  # our lock goes with it
    if _unlocked or path in _folders:  # a folder of our own: no other process uses it
        _folders.discard(path)
        _remove_released(path)
    else:
        remove_unheld(path)


def sweep(wait_s: float = 0.0) -> list[str]:
    """Removes the files and folders of ours in :func:`folder` that no process holds; returns
    their paths. With ``wait_s``, looks again every 0.1 s for that long while some are still
    held (by processes being killed: a lock goes with its process, a moment after the kill)."""
    removed: list[str] = []
    if _unlocked:
        return removed  # no lock tells a killed process's file from a live one's
    deadline = time.monotonic() + wait_s
    while True:
        try:
            names = os.listdir(folder())
        except OSError:
            return removed
        held = False
        for name in names:
            path = os.path.join(folder(), name)
            if name.startswith(PREFIX) and path not in _held:
                if remove_unheld(path):
                    removed.append(path)
                else:
                    held = True
        if not held or time.monotonic() >= deadline:
            return removed
        time.sleep(0.1)


def remove_unheld(path: str) -> bool:
    """Removes ``path`` (a file or folder) unless a process holds a ``flock`` on it; whether it
    did (the driver's artifacts probes are swept with it too)."""
    is_folder = os.path.isdir(path)
    try:
        # a file for writing: where flock is emulated by POSIX locks (NFS), an exclusive one
        # needs it
        fd = os.open(path, os.O_RDONLY if is_folder else os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a process (or a file system without locks)
        os.close(fd)
        return False
    try:
        if still_there(fd, path):
            _remove(path)
            return True
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


def _remove_released(path: str) -> bool:
    """Without locks: removes a file this process released (the other processes of its node
    that share it hold it open: their reads go on)."""
    with contextlib.suppress(FileNotFoundError):
        _remove(path)
        return True
    return False


def still_there(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
