"""Runs on each worker: the run's resume checkpoint, written every N epochs when restarts are on.

Rank 0 puts each new :class:`ResumePoint` in its outbox and waits until the driver holds it (the
driver's next poll takes it into its own memory), so a point survives the loss of any worker or
node. With ``checkpoint_storage`` only the URI travels.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._compat import logged_step
from ray_lightning_sgd._worker_group.outbox import get_outbox

if TYPE_CHECKING:
    import pytorch_lightning as pl


log = logging.getLogger(__name__)

#: The outbox channel of the run's latest resume point.
RESUME = "resume"
#: How long rank 0 waits for the driver to take a resume point before it trains on regardless.
_DELIVERY_WAIT_S = 600.0


@dataclass(frozen=True)
class ResumePoint:
    """The latest resume checkpoint of a run: its bytes, or the URI it was written to."""

    epoch: int
    global_step: int
    data: bytes | None = None
    uri: str | None = None
    #: Names the local copy each worker makes of ``data`` (the same path on every rank: a
    #: sharded strategy loads the path that rank 0 gives the others).
    name: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Rank 0's loggers' versions: a restarted attempt's loggers go on writing the same folders
    #: (without them, each attempt's CSV and TensorBoard loggers would pick the next version).
    logger_versions: tuple[Any, ...] = ()
    #: The step the loggers recorded rows at when it was written (rows from it on are logged
    #: again by the restarted attempt).
    logged_step: int = 0


class ResumeCheckpointBase:
    """Runs on each worker. A callback that saves the run's resume checkpoint every N epochs.

    Every rank takes part in ``Trainer.save_checkpoint`` (it synchronises); rank 0 writes it, to
    ``storage`` when one is given (a local path or an fsspec URI), else to a local temporary file
    whose bytes go to the driver.
    """

    def __init__(
        self,
        every_n_epochs: int,
        storage: str | None,
        keep_last: int = 2,
        keep_folder: bool = False,
    ) -> None:
        super().__init__()
        self._every = every_n_epochs
        self._storage = storage
        self._keep_last = keep_last
        self._keep_folder = keep_folder

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the launch is over: its own folder of the storage is not needed (a named run's stays,
        # for the next driver that runs it)
        if self._storage is not None and not self._keep_folder and trainer.global_rank == 0:
            import fsspec  # only where a storage is used

            try:
                filesystem, path = fsspec.core.url_to_fs(self._storage)
                if filesystem.exists(path):
                    filesystem.rm(path, recursive=True)
            except Exception as err:  # noqa: BLE001 - the fit succeeded; a stale file is no error
                log.warning("Could not remove the resume checkpoint in %s: %s", self._storage, err)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (trainer.current_epoch + 1) % self._every:
            return
        # a sharded strategy saves this checkpoint whole (see RayStrategyBase.resume_checkpoints)
        whole = trainer.strategy.resume_checkpoints()  # type: ignore[attr-defined]
        if self._storage is not None:
            name = checkpoint_name(trainer.current_epoch, trainer.global_step)
            uri = f"{self._storage.rstrip('/')}/{name}"
            with whole:
                trainer.save_checkpoint(uri)
            if trainer.global_rank == 0:
                _delete_all_but_last(self._storage, self._keep_last)
            data = None
        else:
            uri = None
            fd, path = tempfile.mkstemp(prefix="ray_lightning_sgd-resume-", suffix=".ckpt")
            os.close(fd)
            try:
                with whole:
                    trainer.save_checkpoint(path)
                data = _read(path) if trainer.global_rank == 0 else None
            finally:
                os.unlink(path)
        point = ResumePoint(
            trainer.current_epoch, trainer.global_step, data=data, uri=uri,
            logger_versions=tuple(logger_versions(trainer)) if trainer.global_rank == 0 else (),
            logged_step=logged_step(trainer),
        )  # fmt: skip
        if trainer.global_rank == 0:
            # the checkpoint is safe in the driver before training goes on
            outbox = get_outbox()
            sequence = outbox.put_latest(RESUME, point)
            if not outbox.wait_delivered(RESUME, sequence, _DELIVERY_WAIT_S):
                log.warning(
                    "The driver did not take the resume checkpoint of epoch %d within %.0fs; "
                    "training goes on, and the driver takes it at its next poll",
                    point.epoch,
                    _DELIVERY_WAIT_S,
                )


#: How a resume checkpoint in a storage is named: its epoch and global step.
_CHECKPOINT_NAME = re.compile(r"resume-epoch=(\d+)-step=(\d+)\.ckpt")


def checkpoint_name(epoch: int, global_step: int) -> str:
    """The file name of the resume checkpoint of ``epoch`` in a storage folder."""
    return f"resume-epoch={epoch}-step={global_step}.ckpt"


def stored_points(storage: str) -> list[ResumePoint]:
    """The resume checkpoints in a storage folder (a path or fsspec URI), oldest first."""
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(storage)
    if not filesystem.exists(path):
        return []
    points = []
    for entry in filesystem.ls(path, detail=False):
        found = _CHECKPOINT_NAME.fullmatch(str(entry).rstrip("/").rsplit("/", 1)[-1])
        if found:
            epoch, step = int(found[1]), int(found[2])
            uri = f"{storage.rstrip('/')}/{checkpoint_name(epoch, step)}"
            points.append(ResumePoint(epoch, step, uri=uri))
    return sorted(points, key=lambda point: (point.epoch, point.global_step))


def _delete_all_but_last(storage: str, keep_last: int) -> None:
    """Runs on rank 0. Deletes the storage's resume checkpoints older than the last ``keep_last``."""
    import fsspec

    for point in stored_points(storage)[:-keep_last]:
        try:
            filesystem, path = fsspec.core.url_to_fs(str(point.uri))
            filesystem.rm(path, recursive=True)  # a sharded checkpoint may be a folder
        except Exception as err:  # noqa: BLE001 - a stale checkpoint is no reason to stop training
            log.warning("Could not delete the old resume checkpoint %s: %s", point.uri, err)


def logger_versions(trainer: pl.Trainer) -> list[Any]:
    """Runs on rank 0. Its loggers' versions (resolved there: the folders it writes to)."""
    return [getattr(logger, "version", None) for logger in trainer.loggers]


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def materialise(point: ResumePoint) -> str:
    """Runs on each worker. Returns a path Lightning can resume from (a local copy of the bytes)."""
    if point.uri is not None:
        return point.uri
    if point.data is None:
        raise ValueError("a resume point holds either a uri or the checkpoint's bytes")
    path = os.path.join(tempfile.gettempdir(), f"ray_lightning_sgd-resume-{point.name}.ckpt")
    # the workers of a node write the same bytes to the same path: each whole, then in place
    fd, partial = tempfile.mkstemp(prefix="ray_lightning_sgd-resume-", suffix=".part")
    with os.fdopen(fd, "wb") as file:
        file.write(point.data)
    os.replace(partial, path)
    return path
