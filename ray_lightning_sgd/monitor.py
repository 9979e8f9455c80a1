"""The run monitor: where the workers of one launch report progress and resume checkpoints.

Driver side: :class:`RunMonitor` starts one small actor (no CPU) on the driver's node for a launch
that asks for a progress timeout or for restarts. The workers report to it, at most once a second,
which stage and step they are at (:class:`ProgressReporterBase`), and rank 0 hands it the resume
checkpoint at each interval (:class:`ResumeCheckpointBase`): the checkpoint's bytes, or the URI it
was written to. Because the actor lives on the driver's node, both survive the loss of any worker or
of any other node. While it waits for the workers, the driver asks the monitor whether a rank has
gone quiet for longer than the timeout (:meth:`RunMonitor.check`).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_lightning_sgd.exceptions import ConfigurationError, WorkerTimeoutError
from ray_lightning_sgd.worker_group import NAME_PREFIX, get_worker_context

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ray_lightning_sgd.ranks import WorkerMetadata

#: How often a worker reports its progress, at most (seconds).
REPORT_INTERVAL_S = 1.0
_MONITOR_CALL_S = 10.0


@dataclass(frozen=True)
class FailureConfig:
    """What the strategy does about lost and stalled workers.

    Args:
        max_failures: How often to restart the whole group after a worker died (0: never, -1: no
            limit). ``fit`` resumes from the run's latest resume checkpoint.
        progress_timeout_s: Raise ``WorkerTimeoutError`` when a rank reports no progress (a batch,
            a stage) for this long; None: never.
        checkpoint_every_n_epochs: How often the resume checkpoint is written when restarts are on.
        checkpoint_storage: Where rank 0 writes it: a local path or an fsspec URI that the
            workers can write and read; None: its bytes go to the driver's node.
    """

    max_failures: int = 0
    progress_timeout_s: float | None = None
    checkpoint_every_n_epochs: int = 1
    checkpoint_storage: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_failures) or self.max_failures < -1:
            raise ConfigurationError(
                f"max_failures must be an int >= 0, or -1 for no limit, got {self.max_failures!r}"
            )
        timeout = self.progress_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ConfigurationError(
                f"progress_timeout_s must be a number of seconds > 0, or None, got {timeout!r}"
            )
        if not _is_int(self.checkpoint_every_n_epochs) or self.checkpoint_every_n_epochs < 1:
            raise ConfigurationError(
                "checkpoint_every_n_epochs must be an int >= 1, got "
                f"{self.checkpoint_every_n_epochs!r}"
            )
        if self.checkpoint_storage is not None and (
            not isinstance(self.checkpoint_storage, str) or not self.checkpoint_storage
        ):
            raise ConfigurationError(
                "checkpoint_storage must be a path or fsspec URI (a non-empty str), or None, got "
                f"{self.checkpoint_storage!r}"
            )

    @property
    def monitored(self) -> bool:
        """Whether a launch needs a monitor (restarts or a progress timeout)."""
        return self.max_failures != 0 or self.progress_timeout_s is not None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ResumePoint:
    """The latest resume checkpoint of a run: its bytes, or the URI it was written to."""

    epoch: int
    global_step: int
    data: bytes | None = None
    uri: str | None = None


class _Monitor:
    """Runs in its own actor on the driver's node. Holds the run's progress and checkpoint."""

    def __init__(self) -> None:
        self._progress: dict[int, tuple[float, str, int]] = {}
        self._resume: ResumePoint | None = None
        self._events: list[bytes] = []
        self._output: list[tuple[int, list[tuple[str, str]]]] = []

    def reset(self) -> None:
        """A new launch (a monitor kept between calls is reused)."""
        self.__init__()  # type: ignore[misc]

    def restart_clock(self, world_size: int) -> None:
        now = time.monotonic()
        self._progress = {rank: (now, "start", 0) for rank in range(world_size)}

    def report(self, rank: int, stage: str, step: int) -> None:
        self._progress[rank] = (time.monotonic(), stage, step)

    def quiet(self, timeout_s: float) -> list[tuple[int, float, str, int]]:
        """The ranks that have not reported for ``timeout_s``: rank, seconds, stage, step."""
        now = time.monotonic()
        return sorted(
            (rank, now - last, stage, step)
            for rank, (last, stage, step) in self._progress.items()
            if now - last > timeout_s
        )

    def add_events(self, events: bytes) -> None:
        """Rank 0's callback events, pickled, for the driver (see
        :mod:`ray_lightning_sgd.driver_view`). Kept as bytes: unpickling metrics here would import
        torch into this small actor."""
        self._events.append(events)

    def add_output(self, rank: int, lines: list[tuple[str, str]]) -> None:
        """A worker's output lines (stream, text), for the driver to print."""
        self._output.append((rank, lines))

    def take(self) -> tuple[list[bytes], list[tuple[int, list[tuple[str, str]]]]]:
        """The events and output lines that arrived since the last call."""
        events, self._events = self._events, []
        output, self._output = self._output, []
        return events, output

    def set_resume(self, point: ResumePoint) -> None:
        self._resume = point

    def resume(self) -> ResumePoint | None:
        return self._resume


class RunMonitor:
    """Driver side: the monitor actor of one launch.

    Args:
        progress_timeout_s: Raise when a rank reports no progress for this long (None: never).
    """

    def __init__(self, progress_timeout_s: float | None) -> None:
        self.progress_timeout_s = progress_timeout_s
        self.name = f"{NAME_PREFIX}-monitor-{uuid.uuid4().hex[:12]}"
        self._actor: Any = None

    @property
    def started(self) -> bool:
        """Whether the actor exists (it is made on first use)."""
        return self._actor is not None

    @property
    def actor(self) -> Any:
        """The monitor's actor, made on first use: the launcher first uses it once the workers
        have started, so that its process does not compete with theirs for the node's start-up
        slots and CPUs."""
        if self._actor is None:
            here = ray.get_runtime_context().get_node_id()
            self._actor = (
                ray.remote(_Monitor)
                .options(
                    name=self.name,
                    num_cpus=0,
                    max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
                )
                .remote()
            )
        return self._actor

    def __reduce__(self) -> Any:
        raise TypeError("a RunMonitor stays on the driver; send its actor handle instead")

    def reset(self, progress_timeout_s: float | None) -> None:
        """Driver side: readies a kept monitor for a new launch."""
        self.progress_timeout_s = progress_timeout_s
        ray.get(self.actor.reset.remote(), timeout=_MONITOR_CALL_S)

    def start_attempt(self, world_size: int) -> None:
        """Driver side: starts every rank's progress clock, as a call begins. Without a progress
        timeout there is no clock, and the call does not wait for a new monitor's actor to be up
        (the workers' reports queue until it is)."""
        if self.progress_timeout_s is None:
            return
        ray.get(self.actor.restart_clock.remote(world_size), timeout=_MONITOR_CALL_S)

    def check(self, metadata: list[WorkerMetadata]) -> None:
        """Driver side: raises :class:`WorkerTimeoutError` if a rank has gone quiet too long."""
        if self.progress_timeout_s is None:
            return
        quiet = ray.get(self.actor.quiet.remote(self.progress_timeout_s), timeout=_MONITOR_CALL_S)
        if not quiet:
            return
        ranks = "; ".join(
            f"rank {rank} ({_where(metadata, rank)}) silent for {seconds:.0f}s, last at {stage} "
            f"step {step}"
            for rank, seconds, stage, step in quiet
        )
        raise WorkerTimeoutError(
            f"workers made no progress within progress_timeout_s={self.progress_timeout_s}: "
            f"{ranks}. A deadlock, an endless loop, or a step, validation or checkpoint longer "
            "than the timeout; raise progress_timeout_s if the work is just slow"
        )

    def resume(self) -> ResumePoint | None:
        """Driver side: the latest resume checkpoint that rank 0 handed over, if any."""
        return ray.get(self.actor.resume.remote(), timeout=60)

    def shutdown(self) -> None:
        """Driver side: kills the actor and waits (briefly) until Ray has it dead."""
        if self._actor is None:
            return
        ray.kill(self.actor, no_restart=True)
        deadline = time.monotonic() + _MONITOR_CALL_S
        while time.monotonic() < deadline:
            try:
                ray.get(self.actor.take.remote(), timeout=1)
            except ray.exceptions.RayActorError:
                return
            except ray.exceptions.GetTimeoutError:
                continue


def _where(metadata: list[WorkerMetadata], rank: int) -> str:
    if rank >= len(metadata):
        return "not started"
    meta = metadata[rank]
    return f"node {meta.node_id[:12]}, {meta.node_ip}, pid {meta.pid}"


class ProgressReporterBase:
    """Runs on each worker. A callback that tells the monitor where this rank is, once a second."""

    def __init__(self, monitor: Any) -> None:
        super().__init__()
        self._monitor = monitor
        self._rank = get_worker_context().rank.global_rank
        self._last = 0.0

    def _report(self, stage: str, step: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= REPORT_INTERVAL_S:
            self._last = now
            self._monitor.report.remote(self._rank, stage, step)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._report(f"setup ({stage})", 0, force=True)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._report("training", trainer.global_step)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._report("validation", batch_idx)

    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._report("test", batch_idx)

    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._report("predict", batch_idx)


class ResumeCheckpointBase:
    """Runs on each worker. A callback that saves the run's resume checkpoint every N epochs.

    Every rank takes part in ``Trainer.save_checkpoint`` (it synchronises); rank 0 writes it, to
    ``storage`` when one is given (a local path or an fsspec URI), else to a local temporary file
    whose bytes it hands to the monitor.
    """

    def __init__(self, monitor: Any, every_n_epochs: int, storage: str | None) -> None:
        super().__init__()
        self._monitor = monitor
        self._every = every_n_epochs
        self._storage = storage

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the run is over: its resume checkpoint (in its own folder of the storage) is not needed
        if self._storage is not None and trainer.global_rank == 0:
            import fsspec  # on the worker only: the run monitor's actor imports this module too

            try:
                filesystem, path = fsspec.core.url_to_fs(self._storage)
                if filesystem.exists(path):
                    filesystem.rm(path, recursive=True)
            except Exception as err:  # noqa: BLE001 - the fit succeeded; a stale file is no error
                log.warning("Could not remove the resume checkpoint in %s: %s", self._storage, err)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (trainer.current_epoch + 1) % self._every:
            return
        if self._storage is not None:
            uri = self._storage.rstrip("/") + "/resume.ckpt"
            trainer.save_checkpoint(uri)
            point = ResumePoint(trainer.current_epoch, trainer.global_step, uri=uri)
        else:
            fd, path = tempfile.mkstemp(prefix="ray_lightning_sgd-resume-", suffix=".ckpt")
            os.close(fd)
            try:
                trainer.save_checkpoint(path)
                data = _read(path) if trainer.global_rank == 0 else None
            finally:
                os.unlink(path)
            point = ResumePoint(trainer.current_epoch, trainer.global_step, data=data)
        if trainer.global_rank == 0:
            # waited for: the checkpoint must be safe on the driver's node before training goes on
            ray.get(self._monitor.set_resume.remote(point), timeout=600)


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def materialise(point: ResumePoint) -> str:
    """Runs on each worker. Returns a path Lightning can resume from (a local copy of the bytes)."""
    if point.uri is not None:
        return point.uri
    if point.data is None:
        raise ValueError("a resume point holds either a uri or the checkpoint's bytes")
    fd, path = tempfile.mkstemp(prefix="ray_lightning_sgd-resume-", suffix=".ckpt")
    with os.fdopen(fd, "wb") as file:
        file.write(point.data)
    return path
