"""Driver side: each rank's step times, from its polls, and the rank that the others wait for.

Every rank reports the medians of its latest training steps (:data:`~ray_lightning_sgd.
_boundary.channels.TIMINGS`): the time it waited for its batch, and its step's own work until
the backward (the backward's all-reduce makes every rank's whole step as long as the slowest's).
When one rank's time is :data:`SLOWER` times the median of the others' and at least
:data:`SLOWER_BY_S` more, once every rank has timed :data:`~ray_lightning_sgd._boundary.channels.
TIMED_STEPS` steps, :class:`StragglerWatch` says so once, naming the rank, its node, and whether
its extra time goes to data loading or to the step. Pure logic: the tests feed it numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ray_lightning_sgd._boundary.channels import TIMED_STEPS

#: A rank this many times slower than the others' median is a straggler...
SLOWER = 1.5
#: ... when that is at least this much longer, in seconds (a few ms on a tiny step are noise).
SLOWER_BY_S = 0.005


@dataclass(frozen=True)
class RankTimings:
    """One rank's training steps, as its latest report gave them."""

    rank: int
    #: The rank and where it runs.
    where: str
    #: Training steps it timed (the first batch of each epoch is not).
    steps: int
    #: The median, over its latest steps, of the time it waited for a batch.
    data_s: float
    #: The median of its step's own work, until the backward.
    step_s: float

    def __str__(self) -> str:
        return (
            f"{self.where}: {self.steps} steps, {1e3 * self.step_s:.1f} ms a step's own work, "
            f"{1e3 * self.data_s:.1f} ms waiting for data (medians of its latest {TIMED_STEPS})"
        )


class StragglerWatch:
    """Driver side: the ranks' latest timings, and the straggler among them (said once)."""

    def __init__(self) -> None:
        self.timings: dict[int, RankTimings] = {}
        self.warned = False
        self._changed = False  # a rank reported since the last look

    def update(self, rank: int, where: str, steps: int, data_s: float, step_s: float) -> None:
        self.timings[rank] = RankTimings(rank, where, steps, data_s, step_s)
        self._changed = True

    def straggler(self) -> str | None:
        """What to warn of, the first time one rank is slower than the others; else None.

        Asked at every poll: it looks again only after a rank reported, and only at the slowest
        rank (if any rank is that much slower than the others, the slowest is), so its work
        grows with the ranks, not with their square."""
        ranks = self.timings
        if self.warned or not self._changed:
            return None
        self._changed = False
        if len(ranks) < 2 or any(t.steps < TIMED_STEPS for t in ranks.values()):
            return None
        mine = max(ranks.values(), key=lambda t: (t.data_s + t.step_s, -t.rank))
        others = [t for t in ranks.values() if t.rank != mine.rank]
        data = statistics.median(t.data_s for t in others)
        step = statistics.median(t.step_s for t in others)
        own, typical = mine.data_s + mine.step_s, data + step
        if own <= SLOWER * typical or own - typical < SLOWER_BY_S:
            return None
        self.warned = True
        cause = (
            "data loading (its DataLoader, its node's disk or CPU)"
            if mine.data_s - data >= mine.step_s - step
            else "the step itself (its forward and training_step: its node's device or "
            "CPU, or code that runs on this rank only)"
        )
        return (
            f"{mine.where} is slower than the other ranks, and each step waits for it: "
            f"{1e3 * own:.1f} ms against their {1e3 * typical:.1f} ms (median) of their "
            f"own work a step; its extra time goes to {cause}: "
            f"{1e3 * mine.data_s:.1f} ms waiting for data (others {1e3 * data:.1f}), "
            f"{1e3 * mine.step_s:.1f} ms in the step (others {1e3 * step:.1f})"
        )

    def summary(self) -> list[RankTimings]:
        """Every rank's latest timings, by rank."""
        return [self.timings[rank] for rank in sorted(self.timings)]
