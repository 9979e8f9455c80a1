"""The worker group: a gang of Ray actors, reserved together in one placement group.

The driver creates a :class:`WorkerGroup`, calls :meth:`WorkerGroup.start` and then runs functions on
its workers with ``execute``, ``execute_async``, ``execute_single`` and ``execute_single_async``.
Workers are kept in rank order (see :mod:`ray_lightning_sgd._worker_group.ranks`): worker ``i`` is
global rank ``i``. A function that runs on a worker can read where it stands with
:func:`~ray_lightning_sgd._worker_group.context.get_worker_context`.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_lightning_sgd._worker_group import cluster, code
from ray_lightning_sgd._worker_group.config import NAME_PREFIX, WorkerGroupConfig
from ray_lightning_sgd._worker_group.context import WorkerContext, set_context
from ray_lightning_sgd._worker_group.errors import (
    actor_of,
    blame_a_lost_peer,
    chain,
    may_follow_a_lost_peer,
    remaining,
    translate,
)
from ray_lightning_sgd._worker_group.placement import bundles_for_workers, start_growth_probe
from ray_lightning_sgd._worker_group.ranks import (
    WorkerMetadata,
    WorkerRank,
    assign_ranks,
    device_index,
    rank_order,
    visible_devices,
)
from ray_lightning_sgd._worker_group.worker import NEWS_GROUP, POLL_GROUP, _Worker
from ray_lightning_sgd.exceptions import (
    ResourcesUnavailableError,
    WorkerGroupError,
    WorkerTimeoutError,
)

log = logging.getLogger(__name__)


T = TypeVar("T")


_SHUTDOWN_WAIT_S = 10.0


_WATCH_INTERVAL_S = 1.0


#: How long an elastic group waits for each size above its smallest before it tries a smaller one.
_PROBE_S = 2.0


class _State(enum.Enum):
    NEW = "new"
    STARTED = "started"
    SHUTDOWN = "shut down"


@dataclass(frozen=True)
class Worker:
    """Driver side: one started worker, as its group holds it (the one record of it)."""

    actor: Any
    metadata: WorkerMetadata
    rank: WorkerRank
    #: The CUDA device index the worker uses, or None without a GPU.
    device_index: int | None
    #: The index of the placement group bundle the worker runs in.
    bundle_index: int

    @property
    def context(self) -> WorkerContext:
        """What the worker knows about itself (sent to it when the group starts)."""
        return WorkerContext(self.metadata, self.rank, self.device_index)


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
        # the actors as started (bundle order), until they have reported and are ranked
        self._started: list[tuple[Any, int]] = []
        self._workers: list[Worker] = []

    @property
    def config(self) -> WorkerGroupConfig:
        """The configuration the group was created with."""
        return self._config

    @property
    def name(self) -> str:
        """The name of the group's placement group, and the prefix of its actors' names."""
        return self._name

    @property
    def workers(self) -> list[Worker]:
        """Every worker, in rank order."""
        self._require(_State.STARTED, "read workers")
        return list(self._workers)

    @property
    def metadata(self) -> list[WorkerMetadata]:
        """What each worker reported about itself, in rank order."""
        return [worker.metadata for worker in self.workers]

    @property
    def ranks(self) -> list[WorkerRank]:
        """The rank of each worker, in rank order."""
        return [worker.rank for worker in self.workers]

    def __len__(self) -> int:
        """How many workers the group has (an elastic group: once started; before, its most)."""
        return len(self._workers) if self._workers else self._config.num_workers

    def start(self) -> None:
        """Driver side: reserves all workers at once, starts them and assigns their ranks.

        An elastic group (``sizes``) takes the largest of its sizes that the cluster places now,
        and waits what is left of ``startup_timeout_s`` for its smallest.

        Raises:
            ResourcesUnavailableError: If the cluster cannot place the workers within
                ``startup_timeout_s``.
        """
        self._require(_State.NEW, "start")
        config = self._config
        deadline = time.monotonic() + config.startup_timeout_s
        cluster.check_placement_is_possible(
            config.resources_per_worker, config.min_workers, config.placement_strategy
        )
        try:
            reserved = self._reserve(deadline)
            # the time left for the actors: the error names the whole budget and what placing
            # the workers took of it (a group placed just before the deadline gets seconds)
            budget = f"startup_timeout_s={config.startup_timeout_s:g}s"
            placed_s = config.startup_timeout_s - remaining(deadline)
            if placed_s >= 1:
                budget += f", of which the cluster took {placed_s:.1f}s to place them"
            self._started = self._start_actors(reserved)
            self._state = _State.STARTED
            reported = self._get(
                [actor.metadata.remote() for actor, _ in self._started],
                timeout_s=remaining(deadline),
                what="start",
                within=budget,
                metadata=[],
            )
            order = rank_order(reported)
            metadata = [reported[i] for i in order]
            devices = visible_devices(metadata)
            self._workers = [
                Worker(
                    actor=self._started[i][0],
                    metadata=meta,
                    rank=rank,
                    device_index=device_index(meta, devices[meta.node_id]),
                    bundle_index=self._started[i][1],
                )
                for i, meta, rank in zip(order, metadata, assign_ranks(metadata), strict=True)
            ]
            self._started = []
            driver_code = config.driver_code
            if driver_code is not None and any(m.node_id != driver_code.node_id for m in metadata):
                # a worker away from the driver's node (an autoscaler's new node, say): the code
                # travels to it, whatever the cluster looked like when the call began
                driver_code = code.with_archive(driver_code)
            self._get(
                [
                    ref
                    for worker in self._workers
                    for ref in (
                        # the driver's code first: init_hook may come from it
                        worker.actor.execute.remote(code.adopt, driver_code),
                        worker.actor.execute.remote(
                            set_context, worker.context, devices[worker.metadata.node_id]
                        ),
                    )
                ],
                timeout_s=remaining(deadline),
                what="start",
                within=budget,
                metadata=metadata,
            )
            if config.init_hook is not None:
                self._get(
                    self.execute_async(config.init_hook),
                    timeout_s=remaining(deadline),
                    what="run init_hook",
                    within=budget,
                    metadata=metadata,
                )
        except BaseException:
            self.shutdown()
            raise
        log.debug("Started worker group %s: %s", self._name, [w.rank for w in self._workers])

    def execute_async(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Driver side: runs ``fn`` on every worker; returns one future per worker, in rank order."""
        self._require(_State.STARTED, "execute")
        return [worker.actor.execute.remote(fn, *args, **kwargs) for worker in self._workers]

    def execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Driver side: runs ``fn`` on every worker and returns the results in rank order."""
        return self.get(self.execute_async(fn, *args, **kwargs))

    def execute_single_async(
        self, index: int, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> ray.ObjectRef:
        """Driver side: runs ``fn`` on the worker of global rank ``index``; returns its future."""
        return self._worker(index, "execute").actor.execute.remote(fn, *args, **kwargs)

    def poll_async(self, index: int, acknowledged: dict[str, int] | None = None) -> ray.ObjectRef:
        """Driver side: asks the worker of global rank ``index`` for what the running function
        left in its outbox (a :class:`~ray_lightning_sgd._worker_group.outbox.Mail`); answered
        while the function runs."""
        return self._worker(index, "poll").actor.poll.remote(acknowledged)

    def news_async(self, index: int, call_id: str, items_after_s: float) -> ray.ObjectRef:
        """Driver side: asks the worker of global rank ``index`` to answer once call ``call_id``
        has something to poll for now (True: a SIGTERM notice at once, output lines or sent
        functions after ``items_after_s``) or has ended (False)."""
        return self._worker(index, "news").actor.news.remote(call_id, items_after_s)

    def stack_async(self, index: int) -> ray.ObjectRef:
        """Driver side: asks the worker of global rank ``index`` for the stack of the thread
        that runs the function (a :class:`~ray_lightning_sgd._worker_group.stacks.ThreadStack`,
        or None when none runs); answered while the function runs."""
        return self._worker(index, "stack").actor.stack.remote()

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
            metadata=[worker.metadata for worker in self._workers],
            watch=watch,
            watch_interval_s=watch_interval_s,
        )

    def wait(
        self,
        refs: Sequence[ray.ObjectRef],
        wait_s: float | None,
        watch: Callable[[], None] | None = None,
        watch_interval_s: float = _WATCH_INTERVAL_S,
    ) -> list[Any] | None:
        """Driver side: as :meth:`get`, but after ``wait_s`` (None: never) returns None while
        a worker still runs, where :meth:`get` raises."""
        return self._get(
            refs,
            timeout_s=wait_s,
            what="finish",
            metadata=[worker.metadata for worker in self._workers],
            watch=watch,
            watch_interval_s=watch_interval_s,
            give_up=False,
        )

    def shutdown(self) -> None:
        """Driver side: kills every worker and frees the placement group. Never blocks for long."""
        if self._state is _State.SHUTDOWN:
            return
        self._state = _State.SHUTDOWN
        actors = [worker.actor for worker in self._workers] + [a for a, _ in self._started]
        self._workers, self._started = [], []
        placement, self._placement_group = self._placement_group, None
        try:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if actors:
                # a call on a killed actor fails once Ray knows it is dead: wait, boundedly
                probes: list[ray.ObjectRef] = [actor.metadata.remote() for actor in actors]
                ray.wait(probes, num_returns=len(probes), timeout=_SHUTDOWN_WAIT_S)
        finally:  # also after a Ctrl-C above: a second call returns at once, so it goes now
            if placement is not None:
                remove_placement_group(placement)  # which ends any actor still in it
        log.debug("Shut down worker group %s", self._name)

    def has_room_to_grow(
        self, wait_s: float = _PROBE_S, config: WorkerGroupConfig | None = None
    ) -> bool:
        """Driver side: whether the cluster would place this elastic group at a larger size now
        (with ``config``'s settings: what a call keeps free; the group's own by default).

        A started elastic group below its most workers reserves what a larger size would add
        (:func:`start_growth_probe`) and waits up to ``wait_s`` for it, as long as a new group
        waits for each larger size; anything else (a fixed size, the most already, a Ray Tune
        trial's fixed reservation) has no room to grow.
        """
        self._require(_State.STARTED, "probe for room")
        config = self._config if config is None else config
        if len(self) >= config.num_workers or get_current_placement_group() is not None:
            return False
        probe = start_growth_probe(config, len(self))
        if probe is None:
            return False
        try:
            ready, _ = ray.wait([probe.ready()], timeout=wait_s)
        finally:
            remove_placement_group(probe)
        return bool(ready)

    def _worker(self, index: int, action: str) -> Worker:
        self._require(_State.STARTED, action)
        if not 0 <= index < len(self._workers):
            raise IndexError(f"worker index must be in [0, {len(self._workers)}), got {index}")
        return self._workers[index]

    def _require(self, state: _State, action: str) -> None:
        if self._state is not state:
            raise WorkerGroupError(
                f"cannot {action} on a worker group that is {self._state.value}; "
                f"it must be {state.value}"
            )

    def _reserve(self, deadline: float) -> tuple[PlacementGroup, list[int]]:
        config = self._config
        bundle = dict(config.resources_per_worker)
        sizes = config.sizes or (config.num_workers,)
        enclosing = get_current_placement_group()
        if enclosing is not None:
            # a Ray Tune trial (or any task in a placement group): use its bundles, not a second
            # group that the trial's own reservation may leave no room for
            return enclosing, bundles_for_workers(enclosing.bundle_specs, bundle, sizes)
        nodes = cluster.node_resources()
        totals = {name: sum(node.get(name, 0.0) for node in nodes) for name in config.keep_free}
        placeable = [
            size
            for size in sizes
            if cluster.placement_problem(bundle, size, config.placement_strategy, nodes) is None
        ]
        possible = [size for size in placeable if config.leaves_free(size, totals)]
        if possible and possible[0] < placeable[0]:
            log.info(
                "Elastic worker group %s: at most %d workers, which leave %s of the cluster's "
                "%s free for Ray Data's tasks",
                self._name, possible[0], dict(config.keep_free), totals,
            )  # fmt: skip
        possible = possible or [config.min_workers]
        # larger sizes are tried within half the time at most: the smallest keeps the rest
        tries_end = time.monotonic() + remaining(deadline) / 2
        for size in possible:
            smallest = size == possible[-1]
            if not smallest and remaining(tries_end) <= 0:
                continue
            group = placement_group(
                [bundle] * size, strategy=config.placement_strategy, name=self._name
            )
            self._placement_group = group  # so that shutdown() frees it if the wait is interrupted
            wait_s = remaining(deadline) if smallest else min(_PROBE_S, remaining(tries_end))
            ready, _ = ray.wait([group.ready()], timeout=wait_s)
            if ready:
                if config.elastic:
                    log.info(
                        "Elastic worker group %s: %d workers (of %d to %d)",
                        self._name, size, config.min_workers, config.num_workers,
                    )  # fmt: skip
                return group, list(range(size))
            remove_placement_group(group)
            self._placement_group = None
        wanted = f"{config.min_workers} (of up to {config.num_workers})" if config.elastic else ""
        raise ResourcesUnavailableError(
            f"the cluster did not place {wanted or config.num_workers} workers of {bundle} "
            f"({config.placement_strategy}) within startup_timeout_s="
            f"{config.startup_timeout_s}s; {cluster.describe_available()}. Free resources, add "
            "nodes, ask for less, or raise startup_timeout_s"
        )

    def _start_actors(self, reserved: tuple[PlacementGroup, list[int]]) -> list[tuple[Any, int]]:
        group, bundles = reserved
        config = self._config
        resources = dict(config.resources_per_worker)
        num_cpus = resources.pop("CPU", 0)
        num_gpus = resources.pop("GPU", 0)
        runtime_env = {"env_vars": dict(config.worker_env)} if config.worker_env else None
        actor_cls = ray.remote(concurrency_groups={POLL_GROUP: 1, NEWS_GROUP: 1})(_Worker)  # type: ignore[call-overload]
        return [
            (
                actor_cls.options(
                    name=f"{self._name}-{index}",
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    resources=resources,
                    runtime_env=runtime_env,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=bundle_index
                    ),
                ).remote(),
                bundle_index,
            )
            for index, bundle_index in enumerate(bundles)
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
        give_up: bool = True,
        within: str | None = None,
    ) -> list[Any]:
        """``within``: how the timeout error names the time it gave (else its seconds)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            # bounded waits: a blocking ray.wait can hold off the driver's Ctrl-C handler
            wait_s = watch_interval_s
            if deadline is not None:
                wait_s = min(wait_s, remaining(deadline))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                time_left = deadline is None or remaining(deadline) > 0
                if watch is not None and (time_left or not give_up):
                    watch()  # also at the end of a wait's slice: the next may be as short
                if time_left:
                    continue
                if not give_up:
                    return None  # type: ignore[return-value]  # (wait's answer: still running)
                raise WorkerTimeoutError(
                    f"the workers of {self._name} did not {what} within "
                    f"{within or f'{timeout_s:.1f}s'}"
                )
            for ref in ready:
                try:
                    ray.get(ref)
                except RayError as err:
                    error, cause = translate(err, metadata, actor_of(ref)), chain(err)
                    if pending and may_follow_a_lost_peer(error):
                        error, cause = blame_a_lost_peer(pending, metadata, error, cause)
                    raise error from cause
        try:
            return ray.get(list(refs))
        except GetTimeoutError as err:  # pragma: no cover - every ref is ready here
            raise WorkerGroupError(f"results of {self._name} vanished") from err
