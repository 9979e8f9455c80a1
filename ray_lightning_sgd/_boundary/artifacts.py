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
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class Artifacts(NamedTuple):
    """What the driver tells rank 0: the probe file whose absence means "send your files"."""

    probe: str


def local_path(path: str | None) -> str | None:
    if not path:
        return None
    path = str(path)
    if path.startswith("file://"):
        return path.removeprefix("file://")
    return None if "://" in path else path
