"""Driver side: an elastic run's size, epoch by epoch, and when it grows.

An elastic worker group (``num_workers=(min, max)``) takes as many workers as the cluster places
when it starts (see :meth:`~ray_lightning_sgd._worker_group.group.WorkerGroup.start`); a lost
worker restarts the run, which then takes as many as it can again. Growing needs a restart too: a
process group's size is fixed. While an attempt with fewer than ``max`` workers runs,
:class:`GrowthWatch` asks the cluster at most every ``resize_interval_s`` whether one more worker
would fit; once one would, the attempt ends at the next resume checkpoint that the driver holds
(an epoch boundary) by raising :class:`~ray_lightning_sgd._executor.controller.Regroup`, and the
next attempt resumes from that checkpoint with more workers.

:class:`WorldSizes` keeps which size trained which epoch, for the driver's log and
``strategy.world_sizes``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group_table,
    remove_placement_group,
)

from ray_lightning_sgd._boundary.resume_points import ResumePoint
from ray_lightning_sgd._executor.controller import Regroup
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd._worker_group.group import start_growth_probe

log = logging.getLogger(__name__)

#: How long a probe may wait for the cluster to place it before it counts as "no room".
_PROBE_WAIT_S = 5.0


class GrowthWatch:
    """Driver side: ends an elastic attempt at an epoch boundary once the cluster has room for
    more workers.

    Args:
        config: The elastic group's settings: the most workers, what each reserves, how they are
            placed.
        interval_s: The least time between two probes of the cluster.
        max_epochs: The Trainer's ``max_epochs`` (None or -1: unknown); no run regroups after its
            last epoch's checkpoint.
        clock: Where the time comes from (tests pass their own).
    """

    def __init__(
        self,
        config: WorkerGroupConfig,
        interval_s: float,
        max_epochs: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._interval_s = interval_s
        self._max_epochs = max_epochs if max_epochs is not None and max_epochs >= 0 else None
        self._clock = clock
        self._size = config.num_workers
        self._next_probe = 0.0
        self._probe: PlacementGroup | None = None
        self._probe_since = 0.0
        #: The resume point the driver held when room appeared; a later one ends the attempt.
        self._room_at: ResumePoint | None = None
        self._room = False
        #: The size before the last regroup, while the next attempt has not started.
        self._regrouped_from: int | None = None
        #: Inside a Ray Tune trial's reservation (fixed), no run grows.
        self._reservation_is_fixed = get_current_placement_group() is not None

    def attach(self, size: int) -> None:
        """An attempt starts with ``size`` workers; the first probe waits one interval (twice
        as long after a regroup that did not grow: the room was gone, or too small)."""
        self.close()
        if self._regrouped_from is not None and size <= self._regrouped_from:
            self._interval_s = min(self._interval_s * 2, 3600.0)
            log.info(
                "The regroup found no room for more than %d workers; the next look in %.0f s",
                size, self._interval_s,
            )  # fmt: skip
        self._regrouped_from = None
        self._size = size
        self._room = False
        self._next_probe = self._clock() + self._interval_s

    def check(self, resume: ResumePoint | None) -> None:
        """Driver side, while the workers run: probes the cluster when due; raises
        :class:`Regroup` when there is room and ``resume`` is a checkpoint newer than the
        moment room appeared."""
        if self._size >= self._config.num_workers or self._reservation_is_fixed:
            return
        if not self._room:
            self._room = self._probed()
            self._room_at = resume
            return
        if resume is None or resume is self._room_at or resume.batches is not None:
            return  # a regroup waits for an epoch's end (an in-epoch point is a preemption's)
        if self._max_epochs is not None and resume.epoch + 1 >= self._max_epochs:
            return  # the run has no epoch left to train
        self._regrouped_from = self._size
        raise Regroup(
            f"the cluster has room for more than {self._size} workers; the run regroups "
            f"{resume.describe()}"
        )

    def close(self) -> None:
        """Driver side: frees the probe's reservation, if one is pending."""
        if self._probe is not None:
            remove_placement_group(self._probe)
            self._probe = None

    def _probed(self) -> bool:
        """Whether a probe found room; starts one when due, reads a pending one's answer."""
        now = self._clock()
        if self._probe is None:
            if now < self._next_probe:
                return False
            self._next_probe = now + self._interval_s
            try:
                self._probe = self._start_probe()
            except Exception:  # the cluster did not answer: no room this time
                log.debug("Could not start a growth probe", exc_info=True)
                return False
            self._probe_since = now
        # its state, not a task in it (placed at once, where a task would wait for a worker
        # process to start on the new node)
        try:
            ready = placement_group_table(self._probe).get("state") == "CREATED"
        except Exception:  # a probe that cannot be read found no room
            log.debug("Could not read the growth probe's state", exc_info=True)
            ready = False
        if ready or now - self._probe_since > _PROBE_WAIT_S:
            self.close()
            if ready:
                log.info("The cluster has room for more than %d workers", self._size)
            return bool(ready)
        return False

    def _start_probe(self) -> PlacementGroup:
        return start_growth_probe(self._config, self._size)


class WorldSizes:
    """Driver side: which world size trained each epoch of a ``fit``."""

    def __init__(self) -> None:
        # (the first epoch an attempt trains, its size), in the order the attempts started
        self._attempts: list[tuple[int, int]] = []

    def attempt(self, resume: ResumePoint | None, size: int) -> None:
        """An attempt with ``size`` workers starts from ``resume`` (None: from the first epoch)."""
        # a point inside an epoch (a preemption's): that epoch ends on the new size
        first = 0 if resume is None else resume.epoch + (resume.batches is None)
        if self._attempts:
            log.info("Epochs from %d train on %d workers", first, size)
        self._attempts.append((first, size))

    def by_epoch(self, epochs: int) -> dict[int, int]:
        """The size that trained each of the first ``epochs`` epochs (a later attempt retrains
        what a lost one trained after its last checkpoint)."""
        sizes: dict[int, int] = {}
        for first, size in self._attempts:
            for epoch in range(first, epochs):
                sizes[epoch] = size
        return sizes


def describe(sizes: dict[int, int]) -> str:
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
