"""Runs on each worker: the resume checkpoint's writer. :class:`ResumeCheckpointBase` saves the run's
resume checkpoints every N epochs when restarts are on, and at the step where a worker received
SIGTERM (a preemption notice, which the ranks exchange through
:mod:`~ray_lightning_sgd._worker.preemption_notices`); :class:`BatchStartBase` makes it the first
to see each batch.

Every rank takes part in the save, which writes the whole checkpoint to rank 0's local disk;
rank 0 then sends it on in the background while training goes on
(:mod:`~ray_lightning_sgd._worker.uploads`): uploaded to ``checkpoint_storage`` (then only its URI
travels), or its bytes to the driver; the new :class:`ResumePoint` goes into rank 0's outbox, and
older checkpoints in the storage are deleted once the driver holds it (the driver's next poll
takes it into its own memory), so a point survives the loss of any worker or node. With
``checkpoint_every_n_steps`` or ``checkpoint_every_s`` checkpoints come inside epochs too, at
step boundaries.

A point written inside an epoch records the batches the epoch had trained; the restarted attempt
resumes exactly there (:mod:`~ray_lightning_sgd._worker.resumed_fit`), from the point that
:mod:`~ray_lightning_sgd._worker.resume_from` makes a path Lightning loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ray_lightning_sgd import _files, _scratch
from ray_lightning_sgd._boundary.channels import PROGRESS, RESUME
from ray_lightning_sgd._boundary.data_loader import RayDataLoader
from ray_lightning_sgd._boundary.resume_points import (
    ResumePoint,
    checkpoint_name,
    stored_points,
)
from ray_lightning_sgd._compat import logged_step, shift_batch_counts, show_as_saved_at_batch_end
from ray_lightning_sgd._worker.preemption_notices import _Notices
from ray_lightning_sgd._worker.resumed_fit import (
    _is_stateful,
    _replicas,
    _steps_resume_inside,
    _train_loaders,
    skip_first_batches,
    warn_schedulers_that_end_too_soon,
)
from ray_lightning_sgd._worker.uploads import Upload, Uploads
from ray_lightning_sgd._worker_group.outbox import get_outbox
from ray_lightning_sgd._worker_group.worker import preemption
from ray_lightning_sgd.exceptions import WorkerDiedError

if TYPE_CHECKING:
    import pytorch_lightning as pl


log = logging.getLogger(__name__)

#: How long a training worker that received SIGTERM trains on, at most, to the end of its step,
#: for the run's checkpoint there (under the 30 s that Kubernetes and GCP's spot VMs allow).
PREEMPTION_GRACE_S = 20.0
#: How long rank 0 waits for the driver to take a resume point before it trains on regardless.
_DELIVERY_WAIT_S = 600.0
#: How often rank 0 notes its progress while the fit's end waits for the last upload.
_HEARTBEAT_S = 5.0
#: The start of the warning Lightning gives when a fit resumes inside an epoch.
_INEXACT_RESUME_WARNING = "You're resuming from a checkpoint that ended before"


class ResumeCheckpointBase:
    """Runs on each worker. A callback that saves the run's resume checkpoint every N epochs
    (0: never), every ``every_n_steps`` optimizer steps and at the first step boundary after
    ``every_s`` seconds (0: never), and, with ``on_preemption``, at the first step boundary after
    any rank received SIGTERM; then the call ends on every rank with a preempted
    :class:`WorkerDiedError`, and the driver restarts the fit from that checkpoint without the
    terminated worker.

    Every rank takes part in ``Trainer.save_checkpoint`` (it synchronises), which writes it to a
    local temporary file of rank 0; rank 0 sends it on in the background (to ``storage`` when one
    is given, a local path or an fsspec URI, else its bytes to the driver). With ``at_fit_end``
    (a named run) a fit that ends after an epoch without one (``checkpoint_every_n_epochs`` does
    not divide it, ``max_steps``, an early stop) saves one as it ends, so that the run's next
    driver trains nothing again.
    """

    def __init__(
        self,
        every_n_epochs: int,
        storage: str | None,
        keep_last: int = 2,
        on_preemption: bool = False,
        resumed: bool = False,
        at_fit_end: bool = False,
        every_n_steps: int = 0,
        every_s: float = 0.0,
    ) -> None:
        super().__init__()
        self._at_fit_end = at_fit_end
        self._every_steps = every_n_steps
        self._every_s = every_s
        #: The global step and time (rank 0's clock) of the latest checkpoint, or the start.
        self._last_step = 0
        self._last_time = time.monotonic()
        #: Rank 0's sends of its checkpoints (see :mod:`~ray_lightning_sgd._worker.uploads`).
        self.uploads = Uploads()
        self._swept = False  # whether rank 0 removed what killed writers left in the storage
        #: The (epoch, global step) of this attempt's latest epoch-end checkpoint.
        self._saved_at: tuple[int, int] | None = None
        self._resumed = resumed  # this attempt resumes from a resume checkpoint
        self._every = every_n_epochs
        self._storage = storage
        self._keep_last = keep_last
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
        if isinstance(dataloader, RayDataLoader):
            dataloader.skip_next_pass(count)
            return
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
        self._last_step, self._last_time = trainer.global_step, time.monotonic()
        inside = bool(self._every_steps or self._every_s)
        if not (self._on_preemption or inside) or self._watching:
            return
        # a stateful DataLoader's saved position would be one batch ahead of an in-epoch point
        if not _steps_resume_inside(trainer):
            if inside and trainer.global_rank == 0:
                log.warning(
                    "checkpoint_every_n_steps/checkpoint_every_s: this fit's steps cannot resume "
                    "inside an epoch (a stateful train DataLoader, or a "
                    "GradientAccumulationScheduler): resume checkpoints come at epoch ends only"
                )
            return
        self._watching = True
        if self._on_preemption:
            preemption.grace_s = PREEMPTION_GRACE_S

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_watching()
        # here, not at the last epoch's end: Lightning's EarlyStopping and the module's own hook
        # decide to stop after this package's epoch-end hook has run (and only a fit that ends
        # runs this hook: not one stopped by an error or a preemption)
        last = max(0, trainer.current_epoch - 1)  # the epoch counts as completed by now
        if self._at_fit_end and self._every and self._saved_at != (last, trainer.global_step):
            self._save(trainer, epoch=last)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop_watching()

    def _stop_watching(self) -> None:
        self._unquiet()
        if self._watching:
            self._watching = False
            if self._on_preemption:
                preemption.grace_s = 0.0

    def _unquiet(self) -> None:
        if self._quiet is not None:  # Lightning's warning was due before the first batch
            with contextlib.suppress(ValueError):
                cast("list[Any]", warnings.filters).remove(self._quiet)
            self._quiet = None

    def at_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int
    ) -> None:
        """Called first at each batch's start (by :class:`BatchStartBase`, before any other
        callback's hook for the batch): saves a checkpoint there when one is due by steps or
        time, and stops the fit there if a rank received SIGTERM."""
        self._unquiet()
        if not self._watching:
            return
        # a step boundary: the batches before it stepped the optimizers (nothing accumulated)
        if pl_module.automatic_optimization and batch_idx % trainer.accumulate_grad_batches:
            return
        stepped = trainer.global_step - self._last_step
        timed = bool(self._every_s) and time.monotonic() - self._last_time >= self._every_s
        ranks, due = self._notices.at_boundary(trainer, due=timed and trainer.global_rank == 0)
        ranks = ranks if self._on_preemption else []
        due = due or bool(self._every_steps and stepped >= self._every_steps)
        if not ranks and not (due and stepped and batch_idx):
            return  # (at an epoch's first batch, the epoch end's checkpoint is as new)
        self._saving = (batch_idx, _replicas(_train_loaders(trainer)[0]))
        try:
            point = self._save(trainer, wait=bool(ranks))
        finally:
            self._saving = None
        if not ranks:
            return
        trainer.strategy.barrier("ray_lightning_sgd.preemption")  # the driver holds the point
        raise WorkerDiedError(
            f"rank {', '.join(map(str, ranks))} received SIGTERM (a preemption notice): the "
            f"fit stopped {point.describe()} and restarts from its checkpoint there (or, where "
            "rank 0 could not send it within the grace period, from the one before)",
            rank=ranks[0],
            node_id="",  # the driver names that rank's node
            preempted=True,
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._every or (trainer.current_epoch + 1) % self._every:
            return
        self._save(trainer)
        self._saved_at = (trainer.current_epoch, trainer.global_step)

    def finish(self, trainer: pl.Trainer, report_progress: bool = False) -> None:
        """Runs on each worker at the call's successful end: rank 0 waits for its last
        checkpoint's send (noting its progress meanwhile, with ``report_progress``: a slow upload
        is no stall for ``progress_timeout_s``), and warns when it failed (the run's resume point
        is an older one)."""
        while not self.uploads.wait(_HEARTBEAT_S):
            if report_progress:
                get_outbox().put_latest(
                    PROGRESS, ("uploading the last resume checkpoint", trainer.global_step, 0.0)
                )
        failure = self.uploads.failure()
        if failure is None or trainer.global_rank != 0:
            return
        label, err = failure
        where = self._storage or "the driver"
        warnings.warn(
            f"The fit's last resume checkpoint ({label}) could not be sent to {where}: "
            f"{type(err).__name__}: {err}. The run's resume point is the one before it",
            stacklevel=1,
        )

    def _save(
        self, trainer: pl.Trainer, epoch: int | None = None, wait: bool = False
    ) -> ResumePoint:
        """Every rank: saves a resume checkpoint now, to rank 0's local disk; rank 0 sends it on
        in the background (``wait``: before this returns, as at a preemption notice, where the
        ranks stop once the driver holds it). ``epoch``: the epoch it is named after, when not
        the Trainer's current one (at the fit's end).

        In a storage, a checkpoint is uploaded whole or not at all (see
        :func:`ray_lightning_sgd._files.upload`), and older checkpoints are deleted only after
        the driver holds it: whenever rank 0 dies, the folder's newest complete checkpoint, or
        the one the driver holds, is there.
        """
        rank_zero = trainer.global_rank == 0
        batches = None if self._saving is None else self._saving[0]
        epoch = trainer.current_epoch if epoch is None else epoch
        name = checkpoint_name(epoch, trainer.global_step, batches)
        uri = None if self._storage is None else _files.child(self._storage, name)
        into = self._in_place() if rank_zero else None
        if rank_zero:
            self.uploads.make_room(kept=batches is None)  # two checkpoints on its disk at most
        staged = _stage(trainer, name, into)
        self._last_step, self._last_time = trainer.global_step, time.monotonic()
        if staged is None:
            return ResumePoint(epoch, trainer.global_step, uri=uri, batches=batches)
        try:
            point = ResumePoint(
                epoch, trainer.global_step, uri=uri,
                logger_versions=tuple(logger_versions(trainer)),
                logged_step=logged_step(trainer),
                batches=batches,
            )  # fmt: skip
            upload = Upload(
                point.describe(),
                send=functools.partial(self._send, point, staged.path, into is not None),
                discard=staged.discard,
                kept=batches is None,
            )
        except BaseException:
            staged.discard()
            raise
        self.uploads.submit(upload)
        if wait and not self.uploads.wait(PREEMPTION_GRACE_S * 0.75):
            log.warning(
                "The resume checkpoint %s was not sent within %.0fs of the preemption's grace "
                "period: the restart resumes from the point the driver holds",
                point.describe(),
                PREEMPTION_GRACE_S * 0.75,
            )
        return point

    def _in_place(self) -> str | None:
        """Runs on rank 0: the storage's folder where a checkpoint is saved in place (renamed
        into place once sent, no copy): a local folder on the disk of the worker's temporary
        folder, where a save there costs what a save to the temporary folder costs. None for
        any other storage (an object store; a shared mount, whose write would hold training
        up): the checkpoint is saved to the temporary folder and uploaded in the background.
        Removes what killed writers left there, once."""
        if self._storage is None:
            return None
        filesystem, folder = _files.filesystem(self._storage)
        if not _files.is_local(filesystem):
            return None
        if not self._swept:  # at this attempt's first checkpoint: nothing of its own is there
            _files.remove_leftovers(self._storage, starting=".resume-")
            self._swept = True
        try:
            os.makedirs(folder, exist_ok=True)
            same_disk = os.stat(folder).st_dev == os.stat(_scratch.folder()).st_dev
        except OSError:
            return None  # the upload says what is wrong, in the background
        return folder if same_disk else None

    def _send(self, point: ResumePoint, path: str, in_place: bool, cancelled: Any) -> None:
        """Runs on rank 0, in its uploads' thread: sends the checkpoint saved at ``path`` to
        the storage (``in_place``: saved in the storage's local folder, renamed into place), or
        its bytes to the driver; then hands the point to the driver, and once the driver holds
        it deletes the storage's older checkpoints."""
        if point.uri is not None and in_place:
            filesystem, final = _files.filesystem(point.uri)
            _files.publish(filesystem, path, final)
        elif point.uri is not None:
            _files.upload(path, point.uri)
        else:
            point = dataclasses.replace(point, data=_read(path))
        if cancelled():
            return  # the call failed: the driver restarts from the point it holds
        outbox = get_outbox()
        sequence = outbox.put_latest(RESUME, point)
        waited = 0.0
        while not outbox.wait_delivered(RESUME, sequence, 1.0):
            waited += 1.0
            if cancelled():
                return
            if waited >= _DELIVERY_WAIT_S:
                log.warning(
                    "The driver did not take the resume checkpoint %s within %.0fs; it takes "
                    "it at its next poll",
                    point.describe(),
                    _DELIVERY_WAIT_S,
                )
                return
        if self._storage is not None:
            # only now: until the driver holds this one, it may restart from an older one
            _delete_older(self._storage, point, self._keep_last)


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


def _delete_older(storage: str, point: ResumePoint, keep_last: int) -> None:
    """Runs on rank 0, once the driver holds ``point``. Deletes the storage's resume checkpoints
    older than ``point`` but the newest ``keep_last - 1`` (newer ones, of an attempt that died,
    stay: they are whole checkpoints of the same run)."""
    try:
        stored = stored_points(storage)
    except Exception as err:  # noqa: BLE001 - a listing refused or failed: the checkpoint is safe
        log.warning("Could not list %s to delete older resume checkpoints: %s", storage, err)
        return
    older = [p for p in stored if (p.epoch, p.global_step) < (point.epoch, point.global_step)]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        try:
            filesystem, path = _files.filesystem(str(old.uri))
            filesystem.rm(path, recursive=True)  # a sharded checkpoint may be a folder
        except Exception as err:  # noqa: BLE001 - a stale checkpoint is no reason to stop training
            log.warning("Could not delete the old resume checkpoint %s: %s", old.uri, err)


def logger_versions(trainer: pl.Trainer) -> list[Any]:
    """Runs on rank 0. Its loggers' versions (resolved there: the folders it writes to)."""
    return [getattr(logger, "version", None) for logger in trainer.loggers]


def checkpoint_bytes(trainer: pl.Trainer, name: str) -> bytes | None:
    """Every rank: saves a checkpoint of the Trainer now, one whole file however the strategy
    shards; its bytes on rank 0, None on the others (see :func:`_stage`)."""
    staged = _stage(trainer, name)
    if staged is None:
        return None
    try:
        return _read(staged.path)
    finally:
        staged.discard()


class _Staged(NamedTuple):
    """Rank 0's saved checkpoint: its local path, and what removes it unless it was renamed
    into place."""

    path: str
    discard: Callable[[], None]


def _stage(trainer: pl.Trainer, name: str, into: str | None = None) -> _Staged | None:
    """Every rank: saves a checkpoint of the Trainer now, one whole file however the strategy
    shards (see ``OnWorkersBase.resume_checkpoints``): into ``into`` (a local storage folder that
    exists)
    under a temporary name of ours, which the send renames into place (no copy); else in a local
    temporary folder that no killed worker leaves behind (:mod:`ray_lightning_sgd._scratch`).
    Rank 0's file, None on the others; a save that fails leaves no part of it."""
    whole = trainer.strategy.resume_checkpoints()  # type: ignore[attr-defined]
    if into is not None:
        path = os.path.join(into, _files.temp_name(name))

        def discard() -> None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    else:
        _scratch.sweep()  # what killed workers of this node left
        # a folder of its own: Lightning's save replaces the file by name, out of a lock
        held = _scratch.create_folder()
        path = os.path.join(held, name)

        def discard() -> None:
            _scratch.release(held)

    try:
        with whole, _saved_in_place(trainer.strategy):
            trainer.save_checkpoint(path)
    except BaseException:
        discard()  # a full disk: no part of it stays
        raise
    if trainer.global_rank != 0:
        discard()
        return None
    return _Staged(path, discard)


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _is_lightnings(kind: type, name: str, module: str) -> bool:
    """Whether ``kind`` is Lightning's own class ``name`` of its ``module`` (named from the
    namespace's ``plugins`` on: either namespace's, not a subclass)."""
    return kind.__name__ == name and kind.__module__.endswith(module)


@contextlib.contextmanager
def _saved_in_place(strategy: Any) -> Iterator[None]:
    """Worker side: while a resume checkpoint is saved, the strategy's checkpoint writer has
    written it, whole, at the path it is given when ``save_checkpoint`` returns, and nowhere else.

    - Lightning's own writer saves atomically through an fsspec transaction, which on a local
      disk stages the whole file under the system's temporary folder (``tempfile.mkstemp()``)
      and moves it into place at the end: a process killed meanwhile (a preempted node, a lost
      worker) leaves a file of the checkpoint's size there that nothing removes. The path given
      here is already a temporary name of the checkpoint's own folder, renamed into place once
      complete and removed (or swept) when not, so here it writes that path straight.
    - Lightning's ``AsyncCheckpointIO`` (or a subclass of it) returns before the file exists
      and writes it in a thread: rank 0 would then rename, read or hand over a file not yet
      written. Here it saves through the writer it wraps, in the calling thread (its other
      checkpoints stay asynchronous).

    A checkpoint writer of the user's own, a storage URI or ``storage_options`` keep their own
    way (a writer of the user's own must have the file whole when its ``save_checkpoint``
    returns, as Lightning's ``CheckpointIO`` contract says for synchronous writers).
    """
    writer: Any = getattr(strategy, "checkpoint_io", None)
    inner: Any = writer
    if any(
        _is_lightnings(kind, "AsyncCheckpointIO", "plugins.io.async_plugin")
        for kind in type(writer).__mro__
    ):  # Lightning's, or a user's subclass of it: it writes in its thread all the same
        inner = writer.checkpoint_io
    kind: Any = type(inner)
    if not _is_lightnings(kind, "TorchCheckpointIO", "plugins.io.torch_io"):
        if inner is writer:
            yield
            return
        save_through: Any = inner.save_checkpoint  # the wrapped writer, in this thread
    else:

        def save_through(checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            if storage_options is not None or "://" in str(path):
                kind.save_checkpoint(inner, checkpoint, path, storage_options)
                return
            import io

            import torch

            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            # to memory first, as Lightning does: a full disk is then an OSError that says so,
            # where torch.save's own file writer raises a RuntimeError about stream positions
            data = io.BytesIO()
            torch.save(checkpoint, data)
            with open(path, "wb") as file:
                file.write(data.getbuffer())

    missing = object()
    previous = vars(writer).get("save_checkpoint", missing)  # one set on the instance: kept
    writer.save_checkpoint = save_through
    try:
        yield
    finally:
        if previous is missing:
            vars(writer).pop("save_checkpoint", None)
        else:
            writer.save_checkpoint = previous
