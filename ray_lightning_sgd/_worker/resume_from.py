"""Runs on each worker: the resume point a restarted attempt (or a new driver's named run) starts
from: agreed on by rank 0 (:func:`resolve_on_rank_zero`), made a path Lightning loads
(:func:`materialise`: the point's URI, or a local copy of its bytes), and released after the call
(:func:`forget`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from collections.abc import Iterator
from typing import Any, cast

from ray_lightning_sgd import _files, _scratch
from ray_lightning_sgd._boundary.resume_points import ResumePoint, resolve
from ray_lightning_sgd.exceptions import RaySGDError


def resolve_on_rank_zero(point: ResumePoint, device: Any = None) -> ResumePoint:
    """Runs on each worker of a restarted attempt (all of them: a collective where the point
    has a URI). Rank 0 resolves the point (:func:`resolve`) and every rank takes its answer, so that
    no rank resumes from another checkpoint than the others (a storage that one rank reads
    differently for a moment, an object store's listing). ``device``: where the process
    group's objects travel (each rank's own GPU with NCCL)."""
    if point.uri is None:
        return point
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return resolve(point)
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = resolve(point)
        except RaySGDError as err:  # every rank raises it, none waits for the others
            answer[0] = err
        except Exception as err:  # noqa: BLE001 - a storage's own error: to every rank too
            answer[0] = RaySGDError(
                f"rank 0 could not check the resume checkpoint {point.uri}: "
                f"{type(err).__name__}: {err}"
            )
    # NCCL sends objects from each rank's own GPU; other backends from the CPU
    device = device if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(answer, src=0, device=device)
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return cast("ResumePoint", answer[0])


def materialise(point: ResumePoint) -> str:
    """Runs on each worker. Returns a path Lightning can resume from: the point's local path,
    or a local copy of its bytes or of its remote file (downloaded with the storage's options,
    which Lightning's own loading does not know), held by this process (see
    :mod:`ray_lightning_sgd._scratch`) until :func:`forget`."""
    # the workers of a node share one copy at one path: a sharded strategy loads the path that
    # rank 0 gives the others
    path = os.path.join(_scratch.folder(), f"{_scratch.PREFIX}{point.name}.ckpt")
    if point.uri is not None:
        filesystem, remote = _files.filesystem(point.uri)
        if _files.is_local(filesystem):
            return point.uri
        _scratch.sweep()
        # one download a node, streamed to the disk: the node's other workers wait, then share it
        with _node_lock(f"{path}.lock"):
            _scratch.hold_copy(path, functools.partial(filesystem.get_file, remote))
        return path
    if point.data is None:
        raise ValueError("a resume point holds either a uri or the checkpoint's bytes")
    _scratch.sweep()  # what killed workers of this node left
    _scratch.hold_copy(path, point.data)
    return path


@contextlib.contextmanager
def _node_lock(path: str) -> Iterator[None]:
    """Holds ``path``'s exclusive ``flock`` (one process of the node at a time); the kernel
    drops it with its process. Where the file system has no locks, nothing is held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def forget(path: str) -> None:
    """Runs on each worker after the call: its local copy of the resume point goes (the last process
    of the node that held it removes it)."""
    if _scratch.holds(path):  # not a storage's own file
        _scratch.release(path)
