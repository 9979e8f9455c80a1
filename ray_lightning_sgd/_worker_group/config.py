"""What a worker group is made of: how many workers, what each reserves, how they start."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ray_lightning_sgd._worker_group.code import DriverCode
from ray_lightning_sgd.exceptions import ConfigurationError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


#: Prefix of the names of every actor and placement group this package creates.
NAME_PREFIX = "ray_lightning_sgd"

#: The longest timeout any argument takes (about 31 years): Python's timedelta, Ray's timeouts
#: (int64 milliseconds) and gloo (which refuses a timeout that overflows) all hold it.
MAX_SECONDS = 1e9


def seconds_problem(value: object) -> str | None:
    """Why ``value`` is not a number of seconds (> 0, finite, at most :data:`MAX_SECONDS`; not a
    bool), or None when it is one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number of seconds > 0, got {value!r} ({type(value).__name__})"
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        return f"must be a number of seconds > 0 and at most {MAX_SECONDS:.0e}, got {value!r}"
    return None


def flag(name: str, value: Any) -> bool:
    """``value`` of the argument ``name``, which must be True or False."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


#: The least amount of a resource Ray takes (its precision).
LEAST_RESOURCE = 0.0001


def resource_problem(what: str, name: object, amount: object) -> str | None:
    """Why ``name``: ``amount`` of ``what`` (a dict of Ray resources) is not a resource Ray
    takes, or None when it is one."""
    if not isinstance(name, str) or not name:
        return f"{what} must map resource names (non-empty str) to numbers, got the name {name!r}"
    if (
        isinstance(amount, bool)
        or not isinstance(amount, (int, float))
        or not math.isfinite(amount)
        or not amount >= LEAST_RESOURCE
    ):
        return (
            f"{what}[{name!r}] must be a number > 0 (at least {LEAST_RESOURCE:g}), got "
            f"{amount!r}; leave the resource out instead of asking for none of it"
        )
    return None


def _env_problem(worker_env: Mapping[Any, Any]) -> str | None:
    """Why ``worker_env`` cannot be set as environment variables, or None when it can."""
    for key, value in worker_env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            return f"must map str to str, got {key!r}: {value!r}; convert the value with str()"
        if not key or "=" in key or "\0" in key or "\0" in value:
            return (
                f"must map variable names (not empty, without '=' or NUL) to values without "
                f"NUL, got {key!r}: {value!r}"
            )
    return None


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
        keep_free: Resources an elastic group leaves free in the cluster at every size but its
            smallest: the CPU that Ray Data's tasks need while a call streams datasets (the
            launcher sets it; the smallest size is checked before the group starts).
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
    keep_free: Mapping[str, float] = field(default_factory=dict)

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
            or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.sizes
            )
        ):
            raise ConfigurationError(
                f"sizes must be distinct ints >= 1, largest first, the first {self.num_workers}; "
                f"got {self.sizes!r}"
            )
        if not isinstance(self.resources_per_worker, Mapping):
            raise ConfigurationError(
                "resources_per_worker must be a dict such as {'CPU': 2, 'GPU': 1}, got "
                f"{self.resources_per_worker!r}"
            )
        if not self.resources_per_worker:
            raise ConfigurationError(
                "resources_per_worker must name at least one resource, got {}; "
                "for example {'CPU': 1}"
            )
        for name, amount in self.resources_per_worker.items():
            problem = resource_problem("resources_per_worker", name, amount)
            if problem is not None:
                raise ConfigurationError(problem)
        if self.resources_per_worker.get("GPU", 0) > 1 and self.resources_per_worker["GPU"] % 1:
            raise ConfigurationError(
                "resources_per_worker['GPU'] above 1 must be a whole number, got "
                f"{self.resources_per_worker['GPU']}"
            )
        if not isinstance(self.placement_strategy, str) or (
            self.placement_strategy not in PLACEMENT_STRATEGIES
        ):
            raise ConfigurationError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                f"got {self.placement_strategy!r}"
            )
        if not isinstance(self.worker_env, Mapping):
            raise ConfigurationError(
                f"worker_env must be a dict of environment variables such as {{'A': '1'}}, got "
                f"{self.worker_env!r}"
            )
        env_problem = _env_problem(self.worker_env)
        if env_problem is not None:
            raise ConfigurationError(f"worker_env {env_problem}")
        if not isinstance(self.ship_driver_code, bool):
            raise ConfigurationError(
                f"ship_driver_code must be True or False, got {self.ship_driver_code!r}"
            )
        if self.init_hook is not None:
            if not callable(self.init_hook):
                raise ConfigurationError(f"init_hook must be callable, got {self.init_hook!r}")
            try:
                inspect.signature(self.init_hook).bind()
            except TypeError as err:
                raise ConfigurationError(
                    f"init_hook is called with no arguments on every worker, and "
                    f"{self.init_hook!r} needs some ({err}); pass a function that takes none, "
                    "such as functools.partial(hook, value)"
                ) from None
            except ValueError:  # no signature to read (some builtins): it is called as it is
                pass
        timeout_problem = seconds_problem(self.startup_timeout_s)
        if timeout_problem is not None:
            raise ConfigurationError(f"startup_timeout_s {timeout_problem}")

    @property
    def elastic(self) -> bool:
        """Whether the group's size depends on what the cluster can place when it starts."""
        return len(self.sizes) > 1

    @property
    def min_workers(self) -> int:
        """The fewest workers the group may have."""
        return self.sizes[-1] if self.sizes else self.num_workers

    def same_settings(self, other: WorkerGroupConfig) -> bool:
        """Whether ``other`` has this config's settings, whatever one call kept free (the
        launcher adds :attr:`keep_free` to the strategy's settings for a call)."""
        return replace(self, keep_free={}) == replace(other, keep_free={})

    def leaves_free(self, size: int, totals: Mapping[str, float]) -> bool:
        """Whether ``size`` workers leave :attr:`keep_free` of the cluster's ``totals`` (its
        resources in all): always at the smallest size, which the group must take if any."""
        if size <= self.min_workers:
            return True
        return all(
            totals.get(name, 0.0) - size * self.resources_per_worker.get(name, 0.0) >= amount - 1e-9
            for name, amount in self.keep_free.items()
        )

    @property
    def use_gpu(self) -> bool:
        """Whether each worker reserves (a share of) a GPU."""
        return self.resources_per_worker.get("GPU", 0) > 0
