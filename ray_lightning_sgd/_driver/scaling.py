"""Driver side: when an elastic run grows, as a scaling policy the run controller asks.

An elastic worker group (``num_workers=(min, max)``) takes as many workers as the cluster places
when it starts (see :meth:`~ray_lightning_sgd._worker_group.group.WorkerGroup.start`); a lost
worker restarts the run, which then takes as many as it can again. Growing needs a new attempt
too: a process group's size is fixed. While an attempt with fewer than ``max`` workers runs, the
controller (:class:`~ray_lightning_sgd._executor.controller.RunController`) asks
:class:`GrowthPolicy` about every second; the policy probes the cluster at most every
``resize_interval_s`` for room for one more worker, and once there is room, decides on a
:class:`~ray_lightning_sgd._executor.controller.Resize` at the next resume checkpoint the driver
holds (an epoch boundary); the next attempt resumes there with more workers.

The policy asks a :class:`RoomProbe` (a placement group, :class:`PlacementGroupProbe`) and a
clock; the tests give it fakes of both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ray.util.placement_group import (
    get_current_placement_group,
    placement_group_table,
    remove_placement_group,
)

from ray_lightning_sgd._boundary.resume_points import ResumePoint
from ray_lightning_sgd._executor.controller import Resize
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd._worker_group.placement import start_growth_probe

log = logging.getLogger(__name__)

#: How long a probe may wait for the cluster to place it before it counts as "no room".
_PROBE_WAIT_S = 5.0
#: The longest time between two probes, however often regroups found no room.
_LONGEST_INTERVAL_S = 3600.0


class RoomProbe(Protocol):
    """Asks the cluster, without waiting, whether it has room for more workers; driver side."""

    def can_grow(self) -> bool:
        """Whether the group may grow at all (not inside a fixed reservation)."""

    def start(self, size: int) -> Any:
        """Reserves what the group would add to its ``size`` workers; returns the reservation
        (None: no room, without asking the cluster to place anything)."""

    def placed(self, reservation: Any) -> bool:
        """Whether the cluster has placed the reservation (there is room)."""

    def remove(self, reservation: Any) -> None:
        """Frees the reservation."""


class PlacementGroupProbe:
    """A :class:`RoomProbe` that reserves a placement group of the workers a group would add.

    ``config``: the running attempt's group settings (what it keeps free depends on the call).
    """

    def __init__(self, config: Callable[[], WorkerGroupConfig]) -> None:
        self._config = config
        self._fixed: bool | None = None

    def can_grow(self) -> bool:
        # inside a Ray Tune trial's reservation (fixed), no group grows; asked once, while the
        # workers run (of a connected driver: the question starts a local Ray instance otherwise)
        if self._fixed is None:
            self._fixed = get_current_placement_group() is not None
        return not self._fixed

    def start(self, size: int) -> Any:
        return start_growth_probe(self._config(), size)

    def placed(self, reservation: Any) -> bool:
        # its state, not a task in it (placed at once, where a task would wait for a worker
        # process to start on the new node)
        return bool(placement_group_table(reservation).get("state") == "CREATED")

    def remove(self, reservation: Any) -> None:
        remove_placement_group(reservation)


class GrowthPolicy:
    """Driver side: a scaling policy that ends an elastic attempt at an epoch boundary once the
    cluster has room for more workers.

    Args:
        most: The most workers the group may have.
        interval_s: The least time between two probes of the cluster.
        max_epochs: The Trainer's ``max_epochs`` (None or -1: unknown); no run grows after its
            last epoch's checkpoint.
        latest: The run's latest resume point (the driver holds it).
        probe: How the cluster is asked for room.
        clock: Where the time comes from.
    """

    def __init__(
        self,
        most: int,
        interval_s: float,
        max_epochs: int | None,
        latest: Callable[[], ResumePoint | None],
        probe: RoomProbe,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._most = most
        self._interval_s = interval_s
        self._max_epochs = max_epochs if max_epochs is not None and max_epochs >= 0 else None
        self._latest = latest
        self._probe = probe
        self._clock = clock
        self._size = most
        self._next_probe = 0.0
        self._reservation: Any = None
        self._reserved_at = 0.0
        #: The resume point the driver held when room appeared; a later one ends the attempt.
        self._room_at: ResumePoint | None = None
        self._room = False
        #: The size before the last resize, while the next attempt has not started.
        self._resized_from: int | None = None

    def attempt_started(self, size: int) -> None:
        """An attempt starts with ``size`` workers; the first probe waits one interval (twice
        as long after a resize that did not grow: the room was gone, or too small)."""
        self.close()
        if self._resized_from is not None and size <= self._resized_from:
            self._interval_s = min(self._interval_s * 2, _LONGEST_INTERVAL_S)
            log.info(
                "The regroup found no room for more than %d workers; the next look in %.0f s",
                size, self._interval_s,
            )  # fmt: skip
        self._resized_from = None
        self._size = size
        self._room = False
        self._next_probe = self._clock() + self._interval_s

    def decide(self) -> Resize | None:
        """Driver side, while the workers run: probes the cluster when due; a :class:`Resize`
        once there is room and the run's latest resume point is a checkpoint at an epoch's end
        newer than the moment room appeared."""
        if self._size >= self._most or not self._probe.can_grow():
            return None
        resume = self._latest()
        if not self._room:
            self._room = self._probed()
            self._room_at = resume
            return None
        if resume is None or resume is self._room_at or resume.batches is not None:
            return None  # a resize waits for an epoch's end (not a preemption's or a timed point)
        if self._max_epochs is not None and resume.epoch + 1 >= self._max_epochs:
            return None  # the run has no epoch left to train
        self._resized_from = self._size
        return Resize(
            f"the cluster has room for more than {self._size} workers; the run regroups "
            f"{resume.describe()}"
        )

    def close(self) -> None:
        """Driver side: frees the probe's reservation, if one is pending."""
        if self._reservation is not None:
            self._probe.remove(self._reservation)
            self._reservation = None

    def _probed(self) -> bool:
        """Whether a probe found room; starts one when due, reads a pending one's answer."""
        now = self._clock()
        if self._reservation is None:
            if now < self._next_probe:
                return False
            self._next_probe = now + self._interval_s
            try:
                self._reservation = self._probe.start(self._size)
            except Exception:  # the cluster did not answer: no room this time
                log.debug("Could not start a growth probe", exc_info=True)
                return False
            if self._reservation is None:  # a larger size would take what the call keeps free
                return False
            self._reserved_at = now
        try:
            ready = self._probe.placed(self._reservation)
        except Exception:  # a probe that cannot be read found no room
            log.debug("Could not read the growth probe's state", exc_info=True)
            ready = False
        if ready or now - self._reserved_at > _PROBE_WAIT_S:
            self.close()
            if ready:
                log.info("The cluster has room for more than %d workers", self._size)
            return ready
        return False


__all__ = ["GrowthPolicy", "PlacementGroupProbe", "RoomProbe"]
