"""The worker group: a gang of Ray actors, reserved together in one placement group.

The driver creates a :class:`WorkerGroup`, calls :meth:`WorkerGroup.start` and then runs functions on
its workers with ``execute``, ``execute_async``, ``execute_single`` and ``execute_single_async``.
Workers are kept in rank order (see :mod:`ray_lightning_sgd.ranks`): worker ``i`` is global rank ``i``.
A function that runs on a worker can read where it stands with :func:`get_worker_context`.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_lightning_sgd import cluster
from ray_lightning_sgd.exceptions import (
    ConfigurationError,
    ResourcesUnavailableError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerTimeoutError,
)
from ray_lightning_sgd.ranks import (
    WorkerMetadata,
    WorkerRank,
    assign_ranks,
    device_index,
    rank_order,
    visible_devices,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: Prefix of the names of every actor and placement group this package creates.
NAME_PREFIX = "ray_lightning_sgd"
_SHUTDOWN_WAIT_S = 10.0
_WATCH_INTERVAL_S = 1.0
# how long an error of a collective (gloo/NCCL lost its peer) waits for Ray to name the dead peer
_PEER_LOSS_GRACE_S = 5.0
# words of the errors torch.distributed raises on a rank whose peer vanished
_PEER_LOSS_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")
#: The attribute a worker sets on an exception raised inside ``torch.distributed``.
_IN_COLLECTIVE = "_ray_lightning_sgd_in_collective"


@dataclass(frozen=True)
class WorkerGroupConfig:
    """How many workers to start, what each one reserves, and how to start them.

    Args:
        num_workers: Number of workers (Ray actors), one per training process.
        resources_per_worker: Ray resources each worker reserves: ``CPU``, ``GPU`` (fractions
            allowed) and custom resources.
        placement_strategy: Placement group strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
        worker_env: Environment variables set in each worker process before it starts.
        init_hook: A function run on every worker once it has started.
        startup_timeout_s: How long to wait for the cluster to place and start all workers.
    """

    num_workers: int = 1
    resources_per_worker: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    placement_strategy: str = "PACK"
    worker_env: Mapping[str, str] = field(default_factory=dict)
    init_hook: Callable[[], None] | None = None
    startup_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int):
            raise ConfigurationError(
                f"num_workers must be an int >= 1, got {self.num_workers!r} "
                f"({type(self.num_workers).__name__})"
            )
        if self.num_workers < 1:
            raise ConfigurationError(f"num_workers must be >= 1, got {self.num_workers}")
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
    def use_gpu(self) -> bool:
        """Whether each worker reserves (a share of) a GPU."""
        return self.resources_per_worker.get("GPU", 0) > 0


@dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about itself once the group has started."""

    metadata: WorkerMetadata
    rank: WorkerRank
    #: The CUDA device index this worker uses, or None without a GPU.
    device_index: int | None


_context: WorkerContext | None = None


def get_worker_context() -> WorkerContext:
    """Runs on each worker. Returns this worker's rank and device, as the group assigned them."""
    if _context is None:
        raise WorkerGroupError(
            "get_worker_context() was called outside a started worker group; "
            "call it only in functions that a WorkerGroup executes"
        )
    return _context


def _set_context(context: WorkerContext, node_devices: tuple[str, ...]) -> None:
    """Runs on each worker. Stores the worker's context and shares its node's GPUs with it."""
    global _context
    _context = context
    if node_devices:
        # every worker on a node sees all GPUs of the node's workers; it picks its own by index
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(node_devices)


class _Worker:
    """Runs on each worker. The Ray actor that executes the functions the driver sends."""

    def metadata(self) -> WorkerMetadata:
        context = ray.get_runtime_context()
        return WorkerMetadata(
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            actor_id=context.get_actor_id() or "",
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
        )

    def execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            # the driver re-raises this very exception; say where it came from
            where = f"pid {os.getpid()} on {ray.util.get_node_ip_address()}"
            if _context is not None:
                rank = _context.rank
                where = (
                    f"rank {rank.global_rank} of {rank.world_size} (node "
                    f"{_context.metadata.node_id[:12]}, {where})"
                )
            err.add_note(f"Raised on {where}. Worker traceback:\n{traceback.format_exc()}")
            if _raised_inside_torch(err):
                # travels with the exception (its __dict__ is pickled): the driver may blame a
                # lost peer for it, never for an error of user code that reads alike
                setattr(err, _IN_COLLECTIVE, True)
            raise


def _raised_inside_torch(err: BaseException) -> bool:
    """Runs on each worker. Whether ``err`` came out of torch itself: its innermost Python frame
    is in the torch package (``torch.distributed``, or the autograd engine whose backward runs
    DDP's all-reduce in C++), not in user code."""
    torch = sys.modules.get("torch")
    frames = traceback.extract_tb(err.__traceback__)
    if torch is None or torch.__file__ is None or not frames:
        return False
    package = os.path.dirname(torch.__file__) + os.sep
    return frames[-1].filename.startswith(package)


class _State(enum.Enum):
    NEW = "new"
    STARTED = "started"
    SHUTDOWN = "shut down"


class WorkerGroup:
    """A gang of Ray actors that run functions for the driver.

    Creating a group touches no Ray state; :meth:`start` reserves the placement group and starts the
    actors, :meth:`shutdown` kills them and frees the reservation.
    """

    def __init__(self, config: WorkerGroupConfig) -> None:
        self._config = config
        self._state = _State.NEW
        self._name = f"{NAME_PREFIX}-{uuid.uuid4().hex[:12]}"
        # only a group this worker group made; one it runs inside is its owner's to free
        self._placement_group: PlacementGroup | None = None
        self._bundles: list[int] = []
        self._actors: list[ray.actor.ActorHandle] = []
        self._metadata: list[WorkerMetadata] = []
        self._ranks: list[WorkerRank] = []

    @property
    def config(self) -> WorkerGroupConfig:
        """The configuration the group was created with."""
        return self._config

    @property
    def name(self) -> str:
        """The name of the group's placement group, and the prefix of its actors' names."""
        return self._name

    @property
    def metadata(self) -> list[WorkerMetadata]:
        """What each worker reported about itself, in rank order."""
        self._require(_State.STARTED, "read metadata")
        return list(self._metadata)

    @property
    def ranks(self) -> list[WorkerRank]:
        """The rank of each worker, in rank order."""
        self._require(_State.STARTED, "read ranks")
        return list(self._ranks)

    def __len__(self) -> int:
        return self._config.num_workers

    def start(self) -> None:
        """Driver side: reserves all workers at once, starts them and assigns their ranks.

        Raises:
            ResourcesUnavailableError: If the cluster cannot place the workers within
                ``startup_timeout_s``.
        """
        self._require(_State.NEW, "start")
        config = self._config
        deadline = time.monotonic() + config.startup_timeout_s
        cluster.check_placement_is_possible(
            config.resources_per_worker, config.num_workers, config.placement_strategy
        )
        try:
            self._actors = self._start_actors(self._reserve(deadline))
            self._state = _State.STARTED
            metadata = self._get(
                [actor.metadata.remote() for actor in self._actors],
                timeout_s=_remaining(deadline),
                what="start the workers",
                metadata=[],
            )
            order = rank_order(metadata)
            self._actors = [self._actors[i] for i in order]
            self._metadata = [metadata[i] for i in order]
            self._ranks = assign_ranks(self._metadata)
            devices = visible_devices(self._metadata)
            self._get(
                [
                    actor.execute.remote(
                        _set_context,
                        WorkerContext(meta, rank, device_index(meta, devices[meta.node_id])),
                        devices[meta.node_id],
                    )
                    for actor, meta, rank in zip(
                        self._actors, self._metadata, self._ranks, strict=True
                    )
                ],
                timeout_s=_remaining(deadline),
                what="start the workers",
                metadata=self._metadata,
            )
            if config.init_hook is not None:
                self._get(
                    self.execute_async(config.init_hook),
                    timeout_s=_remaining(deadline),
                    what="run init_hook within startup_timeout_s",
                    metadata=self._metadata,
                )
        except BaseException:
            self.shutdown()
            raise
        log.debug("Started worker group %s: %s", self._name, self._ranks)

    def execute_async(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Driver side: runs ``fn`` on every worker; returns one future per worker, in rank order."""
        self._require(_State.STARTED, "execute")
        return [actor.execute.remote(fn, *args, **kwargs) for actor in self._actors]

    def execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Driver side: runs ``fn`` on every worker and returns the results in rank order."""
        return self.get(self.execute_async(fn, *args, **kwargs))

    def execute_single_async(
        self, index: int, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> ray.ObjectRef:
        """Driver side: runs ``fn`` on the worker of global rank ``index``; returns its future."""
        self._require(_State.STARTED, "execute")
        if not 0 <= index < len(self._actors):
            raise IndexError(f"worker index must be in [0, {len(self._actors)}), got {index}")
        return self._actors[index].execute.remote(fn, *args, **kwargs)

    def execute_single(self, index: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Driver side: runs ``fn`` on the worker of global rank ``index`` and returns its result."""
        return self.get([self.execute_single_async(index, fn, *args, **kwargs)])[0]

    def get(
        self,
        refs: Sequence[ray.ObjectRef],
        timeout_s: float | None = None,
        watch: Callable[[], None] | None = None,
        watch_interval_s: float = _WATCH_INTERVAL_S,
    ) -> list[Any]:
        """Driver side: waits for futures of this group's workers, failing as soon as one fails.

        An exception raised by user code is re-raised with its own type and a note naming the
        rank; a worker that died raises :class:`WorkerDiedError`. ``watch``, if given, is called
        every ``watch_interval_s`` while nothing has finished; what it raises ends the wait.
        """
        return self._get(
            refs,
            timeout_s=timeout_s,
            what="finish",
            metadata=self._metadata,
            watch=watch,
            watch_interval_s=watch_interval_s,
        )

    def shutdown(self) -> None:
        """Driver side: kills every worker and frees the placement group. Never blocks for long."""
        if self._state is _State.SHUTDOWN:
            return
        self._state = _State.SHUTDOWN
        actors, self._actors = self._actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if actors:
            # a call on a killed actor fails once Ray knows it is dead: wait for that, boundedly
            probes: list[ray.ObjectRef] = [actor.metadata.remote() for actor in actors]
            ray.wait(probes, num_returns=len(probes), timeout=_SHUTDOWN_WAIT_S)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        log.debug("Shut down worker group %s", self._name)

    def _require(self, state: _State, action: str) -> None:
        if self._state is not state:
            raise WorkerGroupError(
                f"cannot {action} on a worker group that is {self._state.value}; "
                f"it must be {state.value}"
            )

    def _reserve(self, deadline: float) -> PlacementGroup:
        config = self._config
        bundle = dict(config.resources_per_worker)
        enclosing = get_current_placement_group()
        if enclosing is not None:
            # a Ray Tune trial (or any task in a placement group): use its bundles, not a second
            # group that the trial's own reservation may leave no room for
            self._bundles = bundles_for_workers(enclosing.bundle_specs, bundle, config.num_workers)
            return enclosing
        self._bundles = list(range(config.num_workers))
        group = placement_group(
            [bundle] * config.num_workers, strategy=config.placement_strategy, name=self._name
        )
        self._placement_group = group  # so that shutdown() frees it if the wait is interrupted
        ready, _ = ray.wait([group.ready()], timeout=_remaining(deadline))
        if not ready:
            remove_placement_group(group)
            self._placement_group = None
            raise ResourcesUnavailableError(
                f"the cluster did not place {config.num_workers} workers of {bundle} "
                f"({config.placement_strategy}) within startup_timeout_s="
                f"{config.startup_timeout_s}s; {cluster.describe_available()}. Free resources, add "
                "nodes, ask for less, or raise startup_timeout_s"
            )
        return group

    def _start_actors(self, group: PlacementGroup) -> list[Any]:
        config = self._config
        resources = dict(config.resources_per_worker)
        num_cpus = resources.pop("CPU", 0)
        num_gpus = resources.pop("GPU", 0)
        runtime_env = {"env_vars": dict(config.worker_env)} if config.worker_env else None
        actor_cls = ray.remote(_Worker)
        return [
            actor_cls.options(
                name=f"{self._name}-{index}",
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=resources,
                runtime_env=runtime_env,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=self._bundles[index]
                ),
            ).remote()
            for index in range(config.num_workers)
        ]

    def _get(
        self,
        refs: Sequence[ray.ObjectRef],
        *,
        timeout_s: float | None,
        what: str,
        metadata: Sequence[WorkerMetadata],
        watch: Callable[[], None] | None = None,
        watch_interval_s: float = _WATCH_INTERVAL_S,
    ) -> list[Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            # bounded waits: a blocking ray.wait can hold off the driver's Ctrl-C handler
            wait_s = watch_interval_s
            if deadline is not None:
                wait_s = min(wait_s, _remaining(deadline))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready and (deadline is None or _remaining(deadline)):
                if watch is not None:
                    watch()
                continue
            if not ready:
                raise WorkerTimeoutError(
                    f"the workers of {self._name} did not {what} within {timeout_s:.1f}s"
                )
            for ref in ready:
                try:
                    ray.get(ref)
                except RayError as err:
                    error, cause = _translate(err, metadata, _actor_of(ref)), _chain(err)
                    if pending and _may_follow_a_lost_peer(error):
                        error, cause = _blame_a_lost_peer(pending, metadata, error, cause)
                    raise error from cause
        try:
            return ray.get(list(refs))
        except GetTimeoutError as err:  # pragma: no cover - every ref is ready here
            raise WorkerGroupError(f"results of {self._name} vanished") from err


def _may_follow_a_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` looks like a collective that failed because another rank vanished.

    Only an error the worker saw raised inside torch qualifies: a user's own
    ``RuntimeError("broken pipe")`` is raised as it is, at once.
    """
    if isinstance(error, WorkerGroupError) or not getattr(error, _IN_COLLECTIVE, False):
        return False
    if type(error).__name__ in ("DistBackendError", "DistNetworkError"):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(m in text for m in _PEER_LOSS_MARKERS)


def _blame_a_lost_peer(
    pending: list[ray.ObjectRef],
    metadata: Sequence[WorkerMetadata],
    error: BaseException,
    cause: BaseException | None,
) -> tuple[BaseException, BaseException | None]:
    """A rank saw its peer vanish before Ray reported the peer dead (a lost node shows up in the
    survivors' sockets first): waits briefly for the death, which is the error worth raising."""
    deadline = time.monotonic() + _PEER_LOSS_GRACE_S
    while pending and _remaining(deadline):
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(1.0, _remaining(deadline)))
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as err:
                died = _translate(err, metadata, _actor_of(ref))
                if isinstance(died, WorkerDiedError):
                    died.add_note(f"Another rank failed first, as it lost its peer: {error!r}")
                    for note in getattr(error, "__notes__", ()):
                        died.add_note(note)  # which rank, and its worker traceback
                    return died, _chain(err)
    return error, cause


def bundles_for_workers(
    specs: Sequence[Mapping[str, float]], bundle: Mapping[str, float], num_workers: int
) -> list[int]:
    """The indices of an enclosing placement group's bundles that the workers take: the last
    ``num_workers`` bundles that each hold ``bundle`` (a Tune trial's head bundle comes first).

    Raises:
        ResourcesUnavailableError: The group has too few such bundles.
    """
    fitting = [
        index
        for index, spec in enumerate(specs)
        if all(spec.get(name, 0.0) >= amount for name, amount in bundle.items())
    ]
    if len(fitting) < num_workers:
        raise ResourcesUnavailableError(
            f"this call runs inside a placement group (a Ray Tune trial's?) whose bundles are "
            f"{[dict(s) for s in specs]}; {num_workers} workers need {num_workers} bundles of "
            f"{dict(bundle)}. Give the trial the strategy's own request: "
            "tune.with_resources(trainable, strategy.tune_resources())"
        )
    return fitting[len(fitting) - num_workers :]


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _where(meta: WorkerMetadata | None, rank: int | None) -> str:
    if meta is None:
        return "a worker that had not reported its metadata yet"
    return f"rank {rank} (node {meta.node_id[:12]}, {meta.node_ip}, pid {meta.pid})"


def _actor_of(ref: ray.ObjectRef) -> str:
    """The id of the actor whose task returns ``ref`` ("" for a plain object)."""
    try:
        return ref.task_id().actor_id().hex()
    except Exception:  # noqa: BLE001 - an id Ray cannot take apart names no actor
        return ""


def _translate(err: RayError, metadata: Sequence[WorkerMetadata], actor_id: str) -> BaseException:
    """Turns a Ray error from a worker into the exception the driver raises.

    ``actor_id`` is the actor whose result failed; it names the rank when Ray's error does not
    (a lost object, a system error).
    """
    if isinstance(err, RayTaskError):
        # the worker has already noted its rank and traceback on the exception
        cause = err.cause
        if isinstance(cause, BaseException) and not isinstance(cause, RayError):
            return cause
        if isinstance(cause, RayActorError):
            err = cause
        else:
            return WorkerGroupError(f"a call on a worker failed: {err}")
    died = isinstance(err, RayActorError)
    if isinstance(err, RayActorError) and err.actor_id:
        actor_id = err.actor_id
    index = next((i for i, m in enumerate(metadata) if m.actor_id == actor_id), None)
    meta = metadata[index] if index is not None else None
    what = "died" if died else "was lost"
    return WorkerDiedError(
        f"the worker of {_where(meta, index)} {what}: {err}",
        rank=-1 if index is None else index,
        node_id="" if meta is None else meta.node_id,
    )


def _chain(err: RayError) -> BaseException | None:
    # a user exception is re-raised as itself; its Ray wrapper adds nothing but noise
    return None if isinstance(err, RayTaskError) else err


__all__ = [
    "PLACEMENT_STRATEGIES",
    "WorkerContext",
    "WorkerGroup",
    "WorkerGroupConfig",
    "get_worker_context",
]
