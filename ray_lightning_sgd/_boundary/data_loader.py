"""A Ray Data dataset where Lightning takes a DataLoader: :class:`RayDataLoader`, and the hooks of
a DataModule that returns them (:class:`RayDataModuleBase`).

On the driver a loader holds the user's ``ray.data.Dataset``. When a Trainer call goes to the
workers, the launcher sets every dataset aside from what it pickles, splits it over the attempt's
ranks (:mod:`ray_lightning_sgd._driver.datasets`) and each worker's loader holds its rank's
:class:`~ray_lightning_sgd._boundary.datasets.DatasetShard` instead: rank r reads iterator r of
one ``Dataset.streaming_split``. The rows go from Ray Data's tasks to the workers; none pass
through the driver.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ray_lightning_sgd._boundary.datasets import DatasetShard
from ray_lightning_sgd._worker_group.config import flag
from ray_lightning_sgd.exceptions import ConfigurationError

#: What to install for Ray Data, named in the error raised without it.
DATA_EXTRA = 'pip install "ray_lightning_sgd[data]"'


def ray_data() -> Any:
    """``ray.data``, or an ImportError that names the extra which installs it."""
    try:
        import ray.data
    except ImportError as err:
        raise ImportError(
            f"Ray Data is not installed ({err}); RayDataLoader and RayDataModule need it: "
            f"{DATA_EXTRA} (or pip install 'ray[data]')"
        ) from err
    return ray.data


class RayDataLoader:
    """A Ray Data ``Dataset`` where Lightning takes a DataLoader: each rank streams its own share.

    .. code-block:: python

        train = ray.data.read_parquet("s3://bucket/train").map_batches(preprocess)
        trainer.fit(model, train_dataloaders=RayDataLoader(train, batch_size=64))

    For each call of the Trainer (and each attempt of it: a restart, an elastic resize), the
    driver splits the dataset once over the workers (``Dataset.streaming_split(world_size,
    equal=True)``, with the workers' nodes as locality hints); rank r reads split r with
    ``iter_torch_batches``, whose options pass through. Every rank reads as many rows, so every
    rank takes as many steps; the equal split drops fewer rows than the world size per pass.
    ``predict`` splits without dropping rows: ranks may then read different numbers.

    Each iteration (an epoch, a validation run) is a new pass over the dataset. A seeded local
    shuffle uses ``local_shuffle_seed + n`` for the n-th pass of the call; a train loader's
    pass is its epoch's, also in a resumed fit and for a loader made anew for an epoch
    (``reload_dataloaders_every_n_epochs``).

    Args:
        dataset: A ``ray.data.Dataset``.
        batch_size: Rows per batch, on each rank.
        collate_fn, dtypes, drop_last, local_shuffle_buffer_size, local_shuffle_seed,
            prefetch_batches: As ``Dataset.iter_torch_batches`` takes them.
        num_rows: The dataset's number of rows, when Ray Data cannot know it without running
            the dataset (a ``map_batches`` may change it): the loader's length is then known,
            so Lightning shows a progress total and ``trainer.estimated_stepping_batches``
            works. None: the row count Ray Data knows from metadata, if any; without one the
            loader has no length (set ``max_steps`` or ``limit_train_batches`` where a schedule
            needs the number of steps).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 256,
        *,
        collate_fn: Callable[[Any], Any] | None = None,
        dtypes: torch.dtype | Mapping[str, torch.dtype] | None = None,
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
        prefetch_batches: int = 1,
        num_rows: int | None = None,
    ) -> None:
        if not isinstance(dataset, DatasetShard) and not isinstance(dataset, ray_data().Dataset):
            raise ConfigurationError(
                f"RayDataLoader takes a ray.data.Dataset, got {type(dataset).__name__}: "
                "make one with ray.data.read_parquet(...), ray.data.from_items(...), and so on"
            )
        self.dataset = dataset
        self.batch_size = _count("batch_size", batch_size, minimum=1)
        self.collate_fn = _callable("collate_fn", collate_fn)
        self.dtypes = _dtypes(dtypes)
        if self.collate_fn is not None and self.dtypes is not None:
            raise ConfigurationError(
                f"RayDataLoader takes collate_fn or dtypes, not both (Ray Data refuses them "
                f"together), got dtypes={self.dtypes!r}: convert the tensors to the dtypes "
                "you want inside collate_fn"
            )
        self.drop_last = flag("drop_last", drop_last)
        self.local_shuffle_buffer_size = _optional_count(
            "local_shuffle_buffer_size", local_shuffle_buffer_size, minimum=1
        )
        self.local_shuffle_seed = _optional_count("local_shuffle_seed", local_shuffle_seed, 0)
        self.prefetch_batches = _count("prefetch_batches", prefetch_batches, minimum=0)
        self.num_rows = _optional_count("num_rows", num_rows, minimum=0)
        #: How many passes this process has begun (the n of the shuffle's seed), where no
        #: epoch is followed (:meth:`follow_epochs`).
        self._passes = 0
        #: Worker side, a fit's train loader: the epoch Lightning is at (:meth:`follow_epochs`).
        self._epoch: Callable[[], int] | None = None
        #: The n of the pass this loader reads now (None: it began none).
        self.reading: int | None = None
        #: Batches the next pass leaves out, and those the pass read now left out.
        self._skip_next = 0
        self._skipped = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_epoch": None}  # the worker's Trainer stays there

    def __iter__(self) -> Iterator[Any]:
        # a generator: Lightning calls iter() to check a loader is iterable, which must not
        # begin a pass (each pass of a split waits for every rank's)
        if self._epoch is not None:
            self.reading = self._epoch()
        else:
            self.reading = self._passes
            self._passes += 1
        seed = self.local_shuffle_seed
        if seed is not None:
            seed += self.reading
        options: dict[str, Any] = {
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "prefetch_batches": self.prefetch_batches,
        }
        if self.collate_fn is not None:
            options["collate_fn"] = self.collate_fn
        if self.dtypes is not None:
            options["dtypes"] = self.dtypes
        if self.local_shuffle_buffer_size is not None:
            options["local_shuffle_buffer_size"] = self.local_shuffle_buffer_size
            options["local_shuffle_seed"] = seed
        if isinstance(self.dataset, DatasetShard):
            source = self.dataset.iterator
        else:
            source = self.dataset
            world = _process_group_size()
            if world > 1:
                # made on a worker (in setup or a *_dataloader hook): no split reached it, and
                # each rank would read every row, world-size times an epoch in all
                raise ConfigurationError(
                    f"this RayDataLoader's dataset was not split over the {world} ranks, so "
                    "each rank would read all of it: make the ray.data.Dataset on the driver, "
                    "before the Trainer's call (in the DataModule's __init__, or passed to "
                    "RayDataLoader there), where the strategy splits it over the ranks"
                )
        skip, self._skip_next = self._skip_next, 0
        self._skipped = skip
        batches = 0
        for batch in source.iter_torch_batches(**options):
            batches += 1
            if batches > skip:
                yield batch
        if self.num_rows is not None and self.rows() is not None and batches < len(self):
            # Lightning would wait for a last batch that never comes: no epoch end, so no
            # validation, checkpoint or early stopping after it, and nothing said
            raise ConfigurationError(
                f"RayDataLoader(num_rows={self.num_rows}) gives this process {len(self)} "
                f"batches of {self.batch_size} a pass, but its pass ended after {batches}: the "
                "dataset has fewer rows than num_rows says; pass its row count (or None, for "
                "a loader without a length)"
            )

    def skip_next_pass(self, batches: int) -> None:
        """Worker side, a fit resumed inside an epoch: the next pass leaves out its first
        ``batches`` batches (those the interrupted epoch had trained), so that the epoch ends
        after as many batches as it would have; a loader without a length would otherwise read a
        whole pass more. Other rows than the interrupted pass had left: a pass of Ray Data deals
        its rows anew."""
        self._skip_next = batches

    def begin_again(self) -> None:
        """Worker side: the pass read now is given up before its epoch began (Lightning set the
        data up early); the next pass leaves out what this one was to."""
        self._skip_next = self._skipped

    def follow_epochs(self, epoch: Callable[[], int]) -> None:
        """Worker side, a fit's train loader: each pass reads the pass of the epoch that
        ``epoch()`` gives as it begins (Lightning's epoch, which a DataLoader's sampler orders
        its samples by), not the count of passes begun: the same pass however often Lightning
        begins one in an epoch (a loader without a length begins one to prefetch a batch, and
        again as the epoch starts), the right one in a fit resumed at any epoch, and in a
        loader made anew for an epoch (``reload_dataloaders_every_n_epochs``)."""
        self._epoch = epoch

    def __len__(self) -> int:
        rows = self.rows()
        if rows is None:
            # Lightning reads a TypeError as "no length": an iterable that ends when it ends
            raise TypeError(
                "this RayDataLoader's length is unknown: Ray Data does not know the dataset's "
                "row count without running it; pass RayDataLoader(..., num_rows=...) or set "
                "max_steps / limit_train_batches"
            )
        batches = rows / self.batch_size
        return math.floor(batches) if self.drop_last else math.ceil(batches)

    def rows(self) -> int | None:
        """The rows this process reads in a pass (on a worker, its rank's share), if known."""
        shard = self.dataset
        if isinstance(shard, DatasetShard):
            if shard.rows is not None:
                return shard.rows
            if self.num_rows is None or not shard.equal:
                return None
            return self.num_rows // shard.world_size
        if self.num_rows is not None:
            return self.num_rows
        from ray_lightning_sgd._compat.ray import known_row_count

        return known_row_count(shard)

    def __repr__(self) -> str:
        return f"RayDataLoader({self.dataset!r}, batch_size={self.batch_size})"


#: RayDataModule's loader options that apply to its train dataset only.
_TRAIN_ONLY = ("local_shuffle_buffer_size", "drop_last", "num_rows")


class RayDataModuleBase:
    """A DataModule of Ray Data datasets: its ``*_dataloader`` hooks return
    :class:`RayDataLoader` s, so that ``trainer.fit(model, datamodule=...)``, ``validate``,
    ``test`` and ``predict`` stream each rank its share.

    Each namespace's ``RayDataModule`` joins this with its ``LightningDataModule``. Subclass it
    to build the datasets from arguments (a LightningCLI datamodule):

    .. code-block:: python

        class Parquet(RayDataModule):
            def __init__(self, path: str, batch_size: int = 64):
                super().__init__(train=ray.data.read_parquet(path), batch_size=batch_size)

    Args:
        train, val, test, predict: The datasets of each stage; a stage without one has no data.
        batch_size: Rows per batch on each rank, in every stage.
        eval_batch_size: Rows per batch in validation, test and predict (default: batch_size).
        **loader_options: Passed to every :class:`RayDataLoader` (``local_shuffle_seed``,
            ``dtypes``, ...); ``local_shuffle_buffer_size``, ``drop_last`` and ``num_rows``
            apply to ``train`` only (validation, test and predict read every row, and count
            their rows where Ray Data knows the count; for another count, override the stage's
            ``*_dataloader`` hook with a RayDataLoader of your own).
    """

    def __init__(
        self,
        train: Any = None,
        val: Any = None,
        test: Any = None,
        predict: Any = None,
        *,
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        **loader_options: Any,
    ) -> None:
        super().__init__()
        self.train, self.val, self.test, self.predict = train, val, test, predict
        self.batch_size = _count("batch_size", batch_size, minimum=1)
        self.eval_batch_size = _count(
            "eval_batch_size", batch_size if eval_batch_size is None else eval_batch_size, 1
        )
        takes = [
            name
            for name, param in inspect.signature(RayDataLoader.__init__).parameters.items()
            if param.kind is param.KEYWORD_ONLY
        ]
        unknown = sorted(set(loader_options) - set(takes))
        if unknown:
            raise ConfigurationError(
                f"RayDataModule got unknown options {', '.join(unknown)}; besides train, val, "
                f"test, predict, batch_size and eval_batch_size it takes {', '.join(takes)}"
            )
        self.loader_options = loader_options
        # what is wrong is said here, on the driver, not on a worker: one loader a stage
        for stage in ("train", "val", "test", "predict"):
            self._loader(stage)

    def _loader(self, stage: str) -> RayDataLoader | list[Any]:
        dataset = getattr(self, stage)
        if dataset is None:
            return []  # Lightning's "no dataloader" for this stage
        options = dict(self.loader_options)
        if stage != "train":
            for train_only in _TRAIN_ONLY:
                options.pop(train_only, None)
        size = self.batch_size if stage == "train" else self.eval_batch_size
        return RayDataLoader(dataset, size, **options)

    def train_dataloader(self) -> Any:
        if self.train is None:
            raise ConfigurationError("this RayDataModule has no train dataset: pass train=...")
        return self._loader("train")

    def val_dataloader(self) -> Any:
        return self._loader("val")

    def test_dataloader(self) -> Any:
        return self._loader("test")

    def predict_dataloader(self) -> Any:
        return self._loader("predict")


def _process_group_size() -> int:
    """The size of torch's default process group in this process (1: none)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _optional_count(name: str, value: Any, minimum: int) -> int | None:
    return None if value is None else _count(name, value, minimum)


def _callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ConfigurationError(f"{name} must be a function or None, got {value!r}")
    return value


def _dtypes(value: Any) -> Any:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, Mapping) and all(isinstance(v, torch.dtype) for v in value.values()):
        return dict(value)
    raise ConfigurationError(
        f"dtypes must be a torch.dtype or a dict of column name to torch.dtype, got {value!r}"
    )
