"""What crosses to the workers for each Ray Data dataset of a call: its split, and a rank's shard.

The driver splits every dataset of an attempt once, over the attempt's world size
(``Dataset.streaming_split``, :mod:`ray_lightning_sgd._driver.datasets`); every worker receives
every :class:`DatasetSplit` and puts its rank's :class:`DatasetShard` where the dataset was in
the payload. A :class:`~ray_lightning_sgd.data.RayDataLoader` on a worker reads its shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DatasetShard:
    """One rank's part of a dataset: the iterator of its split, and its number of rows when it
    is known (an equal split of a dataset whose row count Ray Data knows)."""

    iterator: Any
    rank: int
    world_size: int
    #: Rows this rank reads in each pass (epoch), or None when unknown.
    rows: int | None
    #: Whether every rank reads as many rows.
    equal: bool = True

    def __repr__(self) -> str:
        rows = "rows unknown" if self.rows is None else f"{self.rows} rows"
        return f"DatasetShard(rank {self.rank} of {self.world_size}, {rows})"


@dataclass(frozen=True)
class DatasetSplit:
    """A dataset split over an attempt's ranks: one iterator a rank, as the driver made them."""

    #: ``Dataset.streaming_split``'s iterators, in rank order.
    iterators: tuple[Any, ...]
    #: The dataset's rows, when Ray Data knew them without running it.
    rows: int | None
    #: Whether every rank reads as many rows (the rest, fewer than the world size, is dropped).
    equal: bool

    def shard(self, rank: int) -> DatasetShard:
        """Runs on each worker: rank ``rank``'s part."""
        size = len(self.iterators)
        rows = None if self.rows is None or not self.equal else self.rows // size
        return DatasetShard(self.iterators[rank], rank, size, rows, self.equal)
