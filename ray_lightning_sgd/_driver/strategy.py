"""RaySGDStrategy: Lightning's DDP, with its processes run as a gang of Ray actors.

The strategy is a thin ``DDPStrategy``: it validates its arguments in the constructor (before Ray is
touched), hands the launch to its launcher (:class:`~ray_lightning_sgd._driver.launcher.RayLauncherBase`), and
reads ranks and device from its cluster environment
(:class:`~ray_lightning_sgd._worker.environment.RayEnvironmentBase`). Everything else is Lightning's DDP.

:class:`RaySGDStrategyBase` is the implementation, for either Lightning namespace;
``ray_lightning_sgd.pytorch_lightning.RaySGDStrategy`` and ``ray_lightning_sgd.lightning.RaySGDStrategy``
join it with that namespace's ``DDPStrategy``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import typing
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ray_lightning_sgd import _compat
from ray_lightning_sgd._backend.torch import TorchConfig
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._driver.failure import FailureConfig
from ray_lightning_sgd._driver.launcher import RayLauncherBase
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._worker.environment import RayEnvironmentBase
from ray_lightning_sgd._worker.hardware import Family, PrecisionRequest, WorkerPrecisionBase
from ray_lightning_sgd._worker.resume import ResumeCheckpointBase
from ray_lightning_sgd._worker_group import cluster
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd.exceptions import ConfigurationError

if TYPE_CHECKING:
    from pytorch_lightning.strategies import DDPStrategy as _Base

else:
    _Base = object

_OTHER_NAMESPACE = {
    "pytorch_lightning": ("lightning.pytorch", "lightning"),
    "lightning.pytorch": ("pytorch_lightning", "pytorch_lightning"),
}

# Lightning strategy arguments that these strategies decide themselves, and what to use instead
_OWNED_ARGS = {
    "cluster_environment": "the strategy brings its own RayEnvironment",
    "parallel_devices": "use num_workers and use_gpu",
    "start_method": "Ray starts the workers",
    "process_group_backend": "use backend_config=TorchConfig(backend=...)",
    "timeout": "use backend_config=TorchConfig(timeout_s=...)",
}


def _from_config(config: str, name: str) -> Any:
    """A read-only property: the value ``name`` of the strategy's config ``config``."""

    def read(self: Any) -> Any:
        return getattr(getattr(self, config), name)

    return property(read, doc=f"The ``{name}`` this strategy was given (read-only).")


class RayStrategyBase(_compat.ConfigureLauncher, _Base):
    """A Lightning strategy whose processes are a gang of Ray actors: what every strategy of this
    package adds to the Lightning strategy it joins (:class:`RaySGDStrategyBase` to
    ``DDPStrategy``, :class:`RayModelParallelStrategyBase` to ``ModelParallelStrategy``,
    :class:`RayFSDPStrategyBase` to ``FSDPStrategy``).

    Args:
        num_workers: Number of workers (training processes), each a Ray actor; or ``(min, max)``
            for an elastic run: it starts with as many as the cluster places now (waiting
            ``startup_timeout_s`` for ``min``), restarts after a lost worker with as many as it
            can place, and grows at an epoch boundary when room appears (see
            ``resize_interval_s``); ``fit`` resumes from the resume checkpoint of the last
            epoch, which an elastic run always writes.
        num_cpus_per_worker: CPUs each worker reserves (default 1, or none when
            ``resources_per_worker`` is given without ``CPU``).
        use_gpu: Give each worker one GPU (NCCL instead of gloo). The driver needs no GPU: each
            worker resolves the Trainer's precision for its own device.
        resources_per_worker: Ray resources each worker reserves (``CPU``, ``GPU`` with fractions
            allowed, at most one), custom resources; merged with ``num_cpus_per_worker`` and
            ``use_gpu``, each of which it may not contradict.
        placement_strategy: How the placement group spreads the workers over nodes: PACK, SPREAD,
            STRICT_PACK or STRICT_SPREAD.
        backend_config: The process group's backend, init method and timeout.
        init_hook: A function run on every worker after it starts, before training.
        worker_env: Environment variables set in every worker process.
        startup_timeout_s: How long to wait for the cluster to place and start the workers,
            and for them to join the process group.
        reuse_workers: Keep the workers (actors and process group) up after a successful call, so
            that the next ``fit``, ``validate``, ``test`` or ``predict`` with the same settings,
            of this Trainer or another, starts at once. Release them with
            :meth:`shutdown_workers`, ``with RaySGDStrategy(...)``, or
            :func:`ray_lightning_sgd.shutdown_workers`; they also end at interpreter exit and with
            ``ray.shutdown()``. With False, every call starts and stops its own workers.
        max_failures: Restart the whole group this many times after a worker died (its process
            or node was lost; an exception in user code is never retried); -1 for no limit.
            ``fit`` resumes from the latest resume checkpoint, which the strategy writes every
            ``checkpoint_every_n_epochs`` epochs when restarts are on.
        max_preemptions: Restart this many times after Ray reported a worker's node preempted
            (drained for preemption: a spot node, an autoscaler's drain) or a training worker
            received SIGTERM, without counting against ``max_failures``; -1 (default): no limit,
            0: never. A SIGTERM makes rank 0 write a resume checkpoint at a step boundary (the
            ranks exchange notices about every 0.5 s), and ``fit`` resumes there; other
            restarts resume from the latest resume checkpoint if one is written
            (``max_failures``, ``run_name`` or an elastic ``num_workers``), else start over.
        progress_timeout_s: Raise ``WorkerTimeoutError`` naming the rank when a rank makes no
            progress (no batch, no stage) for this long: a deadlock or an endless loop.
        checkpoint_every_n_epochs: Epochs between resume checkpoints.
        checkpoint_storage: Where the resume checkpoint goes (a local path or fsspec URI that
            every worker can reach; ``~`` is expanded on the driver, and ``fit`` checks there
            that the folder can be written before any worker starts); None sends its bytes to
            the driver's node.
        run_name: Names the run: its resume checkpoints go to ``<checkpoint_storage>/<run_name>``
            (written every ``checkpoint_every_n_epochs`` epochs, also without ``max_failures``),
            and a new driver whose ``fit`` has the same name resumes from the latest of them,
            after the previous driver died; refused when the stored run trains another model or
            strategy. Without it, each launch's checkpoints are its own and removed at its end.
        keep_last: How many resume checkpoints of a run are kept in the storage.
        resize_interval_s: How often an elastic run checks whether the cluster has room for
            more workers (it then grows at the next resume checkpoint).
        keep_global_batch_size: In an elastic run, scale the Trainer's
            ``accumulate_grad_batches`` by ``max / world size``, so that each optimizer step sees
            as many samples as with ``max`` workers; the run then only takes sizes that divide
            ``max``. False: each optimizer step sees ``world size x batch size`` samples.
        driver_callbacks: A list of callbacks that run on the driver while the workers train,
            called with rank 0's live events: setup and teardown, each stage's and epoch's
            start and end, and each batch (``outputs`` and ``batch`` are None; ``trainer``
            shows rank 0's epoch, step, batch counts and latest metrics). The Trainer's progress
            bar runs the same way; callbacks given to the Trainer run on the workers, as in
            Lightning's DDP.
        ship_driver_code: Make what the driver can import importable on every worker: the
            driver's own modules (those imported from folders outside the standard library and
            site-packages, e.g. through ``sys.path.append("../src")``) are found on the workers
            of the driver's node through the driver's ``sys.path``, in its order, and reach other
            nodes as one archive through Ray's object store, unpacked once per node and content.
            With False, every node must be able to import them (installed, or a shared folder).
        **strategy_kwargs: Passed to the Lightning strategy (see each subclass).
    """

    strategy_name: ClassVar[str]
    #: The precision plugins the Lightning strategy takes (FSDP takes only its own).
    precision_family: ClassVar[Family] = "general"
    #: Whether the model's parameters are sharded across the workers: its full weights are
    #: gathered for the driver shard by shard.
    sharded: ClassVar[bool] = False
    #: The Lightning namespace of this class, and the launcher and environment classes it uses.
    flavour: ClassVar[Flavour]
    environment_class: ClassVar[type[RayEnvironmentBase]]
    launcher_class: ClassVar[type[RayLauncherBase]]
    precision_class: ClassVar[type[WorkerPrecisionBase]]

    def __init__(
        self,
        num_workers: int | tuple[int, int] = 1,
        *,
        num_cpus_per_worker: float | None = None,
        use_gpu: bool = False,
        resources_per_worker: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        backend_config: TorchConfig | None = None,
        init_hook: Callable[[], None] | None = None,
        worker_env: dict[str, str] | None = None,
        startup_timeout_s: float = 60,
        reuse_workers: bool = True,
        max_failures: int = 0,
        max_preemptions: int = -1,
        progress_timeout_s: float | None = None,
        checkpoint_every_n_epochs: int = 1,
        checkpoint_storage: str | None = None,
        run_name: str | None = None,
        keep_last: int = 2,
        resize_interval_s: float = 60,
        keep_global_batch_size: bool = False,
        driver_callbacks: list[Any] | None = None,
        ship_driver_code: bool = True,
        **strategy_kwargs: Any,
    ) -> None:
        self._failure_config = FailureConfig(
            max_failures=max_failures,
            max_preemptions=max_preemptions,
            progress_timeout_s=progress_timeout_s,
            checkpoint_every_n_epochs=checkpoint_every_n_epochs,
            checkpoint_storage=checkpoint_storage,
            run_name=run_name,
            keep_last=keep_last,
            resize_interval_s=resize_interval_s,
        )
        self._driver_callbacks = self._check_driver_callbacks(driver_callbacks)
        if not isinstance(reuse_workers, bool):
            raise ConfigurationError(f"reuse_workers must be True or False, got {reuse_workers!r}")
        backend_config = TorchConfig() if backend_config is None else backend_config
        if not isinstance(backend_config, TorchConfig):
            raise ConfigurationError(
                f"backend_config must be a TorchConfig, got {type(backend_config).__name__}"
            )
        strategy_kwargs = self._check_strategy_kwargs(strategy_kwargs)
        if not isinstance(keep_global_batch_size, bool):
            raise ConfigurationError(
                f"keep_global_batch_size must be True or False, got {keep_global_batch_size!r}"
            )
        self._keep_global_batch_size = keep_global_batch_size
        most, sizes = _worker_sizes(num_workers, keep_global_batch_size)
        self._worker_group_config = WorkerGroupConfig(
            num_workers=most,
            sizes=sizes,
            resources_per_worker=_resources(num_cpus_per_worker, use_gpu, resources_per_worker),
            placement_strategy=placement_strategy,
            worker_env=_worker_env(worker_env),
            init_hook=init_hook,
            startup_timeout_s=startup_timeout_s,
            ship_driver_code=ship_driver_code,
        )
        self._backend_config = backend_config
        self._reuse_workers = reuse_workers
        self._precision_request: PrecisionRequest | None = None
        self._check_workers()
        super().__init__(
            process_group_backend=backend_config.backend,
            timeout=timedelta(seconds=backend_config.timeout_s),
            **strategy_kwargs,
        )
        self.cluster_environment = self.environment_class(most)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inherits = cls.__module__ != __name__ and cls.__init__ is RayStrategyBase.__init__
        if inherits and _joins_a_lightning_strategy(cls):
            cls.__init__ = _init_with_accepted_signature(cls)  # type: ignore[method-assign]

    @classmethod
    def lightning_strategy(cls) -> type:
        """The Lightning strategy class this one joins, in the class's namespace."""
        raise NotImplementedError

    @classmethod
    def module_wrapper(cls) -> type | None:
        """torch's wrapper of the model that takes the arguments the Lightning strategy passes on
        (``DistributedDataParallel``, ``FullyShardedDataParallel``), if any."""
        return None

    def _check_driver_callbacks(self, callbacks: Any) -> list[Any]:
        """``driver_callbacks`` as a list; raises unless it is a list (or tuple) of Callbacks of
        this strategy's Lightning namespace."""
        if callbacks is None:
            return []
        expected = self.flavour.callback
        namespace = self.flavour.namespace
        if isinstance(callbacks, expected):
            raise ConfigurationError(
                f"driver_callbacks takes a list of Callbacks, got one: {callbacks!r}; pass "
                f"driver_callbacks=[{type(callbacks).__name__}(...)]"
            )
        if not isinstance(callbacks, (list, tuple)):
            raise ConfigurationError(
                f"driver_callbacks takes a list of {namespace} Callbacks, got {callbacks!r} "
                f"({type(callbacks).__name__})"
            )
        for callback in callbacks:
            if not isinstance(callback, expected):
                raise ConfigurationError(
                    f"driver_callbacks takes {namespace} Callbacks, got "
                    f"{callback!r}; subclass {namespace}.callbacks.Callback"
                )
        return list(callbacks)

    def _check_strategy_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Returns the Lightning strategy's (and its module wrapper's) arguments that change
        something; raises for those the strategy owns or does not know."""
        return _check_strategy_kwargs(
            kwargs, type(self).__name__, self.lightning_strategy(), self.module_wrapper()
        )

    def _check_workers(self) -> None:
        """Raises for worker settings that this kind of strategy cannot run."""

    def resume_checkpoints(self) -> contextlib.AbstractContextManager[Any]:
        """Runs on each worker. A context in which ``Trainer.save_checkpoint`` writes a resume
        checkpoint: one file, written by rank 0, that the driver keeps for restarts."""
        return contextlib.nullcontext()

    def full_state_dict(self) -> dict[str, Any]:
        """Runs on each worker (all of them: it may be a collective). The model's whole state
        dict, on rank 0 at least, which the driver's model loads."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__} has no model to take the state dict of")
        return module.state_dict()

    # Lightning's accelerator connector reads this attribute while it parses the Trainer's
    # arguments, right after it has the user's precision, and before it adapts the precision to
    # the driver's machine (16-mixed becomes bf16-mixed on a driver without GPUs): the moment to
    # keep what the user asked for, which each worker resolves for its own hardware
    @property
    def _precision_plugin(self) -> Any:
        own = self.__dict__.get("_own_precision_plugin")
        arguments = _compat.trainer_arguments_being_parsed()
        if arguments is None:
            return own
        precision, plugin, accelerator = arguments
        if not isinstance(accelerator, str):  # an Accelerator instance
            name = type(accelerator).__name__
            accelerator = {"CPUAccelerator": "cpu", "CUDAAccelerator": "cuda"}.get(name, name)
        self._precision_request = PrecisionRequest(str(precision), plugin or own, accelerator)
        # FSDP's connector branch builds its own plugin from the precision as asked, before
        # Lightning adapts a precision to a CPU machine, and FSDP refuses any other plugin
        stand_in = self.precision_family == "general" and self._worker_group_config.use_gpu
        if own is None and plugin is None and stand_in:
            # the driver keeps a stand-in: it names the precision, the GPU workers build the plugin
            return self.precision_class(str(precision))
        return own

    @_precision_plugin.setter
    def _precision_plugin(self, plugin: Any) -> None:
        self.__dict__["_own_precision_plugin"] = plugin

    @property
    def precision_request(self) -> PrecisionRequest:
        """The precision the user asked the Trainer for, which each worker resolves for its own
        hardware (see :mod:`ray_lightning_sgd._worker.hardware`)."""
        if self._precision_request is not None:
            return self._precision_request
        plugin = self.precision_plugin  # a strategy that no Trainer's connector parsed
        return PrecisionRequest(str(getattr(plugin, "precision", "32-true")))

    # the constructor's arguments, readable as attributes (as ray_lightning's and Ray's
    # ScalingConfig's are); each has one home, the config that holds it
    @property
    def num_workers(self) -> int | tuple[int, int]:
        """The ``num_workers`` this strategy was given: a number, or an elastic ``(min, max)``."""
        config = self._worker_group_config
        return (config.min_workers, config.num_workers) if config.elastic else config.num_workers

    resources_per_worker = _from_config("_worker_group_config", "resources_per_worker")
    placement_strategy = _from_config("_worker_group_config", "placement_strategy")
    init_hook = _from_config("_worker_group_config", "init_hook")
    ship_driver_code = _from_config("_worker_group_config", "ship_driver_code")
    worker_env = _from_config("_worker_group_config", "worker_env")
    startup_timeout_s = _from_config("_worker_group_config", "startup_timeout_s")
    use_gpu = _from_config("_worker_group_config", "use_gpu")
    max_failures = _from_config("_failure_config", "max_failures")
    max_preemptions = _from_config("_failure_config", "max_preemptions")
    progress_timeout_s = _from_config("_failure_config", "progress_timeout_s")
    checkpoint_every_n_epochs = _from_config("_failure_config", "checkpoint_every_n_epochs")
    checkpoint_storage = _from_config("_failure_config", "checkpoint_storage")
    run_name = _from_config("_failure_config", "run_name")
    keep_last = _from_config("_failure_config", "keep_last")
    resize_interval_s = _from_config("_failure_config", "resize_interval_s")

    @property
    def keep_global_batch_size(self) -> bool:
        """Whether an elastic run scales ``accumulate_grad_batches`` to keep the global batch."""
        return self._keep_global_batch_size

    @property
    def world_sizes(self) -> dict[int, int]:
        """Driver side: how many workers trained each epoch of the latest ``fit`` (an elastic
        run's size changes between epochs); empty before any ``fit``."""
        launcher = getattr(self, "_launcher", None)
        return dict(launcher.world_sizes) if isinstance(launcher, RayLauncherBase) else {}

    @property
    def num_cpus_per_worker(self) -> float:
        """The CPUs each worker reserves (0 where ``resources_per_worker`` names none)."""
        return float(self._worker_group_config.resources_per_worker.get("CPU", 0))

    @property
    def worker_group_config(self) -> WorkerGroupConfig:
        """How many workers the strategy starts and what each one reserves."""
        return self._worker_group_config

    @property
    def backend_config(self) -> TorchConfig:
        """How the workers form their process group."""
        return self._backend_config

    @property
    def failure_config(self) -> FailureConfig:
        """Restarts, progress timeout and resume checkpoints."""
        return self._failure_config

    @property
    def driver_callbacks(self) -> list[Any]:
        """Callbacks that run on the driver, on rank 0's live events."""
        return self._driver_callbacks

    def tune_resources(self, head_bundle: Mapping[str, float] | None = None) -> Any:
        """Driver side: what one Ray Tune trial of a run with this strategy needs, as a
        ``ray.tune.PlacementGroupFactory``: one bundle per worker (custom and fractional resources
        included) and ``head_bundle`` for the trial's own process (nothing by default: the
        driver only waits). The workers then start in the trial's placement group.

        Raises:
            ResourcesUnavailableError: The connected cluster (started if none is) could never
                hold one trial, which Tune would otherwise leave pending for ever.
        """
        try:
            from ray.tune import PlacementGroupFactory
        except ImportError as err:
            raise ImportError(
                "tune_resources needs Ray Tune: pip install 'ray_lightning_sgd[tune]'"
            ) from err
        config = self._worker_group_config
        cluster.connect()
        cluster.check_placement_is_possible(
            config.resources_per_worker, config.num_workers, config.placement_strategy
        )
        bundles = [dict(head_bundle or {})]
        bundles += [dict(config.resources_per_worker) for _ in range(config.num_workers)]
        return PlacementGroupFactory(bundles, strategy=config.placement_strategy)

    def __getstate__(self) -> dict[str, Any]:
        # driver callbacks stay on the driver (they may hold a terminal, a widget, a socket)
        state = super().__getstate__()
        state["_driver_callbacks"] = []
        return state

    @property
    def reuse_workers(self) -> bool:
        """Whether workers stay up between calls."""
        return self._reuse_workers

    def shutdown_workers(self) -> None:
        """Driver side: stops the idle workers that calls with this strategy's settings kept up."""
        pool.shutdown(self._worker_group_config)

    def __enter__(self) -> RayStrategyBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown_workers()

    def __repr__(self) -> str:
        # Lightning shows this when a Trainer of the other namespace refuses the strategy
        namespace = self.flavour.namespace
        other_namespace, other_module = _OTHER_NAMESPACE[namespace]
        name = type(self).__name__
        return (
            f"{type(self).__module__}.{name}(num_workers="
            f"{self._worker_group_config.num_workers}), for a {namespace}.Trainer (a "
            f"{other_namespace}.Trainer takes ray_lightning_sgd.{other_module}.{name})"
        )

    @property
    def ray_environment(self) -> RayEnvironmentBase:
        """The cluster environment that holds this worker's rank and device."""
        if not isinstance(self.cluster_environment, RayEnvironmentBase):
            raise TypeError(
                f"{type(self).__name__} needs its own cluster environment (RayEnvironment), got "
                f"{self.cluster_environment!r}"
            )
        return self.cluster_environment

    @property
    @override
    def root_device(self) -> torch.device:
        return self.ray_environment.device

    @property
    @override
    def num_nodes(self) -> int:
        return self.ray_environment.num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # Lightning passes Trainer(num_nodes=...) here while it builds the Trainer
        if num_nodes != 1:
            name = type(self).__name__
            raise ConfigurationError(
                f"Trainer(num_nodes={num_nodes}) conflicts with {name}: Ray places the "
                f"workers on nodes. Remove num_nodes and set {name}(num_workers=...) to the "
                "total number of workers"
            )

    @override
    def set_world_ranks(self) -> None:
        # the ranks were assigned by the worker group and are already in the environment
        self.flavour.rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def make_launcher(self) -> RayLauncherBase:
        """Returns the launcher Lightning uses for this strategy."""
        return self.launcher_class(self)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Runs on each worker. Lightning's, then a fit restarted from an in-epoch resume
        checkpoint (a preemption's) skips, in its train DataLoader's first epoch, the batches
        that epoch had trained."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.training:
            for callback in _compat.hidden_callbacks_of(trainer):
                if isinstance(callback, ResumeCheckpointBase):
                    callback.resume_inside_epoch(dataloader, trainer)
        return dataloader


class _SamplesByWorldRank:
    """A strategy mixin: each worker reads its share of the data by its global rank among all
    workers (Lightning's DDP and FSDP multiply nodes by a node's processes, which on Ray differ
    from node to node)."""

    world_size: int
    global_rank: int

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


class RaySGDStrategyBase(_SamplesByWorldRank, RayStrategyBase):
    """Distributed data parallel training on a gang of Ray actors: Lightning's ``DDPStrategy``.

    Takes the arguments of :class:`RayStrategyBase` (the workers), and, as ``**ddp_kwargs``,
    those of :class:`torch.nn.parallel.DistributedDataParallel` (``find_unused_parameters``,
    ``bucket_cap_mb``, ``static_graph``, ...) or of Lightning's ``DDPStrategy``
    (``ddp_comm_hook``, ...).
    """

    strategy_name = "ray_sgd"

    @classmethod
    @override
    def lightning_strategy(cls) -> type:
        return cls.flavour.ddp_strategy

    @classmethod
    @override
    def module_wrapper(cls) -> type:
        return DistributedDataParallel


class _ShardedBase(RayStrategyBase):
    """What the sharded strategies share: the full weights gathered shard by shard for the
    driver, and resume checkpoints saved whole."""

    sharded = True

    @override
    def _check_workers(self) -> None:
        storage = self._failure_config.checkpoint_storage
        if storage is not None and "://" in storage and not storage.startswith("file://"):
            raise ConfigurationError(
                f"{type(self).__name__} takes a local checkpoint_storage (a folder every worker's "
                f"node reaches, such as a shared file system), got {storage!r}: Lightning's "
                "sharded strategies write and read checkpoints by local path; mount the "
                "storage, or leave checkpoint_storage out to keep resume checkpoints in the driver"
            )

    @override
    def resume_checkpoints(self) -> contextlib.AbstractContextManager[Any]:
        # one file that rank 0 writes, with every rank's shards gathered to it on the CPU: it
        # travels to the driver and back as DDP's does, and loads into the sharded model on
        # restart (torch's distributed checkpoint would leave a shard on every rank's node)
        return _compat.whole_checkpoints(self, self.lightning_strategy().__name__)

    @override
    def full_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # every rank takes part; rank 0 alone receives each tensor, whole and on the CPU, one
        # parameter at a time (never the whole model in one rank's device memory)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)  # type: ignore[arg-type]


class RayModelParallelStrategyBase(_ShardedBase):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 with ``fully_shard`` and tensor parallelism,
    applied in ``LightningModule.configure_model`` over ``self.device_mesh``) on a gang of Ray
    actors. Runs on CPU workers (gloo) and GPU workers (NCCL).

    Takes the arguments of :class:`RayStrategyBase` (the workers) and those of Lightning's
    ``ModelParallelStrategy``: ``data_parallel_size``, ``tensor_parallel_size`` (each ``"auto"``
    by default: one data-parallel group per node, tensor parallelism across a node's workers) and
    ``save_distributed_checkpoint``.
    """

    strategy_name = "ray_model_parallel"

    @classmethod
    @override
    def lightning_strategy(cls) -> type:
        return cls.flavour.model_parallel_strategy

    @override
    def _check_workers(self) -> None:
        problem = _compat.torch.cpu_fsdp2_problem(torch.__version__)
        if not self._worker_group_config.use_gpu and problem is not None:
            raise ConfigurationError(f"{type(self).__name__} on CPU workers: {problem}")
        super()._check_workers()

    @override
    def teardown(self) -> None:
        """Runs on each worker. Lightning's teardown, then the process groups of this call's
        device mesh are destroyed: warm workers would otherwise gain a set on every call."""
        super().teardown()
        try:
            mesh = self.device_mesh  # type: ignore[attr-defined]
        except RuntimeError:  # the call ended before the mesh was made
            return
        _compat.torch.destroy_mesh_groups(mesh)


class RayFSDPStrategyBase(_SamplesByWorldRank, _ShardedBase):
    """Lightning's ``FSDPStrategy`` (FSDP1: ``auto_wrap_policy``, activation checkpointing, CPU
    offload) on a gang of Ray actors with GPUs.

    Takes the arguments of :class:`RayStrategyBase` (the workers; ``use_gpu=True`` or GPUs in
    ``resources_per_worker``) and those of Lightning's ``FSDPStrategy``.
    """

    strategy_name = "ray_fsdp"
    precision_family = "fsdp"

    @classmethod
    @override
    def lightning_strategy(cls) -> type:
        return cls.flavour.fsdp_strategy

    @classmethod
    @override
    def module_wrapper(cls) -> type:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel

    @override
    def _check_workers(self) -> None:
        if not self._worker_group_config.use_gpu:
            raise ConfigurationError(
                f"{type(self).__name__} needs GPU workers (pass use_gpu=True): torch's FSDP "
                "(FSDP1) runs on CUDA only. To shard a model across CPU workers, use "
                "RayModelParallelStrategy (FSDP2) and apply fully_shard in configure_model"
            )
        super()._check_workers()


# each strategy's help shows the worker arguments it takes, besides its Lightning strategy's
_WORKER_ARGS = (RayStrategyBase.__doc__ or "").split("Args:", 1)[-1]
for _strategy in (RaySGDStrategyBase, RayModelParallelStrategyBase, RayFSDPStrategyBase):
    _strategy.__doc__ = f"{_strategy.__doc__}\n    Worker arguments:\n{_WORKER_ARGS}"


def _worker_sizes(num_workers: Any, keep_global_batch_size: bool) -> tuple[int, tuple[int, ...]]:
    """The most workers, and the sizes an elastic run may take (largest first; empty: a fixed
    size). With ``keep_global_batch_size`` only sizes that divide the most are taken."""
    if isinstance(num_workers, list):  # as LightningCLI and YAML give a pair
        num_workers = tuple(num_workers)
    if not isinstance(num_workers, tuple):
        if keep_global_batch_size:
            raise ConfigurationError(
                f"keep_global_batch_size=True applies to an elastic num_workers=(min, max); with "
                f"num_workers={num_workers!r} the global batch never changes: leave it out"
            )
        return num_workers, ()  # WorkerGroupConfig checks it
    pair = num_workers
    if len(pair) != 2 or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in pair
    ):
        raise ConfigurationError(
            f"num_workers must be an int >= 1, or a (min, max) pair of them for an elastic run, "
            f"got {num_workers!r}"
        )
    low, high = pair
    if low > high:
        raise ConfigurationError(
            f"num_workers=({low}, {high}) has min > max; pass (min, max), e.g. ({high}, {low})"
        )
    sizes = tuple(
        n for n in range(high, low - 1, -1) if not keep_global_batch_size or high % n == 0
    )
    if keep_global_batch_size and len(sizes) < 2 and low < high:
        divisor = max(n for n in range(1, high) if high % n == 0)
        raise ConfigurationError(
            f"keep_global_batch_size=True takes only worker counts that divide max={high}, and "
            f"num_workers=({low}, {high}) holds none below {high}: lower min (to {divisor} or "
            "less), or pass keep_global_batch_size=False"
        )
    return high, sizes if len(sizes) > 1 else ()


#: The least amount of a resource that Ray reserves (its resource precision).
_LEAST_RESOURCE = 0.0001


def _worker_env(worker_env: Any) -> Mapping[str, str]:
    """``worker_env`` as a dict (WorkerGroupConfig checks the names and values)."""
    if worker_env is None:
        return {}
    if not isinstance(worker_env, Mapping):
        raise ConfigurationError(
            f"worker_env must be a dict of environment variables, such as {{'A': '1'}}, got "
            f"{worker_env!r} ({type(worker_env).__name__})"
        )
    return dict(worker_env)


def _resources(
    num_cpus_per_worker: float | None,
    use_gpu: bool,
    resources_per_worker: Mapping[str, float] | None,
) -> dict[str, float]:
    """What each worker reserves: ``resources_per_worker`` merged with ``num_cpus_per_worker``
    (its ``CPU``) and ``use_gpu`` (a ``GPU``); a key that two of them set differently is refused."""
    if not isinstance(use_gpu, bool):
        raise ConfigurationError(f"use_gpu must be True or False, got {use_gpu!r}")
    if num_cpus_per_worker is not None:
        if isinstance(num_cpus_per_worker, bool) or not isinstance(
            num_cpus_per_worker, (int, float)
        ):
            raise ConfigurationError(
                f"num_cpus_per_worker must be a number > 0, got {num_cpus_per_worker!r}"
            )
        if not (math.isfinite(num_cpus_per_worker) and num_cpus_per_worker >= _LEAST_RESOURCE):
            raise ConfigurationError(
                f"num_cpus_per_worker must be a finite number > 0 (at least {_LEAST_RESOURCE}), "
                f"got {num_cpus_per_worker}; for workers without a CPU reservation pass "
                "resources_per_worker without 'CPU'"
            )
    if resources_per_worker is None:
        resources = {"CPU": float(1 if num_cpus_per_worker is None else num_cpus_per_worker)}
        if use_gpu:
            resources["GPU"] = 1.0
        return resources
    if not isinstance(resources_per_worker, Mapping):
        raise ConfigurationError(
            f"resources_per_worker must be a dict such as {{'CPU': 2, 'GPU': 1}}, "
            f"got {resources_per_worker!r}"
        )
    resources = dict(resources_per_worker)
    if num_cpus_per_worker is not None:
        if "CPU" in resources and resources["CPU"] != num_cpus_per_worker:
            raise ConfigurationError(
                f"num_cpus_per_worker={num_cpus_per_worker} and resources_per_worker="
                f"{dict(resources_per_worker)} ask for different CPUs; give the CPUs once"
            )
        resources["CPU"] = float(num_cpus_per_worker)
    if use_gpu:
        resources.setdefault("GPU", 1.0)  # a fraction given there wins
    gpus = resources.get("GPU", 0)
    if isinstance(gpus, (int, float)) and not isinstance(gpus, bool) and gpus > 1:
        raise ConfigurationError(
            f"resources_per_worker={dict(resources_per_worker)} gives each worker {gpus:g} "
            "GPUs, but a worker is one Lightning process, which trains on one device; run "
            "one worker per GPU instead: num_workers=<number of GPUs>, use_gpu=True"
        )
    return resources


@functools.cache
def _joins_a_lightning_strategy(cls: type[RayStrategyBase]) -> bool:
    try:
        return issubclass(cls, cls.lightning_strategy())
    except (NotImplementedError, AttributeError):  # a mixin, not yet joined
        return False


def _init_with_accepted_signature(cls: type[RayStrategyBase]) -> Callable[..., None]:
    """``RayStrategyBase.__init__`` for ``cls``, whose signature (what ``help``, ``inspect`` and
    LightningCLI read) lists the worker arguments and the Lightning strategy's (and its module
    wrapper's) arguments that ``cls`` accepts, not ``**strategy_kwargs`` nor the owned ones."""
    base = RayStrategyBase.__init__
    hints = {k: v for k, v in _type_hints(base).items() if k != "strategy_kwargs"}
    own = [
        p if p.name == "self" else p.replace(annotation=hints.get(p.name, Any))
        for p in inspect.signature(base).parameters.values()
        if p.kind is not p.VAR_KEYWORD
    ]
    accepted = _passed_on(cls.lightning_strategy(), cls.module_wrapper())
    hints.update({p.name: p.annotation for p in accepted})

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base(self, *args, **kwargs)

    __init__.__doc__ = base.__doc__
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    __init__.__signature__ = inspect.Signature([*own, *accepted])  # type: ignore[attr-defined]
    __init__.__annotations__ = hints
    return __init__


def _type_hints(function: Callable[..., Any]) -> dict[str, Any]:
    """``function``'s annotations as types (its module's names resolved); those that cannot be
    resolved are left out (they read as ``Any``)."""
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - a name only its module's type checking imports
        return {}


def _defaults(function: Callable[..., Any]) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _is_default(value: Any, name: str, defaults: Mapping[str, Any]) -> bool:
    if name not in defaults:
        return False
    default = defaults[name]
    return value is default or (type(value) is type(default) and bool(value == default))


def _check_strategy_kwargs(
    kwargs: Mapping[str, Any], name: str, strategy: type, module: type | None = None
) -> dict[str, Any]:
    """Returns the arguments of the Lightning ``strategy`` (and of the ``module`` wrapper it
    builds, DDP's) that change something; raises for those the strategy owns or does not know.

    An argument given with its default value is dropped: LightningCLI passes every argument it
    finds behind ``**kwargs`` with its default.
    """
    accepted = {p.name for p in _passed_on(strategy, module)}
    defaults = {
        **(_defaults(vars(module)["__init__"]) if module is not None else {}),
        **_defaults(vars(strategy)["__init__"]),
    }
    kwargs = {key: value for key, value in kwargs.items() if not _is_default(value, key, defaults)}
    for key in kwargs:
        if key in _OWNED_ARGS:
            raise ConfigurationError(
                f"{name} does not take {key}={kwargs[key]!r}: {_OWNED_ARGS[key]}"
            )
        if key not in accepted:
            raise ConfigurationError(
                f"{name} got an unknown argument {key}={kwargs[key]!r}; besides the worker "
                f"arguments it takes {', '.join(sorted(accepted))}"
            )
    return kwargs


#: Arguments of the module wrapper (DDP, FSDP) that Lightning's strategy sets itself.
_WRAPPER_ARGS_SET_BY_LIGHTNING = frozenset(
    {"self", "module", "device_ids", "device_id", "output_device", "process_group"}
)


@functools.cache
def _passed_on(strategy: type, module: type | None) -> tuple[inspect.Parameter, ...]:
    """The arguments of the Lightning ``strategy`` and of the ``module`` wrapper it builds that
    ours take and pass on (not those it owns, nor those Lightning sets on the wrapper itself), as
    keyword-only parameters with their types."""
    passed: dict[str, inspect.Parameter] = {}
    for source in [strategy] + ([] if module is None else [module]):
        init = vars(source)["__init__"]
        hints = _type_hints(init)
        for param in inspect.signature(init).parameters.values():
            variadic = param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
            left_out = param.name in _OWNED_ARGS or param.name in _WRAPPER_ARGS_SET_BY_LIGHTNING
            if variadic or left_out or param.name in passed:
                continue
            annotation = hints.get(param.name, Any)
            passed[param.name] = param.replace(kind=param.KEYWORD_ONLY, annotation=annotation)
    return tuple(passed.values())
