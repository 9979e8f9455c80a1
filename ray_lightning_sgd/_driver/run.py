"""Driver side: one call's changing state, in one home.

A :class:`Run` lives as long as one launch (one call of a Trainer entry point, all its attempts).
It holds the latest resume point (from a named run's storage at the start, then from rank 0's
deliveries), the runs rank 0's loggers write to and the steps they logged, which world size
trained which epoch, the ranks of the running attempt that
received SIGTERM, and whether a lost worker counts as a preemption. The inbox delivers into it;
the controller's scaling policy and the launcher read it; the strategy reads its world sizes.
"""

from __future__ import annotations

import logging
from typing import Any

from ray_lightning_sgd._boundary.resume_points import ResumePoint
from ray_lightning_sgd._driver.stragglers import RankTimings
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata
from ray_lightning_sgd.exceptions import WorkerDiedError

log = logging.getLogger(__name__)


class Run:
    """Driver side: the state of one launch across its attempts.

    Args:
        resume: Where the first attempt resumes from (a named run's latest stored point), or
            None: from the start.
    """

    def __init__(self, resume: ResumePoint | None = None) -> None:
        #: The latest resume point: where the next attempt resumes from.
        self.resume = resume
        #: The ranks of the running attempt that received SIGTERM (a preemption notice).
        self.sigterm_ranks: set[int] = set()
        #: After a ``fit``: how many workers trained each epoch (empty before its end).
        self.world_sizes: dict[int, int] = {}
        # (the first epoch an attempt trains, its size), in the order the attempts started
        self._attempts: list[tuple[int, int]] = []
        #: The running attempt's workers, by rank (empty: none started yet).
        self.metadata: list[WorkerMetadata] = []
        #: The call's Ray Data datasets, in the order the payload set them aside.
        self.datasets: tuple[Any, ...] = ()
        #: After a call: each rank's training step times in its last attempt (empty without
        #: training steps).
        self.rank_timings: list[RankTimings] = []
        #: Each of rank 0's loggers' ``version`` (the run it writes to), once rank 0 made them.
        self.logger_versions: tuple[Any, ...] = ()
        #: By logger index, the last step each metric was logged at, in any attempt so far.
        self.logged_steps: dict[int, dict[str, int]] = {}

    def attempt_started(self, metadata: list[WorkerMetadata]) -> None:
        """An attempt starts on these workers, from :attr:`resume`."""
        resume, size = self.resume, len(metadata)
        self.metadata, self.sigterm_ranks = metadata, set()
        # a point inside an epoch (a preemption's): that epoch ends on the new size
        first = 0 if resume is None else resume.epoch + (resume.batches is None)
        if self._attempts:
            log.info("Epochs from %d train on %d workers", first, size)
        self._attempts.append((first, size))

    def resume_point_arrived(self, point: ResumePoint) -> None:
        """Rank 0 delivered a new resume point (the driver's memory holds it now)."""
        self.resume = point

    def loggers_reported(
        self, versions: tuple[Any, ...], logged: dict[int, dict[str, int]]
    ) -> None:
        """Rank 0 named its loggers' runs and the steps they logged so far."""
        self.logger_versions = versions
        self.logged_steps = logged

    def sigterm_received(self, rank: int) -> None:
        """A worker of the running attempt received SIGTERM."""
        self.sigterm_ranks.add(rank)

    @property
    def size(self) -> int:
        """How many workers the running attempt has (0: none started yet)."""
        return len(self.metadata)

    @property
    def doomed(self) -> bool:
        """Whether a worker of the running attempt is about to end (received SIGTERM): its
        group is not one to keep warm."""
        return bool(self.sigterm_ranks)

    def lost(self, err: WorkerDiedError) -> WorkerDiedError:
        """A worker of the running attempt was lost: ``err`` completed with its node and whether
        it counts as a preemption (a worker warned of its end by SIGTERM: a spot node, a
        drain)."""
        if not err.node_id and 0 <= err.rank < len(self.metadata):
            # raised by a rank on behalf of another (a preemption notice it learned of)
            err.node_id = self.metadata[err.rank].node_id
        if err.rank in self.sigterm_ranks and not err.preempted:
            err.preempted = True
            err.add_note(f"Rank {err.rank} received SIGTERM before: counted as a preemption")
        return err

    def fit_ended(self, epochs: int) -> None:
        """The ``fit`` ended after ``epochs`` epochs: :attr:`world_sizes` gives the size that
        trained each (a later attempt retrains what a lost one trained after its last
        checkpoint)."""
        sizes: dict[int, int] = {}
        for first, size in self._attempts:
            for epoch in range(first, epochs):
                sizes[epoch] = size
        self.world_sizes = sizes


def describe_sizes(sizes: dict[int, int]) -> str:
    """``{0: 2, 1: 2, 2: 1}`` as ``"epochs 0-1: 2 workers; epoch 2: 1 worker"``."""
    runs: list[tuple[int, int, int]] = []  # (first epoch, last epoch, size)
    for epoch, size in sorted(sizes.items()):
        if runs and runs[-1][2] == size and runs[-1][1] == epoch - 1:
            runs[-1] = (runs[-1][0], epoch, size)
        else:
            runs.append((epoch, epoch, size))
    return "; ".join(
        (f"epoch {first}" if first == last else f"epochs {first}-{last}")
        + f": {size} worker{'s' if size != 1 else ''}"
        for first, last, size in runs
    )


__all__ = ["Run", "describe_sizes"]
