"""What a worker group is made of: how many workers, what each reserves, how they start."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ray_lightning_sgd._worker_group.code import DriverCode
from ray_lightning_sgd.exceptions import ConfigurationError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


#: Prefix of the names of every actor and placement group this package creates.
NAME_PREFIX = "ray_lightning_sgd"


@dataclass(frozen=True)
class WorkerGroupConfig:
    """How many workers to start, what each one reserves, and how to start them.

    Args:
        num_workers: Number of workers (Ray actors), one per training process; with
            ``sizes``, the most workers the group may have.
        sizes: The sizes an elastic group may have, largest first: it starts with the largest
            the cluster can place now (waiting ``startup_timeout_s`` for the smallest). Empty:
            exactly ``num_workers``.
        resources_per_worker: Ray resources each worker reserves: ``CPU``, ``GPU`` (fractions
            allowed) and custom resources.
        placement_strategy: Placement group strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
        worker_env: Environment variables set in each worker process before it starts.
        init_hook: A function run on every worker once it has started.
        startup_timeout_s: How long to wait for the cluster to place and start all workers.
        ship_driver_code: Whether the driver's own code (see :mod:`.code`) goes to the workers.
        driver_code: That code, as the driver had it when the group was asked for (the launcher
            fills it in at each call; None: nothing of the driver's).
    """

    num_workers: int = 1
    sizes: tuple[int, ...] = ()
    resources_per_worker: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    placement_strategy: str = "PACK"
    worker_env: Mapping[str, str] = field(default_factory=dict)
    init_hook: Callable[[], None] | None = None
    startup_timeout_s: float = 60.0
    ship_driver_code: bool = True
    #: not compared: equal settings are equal configs (the pool compares the code on its own)
    driver_code: DriverCode | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int):
            raise ConfigurationError(
                f"num_workers must be an int >= 1, got {self.num_workers!r} "
                f"({type(self.num_workers).__name__})"
            )
        if self.num_workers < 1:
            raise ConfigurationError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.sizes and (
            list(self.sizes) != sorted(set(self.sizes), reverse=True)
            or self.sizes[0] != self.num_workers
            or not all(isinstance(n, int) and n >= 1 for n in self.sizes)
        ):
            raise ConfigurationError(
                f"sizes must be distinct ints >= 1, largest first, the first {self.num_workers}; "
                f"got {self.sizes!r}"
            )
        if not self.resources_per_worker:
            raise ConfigurationError(
                "resources_per_worker must name at least one resource, got {}; "
                "for example {'CPU': 1}"
            )
        for name, amount in self.resources_per_worker.items():
            if not isinstance(name, str) or not name:
                raise ConfigurationError(f"resource names must be non-empty strings, got {name!r}")
            if (
                isinstance(amount, bool)
                or not isinstance(amount, (int, float))
                or not math.isfinite(amount)
                or not amount >= 0.0001  # Ray's resource precision
            ):
                raise ConfigurationError(
                    f"resources_per_worker[{name!r}] must be a number > 0, got {amount!r}; "
                    "(at least 0.0001); leave the resource out instead of asking for none of it"
                )
        if self.resources_per_worker.get("GPU", 0) > 1 and self.resources_per_worker["GPU"] % 1:
            raise ConfigurationError(
                "resources_per_worker['GPU'] above 1 must be a whole number, got "
                f"{self.resources_per_worker['GPU']}"
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigurationError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                f"got {self.placement_strategy!r}"
            )
        for key, value in self.worker_env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigurationError(
                    f"worker_env must map str to str, got {key!r}: {value!r}; "
                    "convert the value with str()"
                )
        if not isinstance(self.ship_driver_code, bool):
            raise ConfigurationError(
                f"ship_driver_code must be True or False, got {self.ship_driver_code!r}"
            )
        if self.init_hook is not None and not callable(self.init_hook):
            raise ConfigurationError(f"init_hook must be callable, got {self.init_hook!r}")
        if isinstance(self.startup_timeout_s, bool) or not isinstance(
            self.startup_timeout_s, (int, float)
        ):
            raise ConfigurationError(
                f"startup_timeout_s must be a number > 0, got {self.startup_timeout_s!r}"
            )
        if not (math.isfinite(self.startup_timeout_s) and self.startup_timeout_s > 0):
            raise ConfigurationError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")

    @property
    def elastic(self) -> bool:
        """Whether the group's size depends on what the cluster can place when it starts."""
        return len(self.sizes) > 1

    @property
    def min_workers(self) -> int:
        """The fewest workers the group may have."""
        return self.sizes[-1] if self.sizes else self.num_workers

    @property
    def use_gpu(self) -> bool:
        """Whether each worker reserves (a share of) a GPU."""
        return self.resources_per_worker.get("GPU", 0) > 0
