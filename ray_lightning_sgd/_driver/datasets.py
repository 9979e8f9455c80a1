"""Driver side: the Ray Data datasets of a call, split over each attempt's ranks.

:func:`~ray_lightning_sgd._driver.packing.pack_payload` sets every ``ray.data.Dataset`` of the
payload aside (:func:`dataset_types`); once an attempt's workers are placed, :func:`split` makes
one ``streaming_split`` of each over the attempt's world size, with the workers' nodes as
locality hints, and every worker puts its rank's shard in the dataset's place. The split's
coordinator actor runs Ray Data's executor; the data goes from Ray Data's tasks to the workers,
never through the driver. :func:`close` ends the coordinators when the attempt ends: no block of
the call stays in the object store.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import ray

from ray_lightning_sgd._boundary.datasets import DatasetSplit
from ray_lightning_sgd._compat.ray import known_row_count, split_coordinator
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata
from ray_lightning_sgd.exceptions import ConfigurationError

log = logging.getLogger(__name__)


def dataset_types() -> tuple[type, ...]:
    """The types the payload's pickling sets aside: Ray Data's ``Dataset`` once ``ray.data`` is
    imported (a process that never imported it holds no dataset)."""
    module = sys.modules.get("ray.data")
    return () if module is None else (module.Dataset,)


def bare_dataset(values: Sequence[Any]) -> Any:
    """The first of ``values`` (a Trainer call's arguments) that is a ``ray.data.Dataset`` passed
    where Lightning takes a DataLoader, else None."""
    types = dataset_types()
    return next((v for v in values if types and isinstance(v, types)), None)


#: What an elastic group leaves free while a call streams datasets, at every size but its
#: smallest: the CPU that a read or map task of Ray Data asks by default.
KEEP_FREE = {"CPU": 1.0}


def check_room(config: WorkerGroupConfig, datasets: Sequence[Any] = ()) -> None:
    """Before an attempt's workers start: raises when they would leave the cluster less than
    one CPU, the least a read or map task of Ray Data asks by default (none could run, and the
    call would wait forever); where every dataset is materialised (``from_items``,
    ``materialize()``: its blocks are made, no task runs), only when they leave none. An elastic
    run counts its fewest workers: its larger sizes are taken only where they leave
    :data:`KEEP_FREE` (``WorkerGroupConfig.keep_free``)."""
    total = float(ray.cluster_resources().get("CPU", 0.0))
    fewest = config.sizes[-1] if config.sizes else config.num_workers  # an elastic run's min
    taken = fewest * float(config.resources_per_worker.get("CPU", 0.0))
    free = total - taken
    materialised = False
    if datasets:
        from ray.data.dataset import MaterializedDataset

        materialised = all(isinstance(each, MaterializedDataset) for each in datasets)
    if free >= 1 or (materialised and free > 0):
        return
    what = (
        f"the {fewest} workers take {taken:g} of the cluster's {total:g} CPUs, which "
        f"leaves {max(free, 0):g} for Ray Data's read and map tasks"
    )
    fixes = (
        "leave room: fewer CPUs a worker (num_cpus_per_worker=0.5; a worker that only trains "
        "needs little), fewer workers, or more CPUs (a CPU-only node for preprocessing: ray start "
        "--num-cpus=N on another machine; ray.init(num_cpus=N) locally); Ray Data's own limits: "
        "DataContext.get_current().execution_options.resource_limits"
    )
    raise ConfigurationError(
        f"the call streams Ray Data datasets, but {what}, and each read or map task asks a "
        f"whole CPU (Ray Data's default): none could run, and every rank would wait for good; "
        f"leave at least one CPU free: {fixes}"
    )


def check_strategy(
    name: str, sharded: bool, predicting: bool, tensor_parallel: int | None, auto: bool = False
) -> None:
    """Raises for the strategies a Ray Data split cannot feed: a sharded strategy's ``predict``
    (its ranks read different numbers of rows, and each forward gathers the weights from every
    rank: a rank with fewer batches leaves the others waiting), and tensor parallelism (the
    ranks of a tensor-parallel group must see the same batch; a split gives each rank its own
    rows). ``tensor_parallel``: the size the workers take (None: not known before they are
    placed), ``auto`` whether "auto" made it so."""
    if sharded and predicting:
        raise ConfigurationError(
            f"{name}.predict over a Ray Data dataset: the split gives ranks different numbers "
            "of rows (predict reads every row once), and each forward of a sharded model "
            "gathers its weights from every rank, so a rank that ran out of batches would "
            "leave the others waiting; predict with a DataLoader (Lightning's sampler gives "
            "every rank as many batches), or with RaySGDStrategy"
        )
    if tensor_parallel is not None and tensor_parallel > 1:
        raise ConfigurationError(
            f"{name} with tensor_parallel_size={tensor_parallel}"
            + (" ('auto': the workers of a node)" if auto else "")
            + " over a Ray Data dataset: the ranks of a tensor-parallel group must see the same "
            "batch, and a Ray Data split gives each rank rows of its own; pass "
            "data_parallel_size=num_workers, tensor_parallel_size=1 (FSDP2 alone), or a "
            "DataLoader (Lightning's sampler deals by data-parallel rank)"
        )


def split(
    datasets: Sequence[Any], metadata: Sequence[WorkerMetadata], predicting: bool
) -> list[DatasetSplit]:
    """Once an attempt's workers are placed: each dataset split over them, one iterator a rank
    (``metadata`` in rank order). ``predict`` drops no row (ranks may read different numbers);
    the other calls split equally, so that every rank takes as many steps."""
    hints = [meta.node_id for meta in metadata]
    splits: list[DatasetSplit] = []
    try:
        for dataset in datasets:
            rows = known_row_count(dataset)
            iterators = dataset.streaming_split(
                len(hints), equal=not predicting, locality_hints=hints
            )
            splits.append(DatasetSplit(tuple(iterators), rows, equal=not predicting))
    except BaseException:
        close(splits)
        raise
    return splits


def close(splits: Sequence[DatasetSplit]) -> None:
    """When an attempt ends (on every path): ends each split's coordinator actor, and with it
    the blocks it produced. What fails here is logged, never raised."""
    for each in splits:
        try:
            ray.kill(split_coordinator(each.iterators[0]), no_restart=True)
        except Exception:
            log.warning("Could not end a dataset split's coordinator", exc_info=True)
