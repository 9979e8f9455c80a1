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

import functools
import inspect
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
from ray_lightning_sgd._worker.hardware import PrecisionRequest, WorkerPrecisionBase
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

# DDPStrategy arguments that this strategy decides itself, and what to use instead
_OWNED_DDP_ARGS = {
    "cluster_environment": "the strategy brings its own RayEnvironment",
    "parallel_devices": "use num_workers and use_gpu",
    "start_method": "Ray starts the workers",
    "process_group_backend": "use backend_config=TorchConfig(backend=...)",
    "timeout": "use backend_config=TorchConfig(timeout_s=...)",
}
_DDP_MODULE_ARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "output_device",
    "process_group",
}


class RaySGDStrategyBase(_compat.ConfigureLauncher, _Base):
    """Distributed data parallel training on a gang of Ray actors.

    Args:
        num_workers: Number of workers (training processes), each a Ray actor.
        num_cpus_per_worker: CPUs each worker reserves.
        use_gpu: Give each worker one GPU (NCCL instead of gloo). The driver needs no GPU: each
            worker resolves the Trainer's precision for its own device.
        resources_per_worker: Ray resources each worker reserves (``CPU``, ``GPU`` with fractions
            allowed, at most one), custom resources; overrides ``num_cpus_per_worker`` and
            ``use_gpu``.
        placement_strategy: How the placement group spreads the workers over nodes: PACK, SPREAD,
            STRICT_PACK or STRICT_SPREAD.
        backend_config: The process group's backend, init method and timeout.
        init_hook: A function run on every worker after it starts, before training.
        worker_env: Environment variables set in every worker process.
        startup_timeout_s: How long to wait for the cluster to place and start the workers.
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
        progress_timeout_s: Raise ``WorkerTimeoutError`` naming the rank when a rank makes no
            progress (no batch, no stage) for this long: a deadlock or an endless loop.
        checkpoint_every_n_epochs: Epochs between resume checkpoints.
        checkpoint_storage: Where the resume checkpoint goes (a local path or fsspec URI that
            every worker can reach); None sends its bytes to the driver's node.
        driver_callbacks: Callbacks that run on the driver while the workers train, called with
            rank 0's live events: setup and teardown, each stage's and epoch's start and end,
            and each batch (``outputs`` and ``batch`` are None; ``trainer`` shows rank 0's
            epoch, step, batch counts and latest metrics). The Trainer's progress bar runs the
            same way; callbacks given to the Trainer run on the workers, as in Lightning's DDP.
        **ddp_kwargs: Passed to :class:`torch.nn.parallel.DistributedDataParallel`
            (``find_unused_parameters``, ``bucket_cap_mb``, ``static_graph``, ...) or to
            :class:`~pytorch_lightning.strategies.DDPStrategy` (``ddp_comm_hook``, ...).
    """

    strategy_name = "ray_sgd"
    #: The Lightning namespace of this class, and the launcher and environment classes it uses.
    flavour: ClassVar[Flavour]
    environment_class: ClassVar[type[RayEnvironmentBase]]
    launcher_class: ClassVar[type[RayLauncherBase]]
    precision_class: ClassVar[type[WorkerPrecisionBase]]

    def __init__(
        self,
        num_workers: int = 1,
        *,
        num_cpus_per_worker: float = 1,
        use_gpu: bool = False,
        resources_per_worker: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        backend_config: TorchConfig | None = None,
        init_hook: Callable[[], None] | None = None,
        worker_env: dict[str, str] | None = None,
        startup_timeout_s: float = 60,
        reuse_workers: bool = True,
        max_failures: int = 0,
        progress_timeout_s: float | None = None,
        checkpoint_every_n_epochs: int = 1,
        checkpoint_storage: str | None = None,
        driver_callbacks: list[Any] | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        self._failure_config = FailureConfig(
            max_failures=max_failures,
            progress_timeout_s=progress_timeout_s,
            checkpoint_every_n_epochs=checkpoint_every_n_epochs,
            checkpoint_storage=checkpoint_storage,
        )
        self._driver_callbacks = list(driver_callbacks or [])
        for callback in self._driver_callbacks:
            if not isinstance(callback, self.flavour.callback):
                raise ConfigurationError(
                    f"driver_callbacks takes {self.flavour.namespace} Callbacks, got "
                    f"{callback!r}; subclass {self.flavour.namespace}.callbacks.Callback"
                )
        if not isinstance(reuse_workers, bool):
            raise ConfigurationError(f"reuse_workers must be True or False, got {reuse_workers!r}")
        backend_config = TorchConfig() if backend_config is None else backend_config
        if not isinstance(backend_config, TorchConfig):
            raise ConfigurationError(
                f"backend_config must be a TorchConfig, got {type(backend_config).__name__}"
            )
        ddp_kwargs = _check_ddp_kwargs(ddp_kwargs, self.flavour.ddp_strategy)
        self._worker_group_config = WorkerGroupConfig(
            num_workers=num_workers,
            resources_per_worker=_resources(num_cpus_per_worker, use_gpu, resources_per_worker),
            placement_strategy=placement_strategy,
            worker_env=dict(worker_env or {}),
            init_hook=init_hook,
            startup_timeout_s=startup_timeout_s,
        )
        self._backend_config = backend_config
        self._reuse_workers = reuse_workers
        self._precision_request: PrecisionRequest | None = None
        super().__init__(
            cluster_environment=self.environment_class(num_workers),
            process_group_backend=backend_config.backend,
            timeout=timedelta(seconds=backend_config.timeout_s),
            **ddp_kwargs,
        )

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
        if not isinstance(accelerator, str):
            accelerator = type(accelerator).__name__
        self._precision_request = PrecisionRequest(str(precision), plugin or own, accelerator)
        if own is None and plugin is None and self._worker_group_config.use_gpu:
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

    def __enter__(self) -> RaySGDStrategyBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown_workers()

    def __repr__(self) -> str:
        # Lightning shows this when a Trainer of the other namespace refuses the strategy
        namespace = self.flavour.namespace
        other_namespace, other_module = _OTHER_NAMESPACE[namespace]
        return (
            f"{type(self).__module__}.RaySGDStrategy(num_workers="
            f"{self._worker_group_config.num_workers}), for a {namespace}.Trainer (a "
            f"{other_namespace}.Trainer takes ray_lightning_sgd.{other_module}.RaySGDStrategy)"
        )

    @property
    def ray_environment(self) -> RayEnvironmentBase:
        """The cluster environment that holds this worker's rank and device."""
        if not isinstance(self.cluster_environment, RayEnvironmentBase):
            raise TypeError(
                "RaySGDStrategy needs its own cluster environment (RayEnvironment), got "
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
            raise ConfigurationError(
                f"Trainer(num_nodes={num_nodes}) conflicts with RaySGDStrategy: Ray places the "
                "workers on nodes. Remove num_nodes and set RaySGDStrategy(num_workers=...) to the "
                "total number of workers"
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def set_world_ranks(self) -> None:
        # the ranks were assigned by the worker group and are already in the environment
        self.flavour.rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def make_launcher(self) -> RayLauncherBase:
        """Returns the launcher Lightning uses for this strategy."""
        return self.launcher_class(self)


def _resources(
    num_cpus_per_worker: float, use_gpu: bool, resources_per_worker: Mapping[str, float] | None
) -> dict[str, float]:
    if not isinstance(use_gpu, bool):
        raise ConfigurationError(f"use_gpu must be True or False, got {use_gpu!r}")
    if resources_per_worker is not None:
        if not isinstance(resources_per_worker, Mapping):
            raise ConfigurationError(
                f"resources_per_worker must be a dict such as {{'CPU': 2, 'GPU': 1}}, "
                f"got {resources_per_worker!r}"
            )
        if use_gpu and "GPU" not in resources_per_worker:
            raise ConfigurationError(
                f"use_gpu=True but resources_per_worker={dict(resources_per_worker)} asks for no "
                "GPU; add 'GPU': 1 (or a fraction) to resources_per_worker"
            )
        gpus = resources_per_worker.get("GPU", 0)
        if isinstance(gpus, (int, float)) and gpus > 1:
            raise ConfigurationError(
                f"resources_per_worker={dict(resources_per_worker)} gives each worker {gpus:g} "
                "GPUs, but a worker is one Lightning DDP process, which trains on one device; "
                "run one worker per GPU instead: RaySGDStrategy(num_workers=<number of GPUs>, "
                "use_gpu=True)"
            )
        return dict(resources_per_worker)
    if isinstance(num_cpus_per_worker, bool) or not isinstance(num_cpus_per_worker, (int, float)):
        raise ConfigurationError(
            f"num_cpus_per_worker must be a number > 0, got {num_cpus_per_worker!r}"
        )
    if not num_cpus_per_worker > 0:
        raise ConfigurationError(
            f"num_cpus_per_worker must be > 0, got {num_cpus_per_worker}; for workers without "
            "a CPU reservation pass resources_per_worker without 'CPU'"
        )
    resources = {"CPU": float(num_cpus_per_worker)}
    if use_gpu:
        resources["GPU"] = 1.0
    return resources


@functools.cache
def _ddp_strategy_args(ddp_strategy: type) -> frozenset[str]:
    init = vars(ddp_strategy)["__init__"]
    return frozenset(inspect.signature(init).parameters) - {"self", "kwargs"}


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


def _check_ddp_kwargs(ddp_kwargs: Mapping[str, Any], ddp_strategy: type) -> dict[str, Any]:
    """Returns the DDP arguments that change something; raises for those the strategy owns.

    An argument given with its default value is dropped: LightningCLI passes every argument it
    finds behind ``**ddp_kwargs`` (DDPStrategy's and DistributedDataParallel's) with its default.
    """
    defaults = {
        **_defaults(DistributedDataParallel.__init__),
        **_defaults(vars(ddp_strategy)["__init__"]),
    }
    ddp_kwargs = {
        name: value for name, value in ddp_kwargs.items() if not _is_default(value, name, defaults)
    }
    for name in ddp_kwargs:
        if name in _OWNED_DDP_ARGS:
            raise ConfigurationError(
                f"RaySGDStrategy does not take {name}={ddp_kwargs[name]!r}: {_OWNED_DDP_ARGS[name]}"
            )
        if name not in _ddp_strategy_args(ddp_strategy) and name not in _DDP_MODULE_ARGS:
            raise ConfigurationError(
                f"RaySGDStrategy got an unknown argument {name}={ddp_kwargs[name]!r}; extra "
                "arguments go to DistributedDataParallel, which takes "
                f"{', '.join(sorted(_DDP_MODULE_ARGS))}"
            )
    return ddp_kwargs
