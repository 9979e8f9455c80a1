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
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import ray

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

#: Files older than the call's start by more than this are not sent (clocks of nodes differ).
_CLOCK_SLACK_S = 2.0


class Artifacts(NamedTuple):
    """What the driver tells rank 0 about where its files belong."""

    roots: tuple[str, ...]
    probe: str | None
    driver_node: str


def _local(path: str | None) -> str | None:
    if not path:
        return None
    path = str(path)
    if path.startswith("file://"):
        return path.removeprefix("file://")
    return None if "://" in path else path


def prepare(trainer: pl.Trainer) -> Artifacts | None:
    """Driver side: the local folders the Trainer writes to, with a probe file; None if none."""
    roots: list[str] = []
    candidates: Iterable[str | None] = [
        trainer.default_root_dir,
        *(getattr(logger, "save_dir", None) for logger in trainer.loggers),
        *(getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks),
    ]
    for candidate in candidates:
        local = _local(candidate)
        if local is not None and os.path.normpath(local) not in roots:
            roots.append(os.path.normpath(local))
    if not roots:
        return None
    probe = None
    root = _local(trainer.default_root_dir)
    if root is not None:
        try:
            os.makedirs(root, exist_ok=True)
            probe = os.path.join(root, f".ray_lightning_sgd-probe-{uuid.uuid4().hex}")
            open(probe, "w").close()
        except OSError:
            probe = None  # a read-only root: rank 0 sends its files
    node = ray.get_runtime_context().get_node_id()
    return Artifacts(tuple(roots), probe, node)


def finish(artifacts: Artifacts | None) -> None:
    """Driver side: removes the probe file."""
    if artifacts is not None and artifacts.probe is not None:
        try:
            os.unlink(artifacts.probe)
        except FileNotFoundError:
            pass


def collect(artifacts: Artifacts | None, started: float) -> dict[str, bytes]:
    """Runs on rank 0 after the call: the files it wrote under the roots, if the driver cannot
    see them (another node, no shared file system)."""
    if artifacts is None:
        return {}
    if ray.get_runtime_context().get_node_id() == artifacts.driver_node:
        return {}
    if artifacts.probe is not None and os.path.exists(artifacts.probe):
        return {}  # the driver's folder is this node's folder
    files: dict[str, bytes] = {}
    for root in artifacts.roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                if path in files or name.startswith(".ray_lightning_sgd-probe-"):
                    continue
                try:
                    if os.path.getmtime(path) < started - _CLOCK_SLACK_S:
                        continue
                    with open(path, "rb") as file:
                        files[path] = file.read()
                except OSError:
                    continue  # gone meanwhile
    return files


def write(files: dict[str, bytes]) -> None:
    """Driver side: writes the files rank 0 sent at the same paths."""
    if not files:
        return
    for path, data in files.items():
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)
    size = sum(len(d) for d in files.values())
    log.info(
        "Copied %d files (%.1f MB) that rank 0 wrote on its node to the driver",
        len(files),
        size / 1e6,
    )


def now() -> float:
    """The wall-clock time a call started at (file times compare with it)."""
    return time.time()
