"""Runs on each worker: the run's resume checkpoints, written every N epochs when restarts are on,
and at the step where a worker received SIGTERM (a preemption notice).

Rank 0 puts each new :class:`ResumePoint` in its outbox and waits until the driver holds it (the
driver's next poll takes it into its own memory), so a point survives the loss of any worker or
node. With ``checkpoint_storage`` only the URI travels.

A point written inside an epoch resumes exactly there: the restarted attempt's train DataLoader
skips the batches the epoch had trained (:func:`skip_first_batches`), where Lightning alone would
train the epoch's first batches again (it resumes a plain DataLoader exactly only at an epoch's
end).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, cast

from ray_lightning_sgd import _files, _scratch
from ray_lightning_sgd._boundary.channels import RESUME
from ray_lightning_sgd._boundary.resume_points import (
    ResumePoint,
    checkpoint_name,
    fsspec_path,
    resolve,
    stored_points,
)
from ray_lightning_sgd._compat import (
    has_callback,
    logged_step,
    shift_batch_counts,
    show_as_saved_at_batch_end,
    train_combined_loader,
)
from ray_lightning_sgd._worker_group.outbox import get_outbox
from ray_lightning_sgd._worker_group.worker import preemption
from ray_lightning_sgd.exceptions import RaySGDError, WorkerDiedError

if TYPE_CHECKING:
    import pytorch_lightning as pl


log = logging.getLogger(__name__)

#: How long rank 0 waits for the driver to take a resume point before it trains on regardless.
_DELIVERY_WAIT_S = 600.0
#: About how often the ranks of a fit exchange their SIGTERM notices (seconds).
_EXCHANGE_EVERY_S = 0.5
#: The most step boundaries between two exchanges.
_MAX_BOUNDARIES = 1000
#: The start of the warning Lightning gives when a fit resumes inside an epoch.
_INEXACT_RESUME_WARNING = "You're resuming from a checkpoint that ended before"


class ResumeCheckpointBase:
    """Runs on each worker. A callback that saves the run's resume checkpoint every N epochs
    (0: never), and, with ``on_preemption``, at the first step boundary after any rank received
    SIGTERM; then the call ends on every rank with a preempted :class:`WorkerDiedError`, and the
    driver restarts the fit from that checkpoint without the terminated worker.

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
        on_preemption: bool = False,
        resumed: bool = False,
    ) -> None:
        super().__init__()
        self._resumed = resumed  # this attempt resumes from a resume checkpoint
        self._every = every_n_epochs
        self._storage = storage
        self._keep_last = keep_last
        self._keep_folder = keep_folder
        self._on_preemption = on_preemption
        self._watching = False
        self._notices = _Notices()
        #: While an in-epoch checkpoint is saved: the batches its epoch trained and the number
        #: of ranks that shared its data (both go into it).
        self._saving: tuple[int, int] | None = None
        #: After loading an in-epoch checkpoint: the same two, for the restarted epoch.
        self._skip: tuple[int, int] | None = None
        self._skip_counted = False  # whether Lightning's batch counts were set to the skip
        self._quiet: Any = None  # the warnings filter set for the restarted epoch's start

    @property
    def state_key(self) -> str:
        return "ray_lightning_sgd.resume"  # the same in every attempt and flavour

    def state_dict(self) -> dict[str, Any]:
        if self._saving is None:
            return {}
        return {"batches": self._saving[0], "replicas": self._saving[1]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "batches" in state_dict:  # an in-epoch point's (the others save nothing)
            self._skip = (int(state_dict["batches"]), int(state_dict.get("replicas", 0)))

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._saving is None:
            return
        # Saved at a batch's start, after the previous batch's every hook, validation and log
        # row; Lightning's restart knows a save at a batch's end (ModelCheckpoint's
        # every_n_train_steps), and adds to its counts what such a save lacks: shown as one, the
        # batch about to start is not counted as fetched, nor the last one as completed, and the
        # logging step Lightning adds back is taken off.
        show_as_saved_at_batch_end(checkpoint)

    def resume_inside_epoch(self, dataloader: Any, trainer: pl.Trainer) -> None:
        """Called with each train DataLoader of a fit (once ready, before its first iteration):
        after a restart from an in-epoch checkpoint, its first epoch skips the batches that
        epoch had trained.

        On another number of ranks sharing the data (an elastic run), each rank skips its share
        of the samples the epoch had trained (a DistributedSampler deals one order to any number
        of ranks), rounded down to whole batches, and Lightning counts the epoch's batches from
        there: less than a batch's samples a rank may be trained twice.
        """
        if self._skip is None:
            return
        count, trained_on = self._skip
        replicas = _replicas(dataloader)
        if trained_on and trained_on != replicas:
            share, rest = divmod(count * trained_on, replicas)
            if getattr(trainer.lightning_module, "automatic_optimization", True):
                # the restart starts a step: a whole accumulation window
                rest += (share % trainer.accumulate_grad_batches) * replicas
                share -= share % trainer.accumulate_grad_batches
            if not self._skip_counted:
                log.warning(
                    "The epoch trained %d batches a rank on %d ranks; on %d, each skips %d%s",
                    count, trained_on, replicas, share,
                    f" (a few samples are trained again: {rest} batch-shares)" if rest else "",
                )  # fmt: skip
                # the restored epoch's counts, not yet reset by the loop
                shift_batch_counts(trainer, share - count)
            count = share
        self._skip_counted = True
        if _is_stateful(dataloader):
            return  # Lightning restores a stateful DataLoader's position itself
        # the epoch is set also when nothing is skipped: Lightning deals the resumed epoch's
        # first batches before it sets the sampler's epoch
        epoch = trainer.current_epoch  # the interrupted one (its processed count)
        if not skip_first_batches(dataloader, count, epoch):
            log.warning(
                "The fit resumes after batch %d of an epoch, but its train dataloader (%s) "
                "cannot deal that epoch's order again (an iterable that is no DataLoader, or a "
                "sampler without set_epoch): the rest of the epoch comes from a new order",
                count,
                type(dataloader).__name__,
            )
            return
        if self._quiet is None:
            # Lightning warns that a plain DataLoader resumes inexactly inside an epoch: not here
            warnings.filterwarnings("ignore", message=_INEXACT_RESUME_WARNING)
            self._quiet = warnings.filters[0]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._skip, self._skip_counted = None, False  # every train loader has taken its skip
        if self._resumed:
            warn_schedulers_that_end_too_soon(trainer)
        # a stateful DataLoader's saved position would be one batch ahead of an in-epoch point
        if self._on_preemption and not self._watching and _steps_resume_inside(trainer):
            preemption.watched = self._watching = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_watching()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop_watching()

    def _stop_watching(self) -> None:
        self._unquiet()
        if self._watching:
            preemption.watched = self._watching = False

    def _unquiet(self) -> None:
        if self._quiet is not None:  # Lightning's warning was due before the first batch
            with contextlib.suppress(ValueError):
                cast("list[Any]", warnings.filters).remove(self._quiet)
            self._quiet = None

    def at_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int
    ) -> None:
        """Called first at each batch's start (by :class:`BatchStartBase`, before any other
        callback's hook for the batch): stops the fit there if a rank received SIGTERM."""
        self._unquiet()
        if not self._watching:
            return
        # a step boundary: the batches before it stepped the optimizers (nothing accumulated)
        if pl_module.automatic_optimization and batch_idx % trainer.accumulate_grad_batches:
            return
        ranks = self._notices.at_boundary(trainer)
        if not ranks:
            return
        self._saving = (batch_idx, _replicas(_train_loaders(trainer)[0]))
        try:
            point = self._save(trainer)
        finally:
            self._saving = None
        trainer.strategy.barrier("ray_lightning_sgd.preemption")  # the driver holds the point
        raise WorkerDiedError(
            f"rank {', '.join(map(str, ranks))} received SIGTERM (a preemption notice): the "
            f"fit stopped {point.describe()} and restarts from its checkpoint there",
            rank=ranks[0],
            node_id="",  # the driver names that rank's node
            preempted=True,
        )

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
        if not self._every or (trainer.current_epoch + 1) % self._every:
            return
        self._save(trainer)

    def _save(self, trainer: pl.Trainer) -> ResumePoint:
        """Every rank: saves a resume checkpoint now; rank 0 hands it to the driver.

        In a storage, rank 0 writes it under a temporary name of the folder and renames it into
        place once complete, and deletes older checkpoints only after the driver holds this one:
        whenever rank 0 dies, the folder's newest complete checkpoint, or the one the driver
        holds, is there.
        """
        # a sharded strategy saves this checkpoint whole (see OnWorkersBase.resume_checkpoints)
        whole = trainer.strategy.resume_checkpoints()  # type: ignore[attr-defined]
        rank_zero = trainer.global_rank == 0
        if self._storage is not None:
            folder = self._storage.rstrip("/")
            name = checkpoint_name(trainer.current_epoch, trainer.global_step)
            uri, temp = f"{folder}/{name}", f"{folder}/{_files.temp_name(name, unique=False)}"
            if rank_zero:
                _files.remove_leftovers(folder, starting=".resume-")  # of a killed writer
            try:
                with whole:
                    trainer.save_checkpoint(temp)
                if rank_zero:
                    filesystem, path = fsspec_path(temp)
                    _files.publish(filesystem, path, fsspec_path(uri)[1])
            except BaseException:
                if rank_zero:  # a full disk: no part of it stays
                    _files.remove_leftovers(folder, starting=".resume-")
                raise
            data = None
        else:
            uri = None
            _scratch.sweep()  # what killed workers of this node left
            # a folder of its own: Lightning's save replaces the file by name, out of a lock
            held = _scratch.create_folder()
            try:
                path = os.path.join(held, "resume.ckpt")
                with whole:
                    trainer.save_checkpoint(path)
                data = _read(path) if rank_zero else None
            finally:
                _scratch.release(held)
        point = ResumePoint(
            trainer.current_epoch, trainer.global_step, data=data, uri=uri,
            logger_versions=tuple(logger_versions(trainer)) if rank_zero else (),
            logged_step=logged_step(trainer),
            batches=None if self._saving is None else self._saving[0],
        )  # fmt: skip
        if rank_zero:
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
            elif self._storage is not None:
                # only now: until the driver holds this one, it may restart from an older one
                _delete_older(self._storage, point, self._keep_last)
        return point


def warn_schedulers_that_end_too_soon(trainer: pl.Trainer) -> None:
    """Runs on each worker of a resumed fit (rank 0 warns). A scheduler sized once from the
    run's steps (``OneCycleLR(total_steps=trainer.estimated_stepping_batches)``) gets its size
    back from the checkpoint; where the run now takes more steps (an elastic run on fewer
    workers), it would raise at its last step, hours later: said now, with the fixes."""
    sized = [
        config.scheduler
        for config in trainer.lr_scheduler_configs
        if isinstance(getattr(config.scheduler, "total_steps", None), int)
    ]
    if not sized:
        return
    steps = trainer.estimated_stepping_batches  # no collective: lengths and limits
    if not math.isfinite(steps):
        return  # no end (max_epochs=-1): nothing to compare with
    for scheduler in sized:
        total = int(getattr(scheduler, "total_steps", 0))
        if total < steps and trainer.global_rank == 0:
            warnings.warn(
                f"{type(scheduler).__name__}(total_steps={total}) came back from the resume "
                f"checkpoint, but the resumed fit takes {steps:g} optimizer steps in all (on "
                f"{trainer.world_size} workers): it will raise when it passes {total}. Size it "
                "for the largest number of steps, or pass keep_global_batch_size=True to an "
                "elastic run (each epoch then keeps its steps)",
                stacklevel=2,
            )


class BatchStartBase:
    """Runs on each worker. A callback placed first, so that a fit stopped for a preemption at a
    batch's start stops before any other callback's ``on_train_batch_start`` for that batch (it
    runs again after the restart); the rest lives in :class:`ResumeCheckpointBase`."""

    def __init__(self, resume: ResumeCheckpointBase) -> None:
        super().__init__()
        self._resume = resume

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._resume.at_batch_start(trainer, pl_module, batch_idx)


class _Notices:
    """Every rank: which ranks received SIGTERM, exchanged at step boundaries by one all-reduce
    of a flag per rank, about every :data:`_EXCHANGE_EVERY_S` (so at most that, and a step,
    after a notice). Each exchange also agrees on the next: each rank proposes as many
    boundaries as its recent steps take that long, and the fewest proposed wins.

    Why not at every boundary: an all-reduce there cost a step of about 3.7 ms on two CPU
    workers 0.85 ms more, also when it ran beside the step (``benchmarks/bench.py --small``).
    """

    def __init__(self) -> None:
        self._boundaries = 0  # step boundaries this attempt has passed
        self._next = 1  # the boundary of the next exchange: the first one at once
        self._last: tuple[int, float] | None = None  # (boundary, time) of the last exchange

    def at_boundary(self, trainer: pl.Trainer) -> list[int]:
        """Called at each step boundary, on every rank alike: the ranks that received SIGTERM,
        when this boundary exchanges them (else [])."""
        self._boundaries += 1
        if self._boundaries < self._next:
            return []
        import torch
        import torch.distributed as dist

        mine = preemption.received.is_set()
        world, rank = trainer.world_size, trainer.global_rank
        if world == 1 or not (dist.is_available() and dist.is_initialized()):
            return [rank] if mine else []
        proposal = 1
        if self._last is not None:
            boundary, at = self._last
            per_step = (time.monotonic() - at) / max(1, self._boundaries - boundary)
            proposal = max(1, min(_MAX_BOUNDARIES, int(_EXCHANGE_EVERY_S / max(per_step, 1e-6))))
        values = torch.zeros(world + 1, dtype=torch.int64, device=trainer.strategy.root_device)
        values[rank] = int(mine)
        values[world] = -proposal  # the maximum of the negatives: the fewest proposed
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        flags = values.tolist()
        self._next = self._boundaries - flags[world]
        self._last = (self._boundaries, time.monotonic())
        return [r for r in range(world) if flags[r]]


def _is_stateful(dataloader: Any) -> bool:
    """Whether Lightning saves and restores the iterable's position (as its ``_Stateful``)."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(
        getattr(dataloader, "load_state_dict", None)
    )


def _train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The fit's train iterables, each as Lightning iterates it (never iterated here)."""
    combined = train_combined_loader(trainer)
    return list(combined.flattened) if combined is not None else [None]


def _steps_resume_inside(trainer: pl.Trainer) -> bool:
    """Whether a fit's steps resume inside an epoch as they would have gone on: not with a
    stateful DataLoader (its saved position is a batch ahead of a batch's start) nor with a
    GradientAccumulationScheduler (it sets the accumulation at an epoch's start, which a
    resumed epoch does not run again)."""
    if any(_is_stateful(loader) for loader in _train_loaders(trainer)):
        return False
    return not has_callback(trainer, "GradientAccumulationScheduler")


def _replicas(dataloader: Any) -> int:
    """How many ranks share the loader's data: its DistributedSampler's replicas (with tensor
    parallelism fewer than the world size), else 1 (each rank reads it all)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        replicas = getattr(sampler, "num_replicas", None)
        if isinstance(replicas, int) and replicas > 0:
            return replicas
    return 1


def skip_first_batches(dataloader: Any, count: int, epoch: int) -> bool:
    """Runs on each worker. Makes the next iteration of a DataLoader the rest of ``epoch``: its
    sampler set to that epoch, the first ``count`` batches loaded and dropped (later iterations
    are whole), for a fit that resumes inside an epoch; False where it cannot: an iterable that
    is no DataLoader, or an order that is new each time.

    The epoch is set here because Lightning makes the resumed epoch's iterator before it sets
    the samplers' epoch: a shuffling DistributedSampler would deal the first epoch's order.
    """
    from torch.utils.data import DataLoader, SequentialSampler

    if not isinstance(dataloader, DataLoader):
        return False
    batch_sampler = dataloader.batch_sampler
    # what deals the order: the batch sampler's sampler, or a batch sampler of its own making
    dealer = getattr(batch_sampler, "sampler", batch_sampler or dataloader.sampler)
    if not (callable(getattr(dealer, "set_epoch", None)) or isinstance(dealer, SequentialSampler)):
        return False  # another order each time (a RandomSampler): no position to skip to
    loader_class = type(dataloader)

    def __iter__(self: Any) -> Any:  # replaces the class's own
        self.__class__ = loader_class  # once: the epochs after this one are whole
        for sampler in {id(s): s for s in (self.sampler, batch_sampler, dealer)}.values():
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        iterator = loader_class.__iter__(self)
        for _ in range(count):
            next(iterator, None)
        return iterator

    namespace = {"__iter__": __iter__, "__module__": loader_class.__module__}
    dataloader.__class__ = type(loader_class.__name__, (loader_class,), namespace)
    return True


def _delete_older(storage: str, point: ResumePoint, keep_last: int) -> None:
    """Runs on rank 0, once the driver holds ``point``. Deletes the storage's resume checkpoints
    older than ``point`` but the newest ``keep_last - 1`` (newer ones, of an attempt that died,
    stay: they are whole checkpoints of the same run)."""
    older = [
        p
        for p in stored_points(storage)
        if (p.epoch, p.global_step) < (point.epoch, point.global_step)
    ]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        try:
            filesystem, path = fsspec_path(str(old.uri))
            filesystem.rm(path, recursive=True)  # a sharded checkpoint may be a folder
        except Exception as err:  # noqa: BLE001 - a stale checkpoint is no reason to stop training
            log.warning("Could not delete the old resume checkpoint %s: %s", old.uri, err)


def logger_versions(trainer: pl.Trainer) -> list[Any]:
    """Runs on rank 0. Its loggers' versions (resolved there: the folders it writes to)."""
    return [getattr(logger, "version", None) for logger in trainer.loggers]


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


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
    """Runs on each worker. Returns a path Lightning can resume from: the point's URI, or a
    local copy of its bytes, held by this process (see :mod:`.scratch`) until :func:`forget`."""
    if point.uri is not None:
        return point.uri
    if point.data is None:
        raise ValueError("a resume point holds either a uri or the checkpoint's bytes")
    # the workers of a node share one copy at one path: a sharded strategy loads the path that
    # rank 0 gives the others
    path = os.path.join(_scratch.folder(), f"{_scratch.PREFIX}{point.name}.ckpt")
    _scratch.sweep()  # what killed workers of this node left
    _scratch.hold_copy(path, point.data)
    return path


def forget(point: ResumePoint, path: str) -> None:
    """Runs on each worker after the call: its local copy of ``point`` goes (the last process
    of the node that held it removes it)."""
    if point.uri is None:
        _scratch.release(path)
