"""Driver side: :class:`RayStrategyBase`, what every strategy of this package adds to the Lightning
strategy it joins, with its processes run as a gang of Ray actors.

The strategy is a thin Lightning strategy: it checks its arguments in the constructor (before Ray is
touched; the checks are in :mod:`~ray_lightning_sgd._driver.arguments`), keeps them in its configs
and shows them as read-only properties, captures the precision the user asked the Trainer for,
hands the launch to its launcher (:class:`~ray_lightning_sgd._driver.launcher.RayLauncherBase`),
reads ranks and device from its cluster environment
(:class:`~ray_lightning_sgd._boundary.environment.RayEnvironmentBase`), tells Ray Tune what a trial
needs, and releases the warm workers it kept up. Everything else is Lightning's.

The three kinds of strategy (DDP, ModelParallel, FSDP) are in :mod:`~ray_lightning_sgd._driver.variants`;
the signature ``help`` and LightningCLI read is built in :mod:`~ray_lightning_sgd._driver.signature`;
the methods that run on the workers are in :mod:`ray_lightning_sgd._worker.strategy`.
``ray_lightning_sgd.pytorch_lightning`` and ``ray_lightning_sgd.lightning`` join the halves with
that namespace's Lightning strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from typing_extensions import override

from ray_lightning_sgd import _compat
from ray_lightning_sgd._backend.torch import TorchConfig
from ray_lightning_sgd._boundary.environment import RayEnvironmentBase
from ray_lightning_sgd._boundary.precision import Family, PrecisionRequest, WorkerPrecisionBase
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._driver import arguments, signature
from ray_lightning_sgd._driver.launcher import RayLauncherBase
from ray_lightning_sgd._driver.run import Run
from ray_lightning_sgd._driver.run_config import RunConfig
from ray_lightning_sgd._driver.stacks import RankStack
from ray_lightning_sgd._driver.stragglers import RankTimings
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._worker_group import cluster
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig, flag
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata
from ray_lightning_sgd.exceptions import ConfigurationError

if TYPE_CHECKING:
    from pytorch_lightning.strategies import DDPStrategy as _Base

else:
    _Base = object

_OTHER_NAMESPACE = {
    "pytorch_lightning": ("lightning.pytorch", "lightning"),
    "lightning.pytorch": ("pytorch_lightning", "pytorch_lightning"),
}


def _from_config(config: str, name: str) -> Any:
    """A read-only property: the value ``name`` of the strategy's config ``config``."""

    def read(self: Any) -> Any:
        return getattr(getattr(self, config), name)

    return property(read, doc=f"The ``{name}`` this strategy was given (read-only).")


class RayStrategyBase(_compat.ConfigureLauncher, _compat.InterceptPrecisionPlugin, _Base):
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
            progress (no batch, no stage) for this long: a deadlock or an endless loop. The
            error carries every rank's stack (``err.stacks``).
        hang_report_after_s: When no rank has made progress for this long, the driver logs
            every rank's Python stack once, and which ranks wait in a collective. None
            (default): 20 times the longest wait between two progress reports of a rank so
            far, at least 5 minutes. ``worker_stacks()`` and SIGUSR1 to the driver give the
            stacks at any time.
        checkpoint_every_n_epochs: Epochs between resume checkpoints.
        checkpoint_every_n_steps: Also write a resume checkpoint every this many optimizer
            steps, inside epochs (``fit`` resumes there, each remaining batch trained once);
            None (default): at epoch ends only.
        checkpoint_every_s: Also write a resume checkpoint at the first step boundary after
            this many seconds since the last one (rank 0's clock, agreed on by every rank);
            None (default): none by time.
        checkpoint_storage: Where the resume checkpoint goes (a local path or fsspec URI that
            every worker can reach; ``~`` is expanded on the driver, and ``fit`` checks there,
            and from rank 0's node, that the folder can be written before training); None sends
            its bytes to the driver's node. Each checkpoint is saved to the worker's local disk
            and uploaded in the background while training goes on (one upload at a time); it
            is the run's resume point once its upload is complete.
        storage_options: fsspec options of ``checkpoint_storage`` (``client_kwargs`` with an
            ``endpoint_url``, ``key``/``secret``, ``profile``, ...), used by the driver and every
            worker; never shown in logs or errors. Without them, each worker's environment
            must hold the storage's settings: the driver's ``AWS_*``, ``GOOGLE_*``/``GCS_*``
            and ``AZURE_*`` variables reach the workers of a Trainer that uses that storage.
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
        debug: Debug a hang or a crash: every worker runs with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
            (``INFO`` on torch 2.15, where ``DETAIL`` crashes DDP), ``TORCH_CPP_LOG_LEVEL=INFO``
            and, with GPUs, ``NCCL_DEBUG=INFO`` (``worker_env`` wins where it sets one of them);
            Lightning and ``torch.distributed`` log at DEBUG on every rank, and the driver writes
            each rank's output to ``<default_root_dir>/rank_logs/<call id>/rank-<R>.log`` too.
        return_weights: Load rank 0's trained weights into the driver's model after each call,
            as ``ddp``'s driver holds them (default; a model built on the meta device gets
            them too). With False the weights stay in the cluster, for models the driver's
            memory should not hold: the driver's model keeps the weights it had (or stays on
            the meta device), ``fit`` brings back no optimizer state either, and what the call
            saved comes back as always (``trainer.checkpoint_callback.best_model_path``, the
            metrics, the loggers): load the trained weights from a checkpoint, or pass
            ``ckpt_path`` to the next call.
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
        hang_report_after_s: float | None = None,
        checkpoint_every_n_epochs: int = 1,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_every_s: float | None = None,
        checkpoint_storage: str | None = None,
        storage_options: dict[str, Any] | None = None,
        run_name: str | None = None,
        keep_last: int = 2,
        resize_interval_s: float = 60,
        keep_global_batch_size: bool = False,
        driver_callbacks: list[Any] | None = None,
        ship_driver_code: bool = True,
        debug: bool = False,
        return_weights: bool = True,
        **strategy_kwargs: Any,
    ) -> None:
        self._run_config = RunConfig(
            max_failures=max_failures,
            max_preemptions=max_preemptions,
            progress_timeout_s=progress_timeout_s,
            hang_report_after_s=hang_report_after_s,
            checkpoint_every_n_epochs=checkpoint_every_n_epochs,
            checkpoint_every_n_steps=checkpoint_every_n_steps,
            checkpoint_every_s=checkpoint_every_s,
            checkpoint_storage=checkpoint_storage,
            storage_options=storage_options,
            run_name=run_name,
            keep_last=keep_last,
            resize_interval_s=resize_interval_s,
        )
        self._driver_callbacks = arguments.check_driver_callbacks(driver_callbacks, self.flavour)
        self._reuse_workers = flag("reuse_workers", reuse_workers)
        self._debug = flag("debug", debug)
        self._return_weights = flag("return_weights", return_weights)
        strategy_kwargs = arguments.check_strategy_kwargs(
            strategy_kwargs, type(self).__name__, self.lightning_strategy(), self.module_wrapper()
        )
        self._keep_global_batch_size = flag("keep_global_batch_size", keep_global_batch_size)
        most, sizes = arguments.worker_sizes(num_workers, keep_global_batch_size)
        self._worker_group_config = WorkerGroupConfig(
            num_workers=most,
            sizes=sizes,
            resources_per_worker=arguments.resources(
                num_cpus_per_worker, use_gpu, resources_per_worker
            ),
            placement_strategy=placement_strategy,
            worker_env=arguments.worker_env(worker_env, debug, use_gpu),
            init_hook=init_hook,
            startup_timeout_s=startup_timeout_s,
            ship_driver_code=ship_driver_code,
        )
        self._backend_config = backend_config = arguments.backend_config(
            backend_config, self._worker_group_config.use_gpu
        )
        self._precision_request: PrecisionRequest | None = None
        self._check_workers()
        self._check_strategy_kwargs(strategy_kwargs)
        try:
            super().__init__(
                process_group_backend=backend_config.backend,
                timeout=timedelta(seconds=backend_config.timeout_s),
                **strategy_kwargs,
            )
        except ConfigurationError:
            raise
        except Exception as err:  # what Lightning's constructor refuses, said so
            given = ", ".join(f"{key}={value!r}" for key, value in strategy_kwargs.items())
            raise ConfigurationError(
                f"{type(self).__name__}: Lightning's {self.lightning_strategy().__name__} "
                f"refuses {given or 'its arguments'}: {type(err).__name__}: {err}"
            ) from err
        self.cluster_environment = self.environment_class(most)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inherits = cls.__module__ != __name__ and cls.__init__ is RayStrategyBase.__init__
        if inherits and signature.joins_a_lightning_strategy(cls):
            cls.__init__ = signature.init_with_accepted_signature(  # type: ignore[method-assign]
                cls, RayStrategyBase.__init__
            )

    @classmethod
    def lightning_strategy(cls) -> type:
        """The Lightning strategy class this one joins, in the class's namespace."""
        raise NotImplementedError

    @classmethod
    def module_wrapper(cls) -> type | None:
        """torch's wrapper of the model that takes the arguments the Lightning strategy passes on
        (``DistributedDataParallel``, ``FullyShardedDataParallel``), if any."""
        return None

    def _check_workers(self) -> None:
        """Raises for worker settings that this kind of strategy cannot run."""

    def tensor_parallel_size(self, metadata: Sequence[WorkerMetadata] = ()) -> int | None:
        """The tensor-parallel size the workers take where ``metadata`` placed them; None while
        it depends on where they land ("auto") and they are not placed. 1 but for
        ``RayModelParallelStrategy``."""
        return 1

    def check_placed(self, metadata: Sequence[WorkerMetadata]) -> None:
        """Driver side, once an attempt's workers are placed (``metadata`` in rank order):
        raises for settings that cannot train where they landed."""

    def _check_strategy_kwargs(self, strategy_kwargs: dict[str, Any]) -> None:
        """Raises for values of the Lightning strategy's own arguments (those given, not left
        at their defaults) that it would refuse only later, or on the workers."""

    # Lightning's accelerator connector reads the strategy's precision plugin while it parses the
    # Trainer's arguments, right after it has the user's precision, and before it adapts the
    # precision to the driver's machine (16-mixed becomes bf16-mixed on a driver without GPUs):
    # the moment to keep what the user asked for, which each worker resolves for its own hardware
    @override
    def read_precision_plugin(self, own: Any, parsed: tuple[Any, Any, Any] | None) -> Any:
        if parsed is None:
            return own
        precision, plugin, accelerator = parsed
        if not isinstance(accelerator, str):  # an Accelerator instance
            name = type(accelerator).__name__
            accelerator = {"CPUAccelerator": "cpu", "CUDAAccelerator": "cuda"}.get(name, name)
        self._precision_request = PrecisionRequest(
            str(precision), plugin or own, accelerator,
            made_without_cuda=not torch.cuda.is_available(),
        )  # fmt: skip
        # FSDP's connector branch builds its own plugin from the precision as asked, before
        # Lightning adapts a precision to a CPU machine, and FSDP refuses any other plugin
        stand_in = self.precision_family == "general" and self._worker_group_config.use_gpu
        if own is None and plugin is None and stand_in:
            # the driver keeps a stand-in: it names the precision, the GPU workers build the plugin
            return self.precision_class(str(precision))
        return own

    @property
    def precision_request(self) -> PrecisionRequest:
        """The precision the user asked the Trainer for, which each worker resolves for its own
        hardware (see :mod:`ray_lightning_sgd._boundary.precision`)."""
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
    max_failures = _from_config("_run_config", "max_failures")
    max_preemptions = _from_config("_run_config", "max_preemptions")
    progress_timeout_s = _from_config("_run_config", "progress_timeout_s")
    hang_report_after_s = _from_config("_run_config", "hang_report_after_s")
    checkpoint_every_n_epochs = _from_config("_run_config", "checkpoint_every_n_epochs")
    checkpoint_every_n_steps = _from_config("_run_config", "checkpoint_every_n_steps")
    checkpoint_every_s = _from_config("_run_config", "checkpoint_every_s")
    checkpoint_storage = _from_config("_run_config", "checkpoint_storage")
    storage_options = _from_config("_run_config", "storage_options")
    run_name = _from_config("_run_config", "run_name")
    keep_last = _from_config("_run_config", "keep_last")
    resize_interval_s = _from_config("_run_config", "resize_interval_s")

    @property
    def keep_global_batch_size(self) -> bool:
        """Whether an elastic run scales ``accumulate_grad_batches`` to keep the global batch."""
        return self._keep_global_batch_size

    @property
    def world_sizes(self) -> dict[int, int]:
        """Driver side: how many workers trained each epoch of the latest ``fit`` (an elastic
        run's size changes between epochs); empty before any ``fit``."""
        run = self._last_run()
        return dict(run.world_sizes) if run is not None else {}

    @property
    def rank_timings(self) -> list[RankTimings]:
        """Driver side: each rank's training steps in the latest call (its last attempt): steps
        timed, median time of a step's own work and waiting for data, and its node; the driver
        logs them at the call's end (logger ``ray_lightning_sgd``, INFO). Empty before any."""
        run = self._last_run()
        return list(run.rank_timings) if run is not None else []

    def _last_run(self) -> Run | None:
        """Driver side: the latest launch's state; None before any."""
        return self.launcher.run if isinstance(self.launcher, RayLauncherBase) else None

    def worker_stacks(self, timeout_s: float = 10.0) -> list[RankStack]:
        """Driver side, from any thread while a call runs (a callback on the driver, a timer):
        every rank's Python stack of its training thread now, each with its node, its last
        progress (stage and step) and the Lightning hook it is in; ``str()`` of each is what a
        person reads. [] when no call runs. The same report goes to stderr when the driver
        process receives SIGUSR1 (``kill -USR1 <driver pid>``)."""
        launcher = self.launcher
        if not isinstance(launcher, RayLauncherBase):
            return []
        return launcher.worker_stacks(timeout_s)

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
    def run_config(self) -> RunConfig:
        """The run's settings: restarts, the progress timeout, resume checkpoints and their
        storage, the run's name, the elastic resize interval (read-only)."""
        return self._run_config

    @property
    def failure_config(self) -> RunConfig:
        """The same as :attr:`run_config` (its earlier name)."""
        return self._run_config

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
        head = arguments.check_head_bundle(head_bundle)
        config = self._worker_group_config
        cluster.connect()
        cluster.check_placement_is_possible(
            config.resources_per_worker, config.num_workers, config.placement_strategy, head
        )
        bundles = [head]
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

    @property
    def debug(self) -> bool:
        """Whether the workers log in detail and the driver keeps each rank's output in a file."""
        return self._debug

    @property
    def return_weights(self) -> bool:
        """Whether the trained weights come back into the driver's model after each call."""
        return self._return_weights

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

    def make_launcher(self) -> RayLauncherBase:
        """Returns the launcher Lightning uses for this strategy."""
        return self.launcher_class(self)
