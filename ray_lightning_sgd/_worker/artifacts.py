"""Runs on rank 0: collects the files its loggers and checkpoint callbacks wrote during a call,
for the driver (see :mod:`ray_lightning_sgd._boundary.artifacts`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ray_lightning_sgd._boundary.artifacts import Artifacts, local_path

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


#: Files older than the call's start by more than this are not sent (clocks of nodes differ).
_CLOCK_SLACK_S = 2.0


#: At most this much is copied back after one call; the rest stays on rank 0's node.
MAX_COPY_BYTES = 4 * 2**30


def _folders(trainer: pl.Trainer) -> list[str]:
    """Runs on rank 0: the local folders its loggers and checkpoint callbacks wrote to (not the
    whole ``default_root_dir``, which defaults to the working directory)."""
    candidates: Iterable[str | None] = [
        *(getattr(logger, "log_dir", None) for logger in trainer.loggers),
        *(getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks),
    ]
    folders: list[str] = []
    for candidate in candidates:
        local = local_path(candidate)
        if local is not None and os.path.normpath(local) not in folders:
            folders.append(os.path.normpath(local))
    return folders


def collect(artifacts: Artifacts | None, trainer: pl.Trainer, started: float) -> dict[str, bytes]:
    """Runs on rank 0 after the call: the files its loggers and checkpoint callbacks wrote during
    the call, if it cannot see the driver's probe file (another node, or another working directory
    for a relative ``default_root_dir``); nothing if it can."""
    if artifacts is None or os.path.exists(artifacts.probe):
        return {}
    files: dict[str, bytes] = {}
    size = 0
    for root in _folders(trainer):
        for folder, subfolders, names in os.walk(root):
            if _is_distributed_checkpoint(names):
                # each rank wrote its own shard where it runs: rank 0's alone would make a
                # folder that looks whole and is not (the README: point the paths at storage
                # every node reaches)
                log.info("Not copying %s to the driver: a sharded checkpoint", folder)
                subfolders.clear()
                continue
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


def _is_distributed_checkpoint(names: list[str]) -> bool:
    """Whether a folder's files are a checkpoint in torch's distributed format (a sharded
    strategy's: its ``.metadata`` and a ``.distcp`` file of each rank's)."""
    return ".metadata" in names and any(name.endswith(".distcp") for name in names)
