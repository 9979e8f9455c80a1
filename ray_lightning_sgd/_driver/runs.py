"""Driver side: named runs, which a new driver resumes after the old one died.

A run named with ``run_name`` keeps its resume checkpoints in ``<checkpoint_storage>/<run_name>``,
with a ``run.json`` that says what the run trains (the strategy and the model's class). A driver
that starts ``fit`` with the same name resumes from the run's latest resume checkpoint, or refuses
when the stored run trains something else.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from ray_lightning_sgd import _files
from ray_lightning_sgd._boundary.resume_points import (
    ResumePoint,
    newest_complete_point,
)
from ray_lightning_sgd.exceptions import ConfigurationError

log = logging.getLogger(__name__)

#: The file of a run's folder that says what the run trains.
RUN_FILE = "run.json"
#: The file of a run's folder that the driver running it holds locked.
LOCK_FILE = ".driver.lock"


def run_settings(strategy: Any, model: Any) -> dict[str, str]:
    """What a named run must keep training: its strategy's and its model's classes."""
    model_class = type(model)
    return {
        "strategy": type(strategy).__name__,
        "model": f"{model_class.__module__}.{model_class.__qualname__}",
    }


@contextlib.contextmanager
def run_lock(folder: str, name: str) -> Iterator[None]:
    """Driver side: holds the named run's folder for one ``fit``, so that two drivers never
    train (and delete the checkpoints of) the same run at once. The lock is the kernel's
    (``flock``): it goes with its driver, however that ends, and never blocks for ever. On a
    remote storage (an fsspec URI) no lock is taken.

    Raises:
        ConfigurationError: Another driver holds the run now (named with its process and host).
    """
    filesystem, path = _files.filesystem(folder)
    if not _files.is_local(filesystem):
        yield
        return
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, LOCK_FILE)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another driver"
            raise ConfigurationError(
                f"run_name={name!r}: the run in {folder} is being trained by {holder}. Two "
                "drivers cannot train one run at once; wait for that one to end (or stop it), "
                "or pass another run_name"
            ) from None
        except OSError as err:  # a file system without flock (some NFS, Lustre, FUSE mounts)
            unlockable: OSError | None = err
        else:
            unlockable = None
        if unlockable is not None:  # outside the except: the fit's errors do not chain to it
            log.warning(
                "run_name=%r: %s cannot be locked (%s); the run trains unlocked: start one "
                "driver at a time for it",
                name,
                lock,
                unlockable,
            )
            yield
            return
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(
            fd, f"process {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0
        )
        yield
    finally:
        os.close(fd)  # the lock goes with it


def resume_named_run(folder: str, name: str, settings: dict[str, str]) -> ResumePoint | None:
    """Driver side, before a named run's ``fit`` starts any worker: the run's latest whole
    resume checkpoint (None for a new run, whose settings are written down now). Newer ones
    that are damaged (a write that stopped early) are passed over with a warning.

    Raises:
        ConfigurationError: The stored run trains another model or with another strategy; its
            ``run.json`` is damaged; or every resume checkpoint it has is damaged.
    """
    filesystem, path = _files.filesystem(folder)
    run_file = f"{path.rstrip('/')}/{RUN_FILE}"
    _files.remove_leftovers(folder)  # what a driver or rank 0 killed while writing left
    if filesystem.exists(run_file):
        stored = _read_run_file(filesystem, run_file, name)
        differ = {k: (stored.get(k), v) for k, v in settings.items() if stored.get(k) != v}
        if differ:
            shown = "; ".join(
                f"{k}: {old!r} there, {new!r} here" for k, (old, new) in differ.items()
            )
            raise ConfigurationError(
                f"run_name={name!r} names a run in {folder} that trains something else ({shown}). "
                "Pass another run_name for a new run, or remove that folder to start this one over"
            )
    else:
        filesystem.makedirs(path, exist_ok=True)
        _files.write_atomically(_files.child(folder, RUN_FILE), json.dumps(settings))
    point, damaged = newest_complete_point(folder)
    if point is None:
        if damaged:
            raise ConfigurationError(
                f"run_name={name!r}: every resume checkpoint of the run in {folder} is damaged "
                f"({'; '.join(damaged)}). Delete those files to start the run over, or pass "
                "another run_name"
            )
        return None
    log.info(
        "Run %r resumes from its resume checkpoint of epoch %d (global step %d): %s",
        name,
        point.epoch,
        point.global_step,
        point.uri,
    )
    return point


def _read_run_file(filesystem: Any, run_file: str, name: str) -> dict[str, Any]:
    """The settings a run's ``run.json`` holds.

    Raises:
        ConfigurationError: The file is damaged (not a JSON object).
    """
    try:
        with filesystem.open(run_file, "r") as file:
            stored = json.load(file)
    except (ValueError, UnicodeDecodeError) as err:
        stored, problem = None, f"{type(err).__name__}: {err}"
    else:
        problem = f"holds {type(stored).__name__}, not an object"
    if not isinstance(stored, dict):
        raise ConfigurationError(
            f"run_name={name!r}: the run's {run_file} is damaged ({problem}); it says what the "
            "run trains. Delete it to let this driver write it anew (the run's resume "
            "checkpoints stay, and it resumes from them), or pass another run_name"
        )
    return stored
