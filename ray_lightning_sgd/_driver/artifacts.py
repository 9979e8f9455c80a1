"""Driver side of the artifacts (see :mod:`ray_lightning_sgd._boundary.artifacts`): the probe
file before a call, the files rank 0 sent written after it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from typing import TYPE_CHECKING

from ray_lightning_sgd import _files, _scratch
from ray_lightning_sgd._boundary.artifacts import Artifacts, local_path

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


#: How the driver's probe files start, here and in a checkpoint storage (hidden: Lightning's
#: and our listings skip them).
PROBE_PREFIX = _files.PROBE_PREFIX
#: The probe files of this process's running calls: path -> the descriptor holding its lock.
_held: dict[str, int] = {}


def prepare(trainer: pl.Trainer) -> Artifacts | None:
    """Driver side: leaves a probe file in the Trainer's local ``default_root_dir``; None when
    that folder is a remote URI (shared by definition) or cannot be written (nothing to mirror).

    The driver holds a shared ``flock`` on its probe while the call runs; the kernel drops it
    when the process ends, however it ends (SIGKILL, a Ray Tune trial's actor ended while the
    call cleaned up), and each call first removes the probes in the folder that no process
    holds."""
    root = local_path(trainer.default_root_dir)
    if root is None:
        return None
    try:
        os.makedirs(root, exist_ok=True)
        _sweep(root)
        while True:
            probe = os.path.join(root, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
            fd = os.open(probe, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
            if _held_on(fd, probe):
                break
            os.close(fd)  # another driver's sweep took it between its creation and the lock
    except OSError:
        return None
    _held[probe] = fd
    return Artifacts(probe)


def finish(artifacts: Artifacts | None) -> None:
    """Driver side: removes the probe file."""
    if artifacts is not None and artifacts.probe is not None:
        fd = _held.pop(artifacts.probe, None)
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(artifacts.probe)
        except FileNotFoundError:
            pass


def _held_on(fd: int, path: str) -> bool:
    """Holds ``fd``'s file for this process (nothing where the file system has no locks);
    whether it is still the file at ``path``."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH)
    return _scratch.still_there(fd, path)


def _sweep(root: str) -> None:
    """Removes the probe files in ``root`` that no process holds: those of drivers that ended
    before they could remove their own."""
    try:
        names = [name for name in os.listdir(root) if name.startswith(PROBE_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        # not another call of this process's: closing a descriptor of it could drop its lock
        # (where flock is emulated by POSIX locks: NFS)
        if path not in _held and _scratch.remove_unheld(path):
            log.debug("Removed %s, a probe file of an ended driver", path)


def write(files: dict[str, bytes]) -> None:
    """Driver side: writes the files rank 0 sent at the same paths, each whole or not at all
    (a later call reads them: ``test(ckpt_path="best")``)."""
    if not files:
        return
    for path, data in files.items():
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        _files.write_atomically(path, data)
    size = sum(len(d) for d in files.values())
    log.info(
        "Copied %d files (%.1f MB) that rank 0 wrote on its node to the driver",
        len(files),
        size / 1e6,
    )
