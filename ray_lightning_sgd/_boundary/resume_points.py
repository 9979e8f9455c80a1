"""A run's resume points: the latest resume checkpoint, as it travels from rank 0 to the driver and
into the next attempt's payload, and the resume checkpoints a storage folder holds."""

from __future__ import annotations

import dataclasses
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ray_lightning_sgd import _files
from ray_lightning_sgd.exceptions import RaySGDError

log = logging.getLogger(__name__)


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
    #: How many batches of ``epoch`` it was written after, when written inside the epoch (at a
    #: preemption notice); None: at the epoch's end.
    batches: int | None = None

    def describe(self) -> str:
        """Where a fit resumes from it, for the driver's log."""
        if self.batches is None:
            return f"after epoch {self.epoch} (global step {self.global_step})"
        return (
            f"in epoch {self.epoch} after {self.batches} batches (global step {self.global_step})"
        )


#: How a resume checkpoint in a storage is named: its epoch and global step, and the batches of
#: the epoch it was written after when written inside it (a preemption's).
_CHECKPOINT_NAME = re.compile(r"resume-epoch=(\d+)-step=(\d+)(?:-batches=(\d+))?\.ckpt")


def checkpoint_name(epoch: int, global_step: int, batches: int | None = None) -> str:
    """The file name of the resume checkpoint of ``epoch`` in a storage folder (``batches``:
    written after that many batches of the epoch, at a preemption notice; None: at its end).
    A new driver reads from the name where the run resumes."""
    inside = "" if batches is None else f"-batches={batches}"
    return f"resume-epoch={epoch}-step={global_step}{inside}.ckpt"


def remove_storage_folder(uri: str) -> None:
    """Worker side (rank 0, once every rank returned a successful call's results): removes the
    launch's own folder of a storage, which no attempt needs any more. Not before: a rank lost
    while the results come back restarts the fit from the folder's newest checkpoint."""
    filesystem, path = _files.filesystem(uri)
    if filesystem.exists(path):
        filesystem.rm(path, recursive=True)


def stored_points(storage: str) -> list[ResumePoint]:
    """The resume checkpoints in a storage folder (a path or fsspec URI), oldest first; neither
    checked (see :func:`newest_complete_point`) nor temporary files."""
    filesystem, path = _files.filesystem(storage)
    filesystem.invalidate_cache(path)  # an object store's listing cached by an earlier call
    if not filesystem.exists(path):
        return []
    points = []
    for entry in filesystem.ls(path, detail=False):
        found = _CHECKPOINT_NAME.fullmatch(str(entry).rstrip("/").rsplit("/", 1)[-1])
        if found:
            epoch, step = int(found[1]), int(found[2])
            batches = None if found[3] is None else int(found[3])
            uri = _files.child(storage, checkpoint_name(epoch, step, batches))
            points.append(ResumePoint(epoch, step, uri=uri, batches=batches))
    # at one epoch and step, an in-epoch point comes before the epoch's end
    return sorted(
        points,
        key=lambda p: (p.epoch, p.global_step, p.batches is None, p.batches or 0),
    )


#: How a zip archive (torch.save's format) starts.
_ZIP_MAGIC = b"PK\x03\x04"
#: How much of a checkpoint's start is read to tell its format (a zero-filled one, no format).
_HEAD_BYTES = 4096


def checkpoint_problem(uri: str) -> str | None:
    """What is wrong with the checkpoint file at ``uri`` (None: it is whole, as far as can be
    told without loading it): missing, empty, zeros where it starts (written but never flushed
    to the disk before a crash), or a zip archive (torch.save's format) cut short or without a
    whole central directory, as a write that stopped early leaves it. Reads the archive's
    directory only (under 1 ms for a checkpoint of any size on a local disk); a file in another
    format (another CheckpointIO's) is taken as it is."""
    import zipfile

    filesystem, path = _files.filesystem(uri)
    try:
        if not filesystem.isfile(path):
            return "is missing"
        size = int(filesystem.size(path))
        if size == 0:
            return "is empty"
        with filesystem.open(path, "rb") as file:
            head = file.read(_HEAD_BYTES)
            if head[:4] != _ZIP_MAGIC:
                if not head.strip(b"\0"):  # no format starts with a page of zeros
                    return "is damaged (zeros where it starts: its data never reached the disk)"
                if len(head) < len(_ZIP_MAGIC) and _ZIP_MAGIC.startswith(head):
                    return "is damaged (truncated)"
                return None
            file.seek(0)
            with zipfile.ZipFile(file) as archive:
                entries = archive.infolist()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as err:
        return f"is damaged ({err})"
    if not any(entry.filename.endswith("data.pkl") for entry in entries):
        return "is damaged (no data.pkl in the archive)"
    if any(entry.header_offset + entry.compress_size > size for entry in entries):
        return "is damaged (truncated)"
    return None


def newest_complete_point(storage: str) -> tuple[ResumePoint | None, list[str]]:
    """The newest whole resume checkpoint in a storage folder, and the damaged ones newer than
    it ("<uri> <what is wrong>"), each named in a warning."""
    damaged: list[str] = []
    for point in reversed(stored_points(storage)):
        problem = checkpoint_problem(str(point.uri))
        if problem is None:
            return point, damaged
        damaged.append(f"{point.uri} {problem}")
        log.warning("The resume checkpoint %s %s: passed over for an older one", point.uri, problem)
    return None, damaged


def resolve(point: ResumePoint) -> ResumePoint:
    """``point``, or where its file is missing or damaged (its writer died, or it was
    deleted), the newest whole checkpoint of its folder, with a warning naming the file passed
    over.

    Raises:
        RaySGDError: No whole checkpoint is left in the folder.
    """
    if point.uri is None:
        return point
    problem = checkpoint_problem(point.uri)
    if problem is None:
        return point
    folder = point.uri.rsplit("/", 1)[0]
    found, _ = newest_complete_point(folder)
    if found is None:
        raise RaySGDError(
            f"The resume checkpoint {point.uri} {problem}, and {folder} holds no other whole "
            "resume checkpoint: the fit cannot resume. Remove the damaged files there (or pass "
            "another run_name) and fit again to start over"
        )
    log.warning(
        "The resume checkpoint %s %s: the fit resumes from %s instead",
        point.uri,
        problem,
        found.uri,
    )
    # the loggers keep the rows before the older point's step (one optimizer: its global step)
    return dataclasses.replace(
        point, epoch=found.epoch, global_step=found.global_step, uri=found.uri,
        batches=found.batches,
        logged_step=min(point.logged_step, found.global_step),
    )  # fmt: skip
