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
import time
import uuid
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_lightning_sgd._worker.resume import ResumePoint
from ray_lightning_sgd._worker_group.config import NAME_PREFIX
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata
from ray_lightning_sgd.exceptions import WorkerTimeoutError

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)


_MONITOR_CALL_S = 10.0


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
