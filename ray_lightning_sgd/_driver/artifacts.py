"""Driver side of the artifacts (see :mod:`ray_lightning_sgd._boundary.artifacts`): the probe
file before a call, the files rank 0 sent written after it."""

from __future__ import annotations

import logging
import os
import uuid
from typing import TYPE_CHECKING

from ray_lightning_sgd import _files
from ray_lightning_sgd._boundary.artifacts import Artifacts, local_path

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


def prepare(trainer: pl.Trainer) -> Artifacts | None:
    """Driver side: leaves a probe file in the Trainer's local ``default_root_dir``; None when
    that folder is a remote URI (shared by definition) or cannot be written (nothing to mirror)."""
    root = local_path(trainer.default_root_dir)
    if root is None:
        return None
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".ray_lightning_sgd-probe-{uuid.uuid4().hex}")
        open(probe, "w").close()
    except OSError:
        return None
    return Artifacts(probe)


def finish(artifacts: Artifacts | None) -> None:
    """Driver side: removes the probe file."""
    if artifacts is not None and artifacts.probe is not None:
        try:
            os.unlink(artifacts.probe)
        except FileNotFoundError:
            pass


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
