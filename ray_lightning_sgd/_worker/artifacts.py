"""Artifacts: the files rank 0's loggers and checkpoint callbacks wrote, on the driver.

Lightning's DDP runs rank 0 on the driver's machine, so logs and checkpoints land where the user
looks. Here rank 0 may run on another node with a file system of its own. Before a call, the
driver notes the folders its Trainer writes to (``default_root_dir``, each logger's ``save_dir``,
each checkpoint callback's ``dirpath``) and leaves a probe file in ``default_root_dir``. After the
call, rank 0 sends back every file under those folders that the call wrote, unless it runs on the
driver's node or sees the probe (a shared file system); the driver writes them at the same paths,
so ``ModelCheckpoint.best_model_path`` names a file the driver can load. Remote URIs (``s3://``,
...) are shared by definition and never copied. Relative paths stay relative: to the driver's
working directory on the driver, as in Lightning.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from ray_lightning_sgd import _files

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

#: Files older than the call's start by more than this are not sent (clocks of nodes differ).
_CLOCK_SLACK_S = 2.0
#: At most this much is copied back after one call; the rest stays on rank 0's node.
MAX_COPY_BYTES = 4 * 2**30


class Artifacts(NamedTuple):
    """What the driver tells rank 0: the probe file whose absence means "send your files"."""

    probe: str


def _local(path: str | None) -> str | None:
    if not path:
        return None
    path = str(path)
    if path.startswith("file://"):
        return path.removeprefix("file://")
    return None if "://" in path else path


def prepare(trainer: pl.Trainer) -> Artifacts | None:
    """Driver side: leaves a probe file in the Trainer's local ``default_root_dir``; None when
    that folder is a remote URI (shared by definition) or cannot be written (nothing to mirror)."""
    root = _local(trainer.default_root_dir)
    if root is None:
        return None
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".ray_lightning_sgd-probe-{uuid.uuid4().hex}")
        open(probe, "w").close()
    except OSError:
        return None
    return Artifacts(probe)


def _folders(trainer: pl.Trainer) -> list[str]:
    """Runs on rank 0: the local folders its loggers and checkpoint callbacks wrote to (not the
    whole ``default_root_dir``, which defaults to the working directory)."""
    candidates: Iterable[str | None] = [
        *(getattr(logger, "log_dir", None) for logger in trainer.loggers),
        *(getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks),
    ]
    folders: list[str] = []
    for candidate in candidates:
        local = _local(candidate)
        if local is not None and os.path.normpath(local) not in folders:
            folders.append(os.path.normpath(local))
    return folders


def finish(artifacts: Artifacts | None) -> None:
    """Driver side: removes the probe file."""
    if artifacts is not None and artifacts.probe is not None:
        try:
            os.unlink(artifacts.probe)
        except FileNotFoundError:
            pass


def collect(artifacts: Artifacts | None, trainer: pl.Trainer, started: float) -> dict[str, bytes]:
    """Runs on rank 0 after the call: the files its loggers and checkpoint callbacks wrote during
    the call, if it cannot see the driver's probe file (another node, or another working directory
    for a relative ``default_root_dir``); nothing if it can."""
    if artifacts is None or os.path.exists(artifacts.probe):
        return {}
    files: dict[str, bytes] = {}
    size = 0
    for root in _folders(trainer):
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                if path in files:
                    continue
                try:
                    if os.path.getmtime(path) < started - _CLOCK_SLACK_S:
                        continue
                    size += os.path.getsize(path)
                    if size > MAX_COPY_BYTES:
                        log.warning(
                            "Not copying the files of %s and after to the driver: more than %d "
                            "MB in all; write logs and checkpoints to storage both can reach",
                            path,
                            MAX_COPY_BYTES // 2**20,
                        )
                        return files
                    with open(path, "rb") as file:
                        files[path] = file.read()
                except OSError:
                    continue  # gone meanwhile
    return files


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
