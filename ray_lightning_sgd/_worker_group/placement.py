"""Driver side: the placement groups a worker group reserves beside its own: which bundles of an
enclosing group (a Ray Tune trial's) its workers take, and the probe for room to grow."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from ray_lightning_sgd._worker_group.config import NAME_PREFIX, WorkerGroupConfig
from ray_lightning_sgd.exceptions import ResourcesUnavailableError


def start_growth_probe(config: WorkerGroupConfig, size: int) -> PlacementGroup | None:
    """Driver side: reserves, without waiting, what an elastic group of ``size`` workers needs
    besides its own reservation to take its next larger size; placed, there is room to grow.
    None: the larger size would not leave the cluster what the group keeps free (no room).

    The caller removes the returned placement group.
    """
    bundle = dict(config.resources_per_worker)
    # the next size the group may take (keep_global_batch_size skips some)
    larger = min(n for n in config.sizes if n > size)
    if config.keep_free and not config.leaves_free(larger, ray.cluster_resources()):
        return None
    if config.placement_strategy in ("STRICT_PACK", "STRICT_SPREAD"):
        # the larger group must fit as a whole, beside this one (which holds its resources):
        # never room where there is none, at the cost of missing some
        bundles, strategy = [bundle] * larger, config.placement_strategy
    else:
        # the bundles the larger group adds, anywhere: with this one's, the group fits
        bundles, strategy = [bundle] * (larger - size), "SPREAD"
    name = f"{NAME_PREFIX}-probe-{uuid.uuid4().hex[:12]}"
    return placement_group(bundles, strategy=strategy, name=name)


def bundles_for_workers(
    specs: Sequence[Mapping[str, float]],
    bundle: Mapping[str, float],
    sizes: int | Sequence[int],
) -> list[int]:
    """The indices of an enclosing placement group's bundles that the workers take: the last
    ones that each hold ``bundle`` (a Tune trial's head bundle comes first), as many as the
    largest of ``sizes`` (a number of workers, or an elastic group's sizes, largest first) that
    the group holds.

    Raises:
        ResourcesUnavailableError: The group has too few such bundles for the smallest size.
    """
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    fitting = [
        index
        for index, spec in enumerate(specs)
        if all(spec.get(name, 0.0) >= amount for name, amount in bundle.items())
    ]
    num_workers = next((size for size in sizes if size <= len(fitting)), None)
    if num_workers is None:
        raise ResourcesUnavailableError(
            f"this call runs inside a placement group (a Ray Tune trial's?) whose bundles are "
            f"{[dict(s) for s in specs]}; {sizes[-1]} workers need {sizes[-1]} bundles of "
            f"{dict(bundle)}. Give the trial the strategy's own request: "
            "tune.with_resources(trainable, strategy.tune_resources())"
        )
    return fitting[len(fitting) - num_workers :]
