"""Driver side: the checks of a strategy's arguments, run in its constructor before Ray is touched.

Pure functions over the values given, each raising :class:`~ray_lightning_sgd.exceptions.ConfigurationError`
with what was received and the fix: the number and sizes of the workers, what each reserves, their
environment, the driver callbacks, the flags, the settings a kind of strategy cannot run, and the
Lightning strategy's own arguments (``**strategy_kwargs``), which are checked against what the
Lightning strategy and its module wrapper accept (:func:`passed_on`, which
:mod:`~ray_lightning_sgd._driver.signature` also shows in the strategies' signatures).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ray_lightning_sgd._backend.torch import TorchConfig
from ray_lightning_sgd._boundary.environment import DEBUG_ENV
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._worker_group.config import LEAST_RESOURCE, flag, resource_problem
from ray_lightning_sgd.exceptions import ConfigurationError

# Lightning strategy arguments that these strategies decide themselves, and what to use instead
OWNED_ARGS = {
    "cluster_environment": "the strategy brings its own RayEnvironment",
    "parallel_devices": "use num_workers and use_gpu",
    "start_method": "Ray starts the workers",
    "process_group_backend": "use backend_config=TorchConfig(backend=...)",
    "timeout": "use backend_config=TorchConfig(timeout_s=...)",
    "accelerator": "use use_gpu=True for GPU workers (the driver needs none)",
}


def backend_config(config: Any, use_gpu: bool) -> TorchConfig:
    """``backend_config``, a :class:`TorchConfig` (the default one for None); NCCL only for GPU
    workers."""
    config = TorchConfig() if config is None else config
    if not isinstance(config, TorchConfig):
        kind = type(config)
        raise ConfigurationError(
            f"backend_config must be ray_lightning_sgd's TorchConfig, got {config!r} "
            f"({kind.__module__}.{kind.__qualname__}); pass "
            "backend_config=ray_lightning_sgd.TorchConfig(backend=..., timeout_s=...)"
        )
    if config.backend == "nccl" and not use_gpu:
        raise ConfigurationError(
            "backend_config=TorchConfig(backend='nccl') runs on GPU workers only, and these "
            "workers have no GPU: pass use_gpu=True (or GPUs in resources_per_worker), or "
            "backend='gloo' for CPU workers"
        )
    return config


def check_driver_callbacks(callbacks: Any, flavour: Flavour) -> list[Any]:
    """``driver_callbacks`` as a list; raises unless it is a list (or tuple) of Callbacks of
    the strategy's Lightning namespace (``flavour``)."""
    if callbacks is None:
        return []
    expected = flavour.callback
    namespace = flavour.namespace
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
    trains = _training_callbacks(namespace)
    for callback in callbacks:
        if not isinstance(callback, expected):
            raise ConfigurationError(
                f"driver_callbacks takes {namespace} Callbacks, got "
                f"{callback!r}; subclass {namespace}.callbacks.Callback"
            )
        if isinstance(callback, trains):
            raise ConfigurationError(
                f"driver_callbacks cannot hold {type(callback).__name__}: a driver callback "
                "sees rank 0's events, not the model or the training, which stay on the "
                "workers (it would save the driver's untrained model, or stop nothing); pass "
                "it to the Trainer (Trainer(callbacks=[...])): it runs on rank 0 as under ddp, "
                "and its state (best_model_path, ...) comes back to the driver's Trainer"
            )
    return list(callbacks)


def _training_callbacks(namespace: str) -> tuple[type, ...]:
    """Lightning's callbacks that act on the model or on the training (save it, stop it,
    change it), which the driver's view of rank 0's events cannot do."""
    module = importlib.import_module(f"{namespace}.callbacks")
    names = (
        "Checkpoint", "EarlyStopping", "BaseFinetuning", "StochasticWeightAveraging",
        "GradientAccumulationScheduler", "BatchSizeFinder", "LearningRateFinder", "ModelPruning",
    )  # fmt: skip
    return tuple(kind for kind in (getattr(module, name, None) for name in names) if kind)


def worker_sizes(num_workers: Any, keep_global_batch_size: bool) -> tuple[int, tuple[int, ...]]:
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


def worker_env(worker_env: Any, debug: bool = False, use_gpu: bool = False) -> Mapping[str, str]:
    """``worker_env`` as a dict (WorkerGroupConfig checks the names and values), over the
    variables ``debug`` sets on every worker (those ``worker_env`` sets win)."""
    if worker_env is None:
        worker_env = {}
    if not isinstance(worker_env, Mapping):
        raise ConfigurationError(
            f"worker_env must be a dict of environment variables, such as {{'A': '1'}}, got "
            f"{worker_env!r} ({type(worker_env).__name__})"
        )
    if not debug:
        return dict(worker_env)
    detail = {
        DEBUG_ENV: "1",
        "TORCH_DISTRIBUTED_DEBUG": distributed_debug_level(),
        "TORCH_CPP_LOG_LEVEL": "INFO",
        **({"NCCL_DEBUG": "INFO"} if use_gpu else {}),
    }
    return {**detail, **worker_env}


def resources(
    num_cpus_per_worker: float | None,
    use_gpu: bool,
    resources_per_worker: Mapping[str, float] | None,
) -> dict[str, float]:
    """What each worker reserves: ``resources_per_worker`` merged with ``num_cpus_per_worker``
    (its ``CPU``) and ``use_gpu`` (a ``GPU``); a key that two of them set differently is refused."""
    flag("use_gpu", use_gpu)
    if num_cpus_per_worker is not None:
        if isinstance(num_cpus_per_worker, bool) or not isinstance(
            num_cpus_per_worker, (int, float)
        ):
            raise ConfigurationError(
                f"num_cpus_per_worker must be a number > 0, got {num_cpus_per_worker!r}"
            )
        if not (math.isfinite(num_cpus_per_worker) and num_cpus_per_worker >= LEAST_RESOURCE):
            raise ConfigurationError(
                f"num_cpus_per_worker must be a finite number > 0 (at least {LEAST_RESOURCE}), "
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
    for key in resources:
        if isinstance(key, str) and key.upper() in ("CPU", "GPU") and key != key.upper():
            raise ConfigurationError(
                f"resources_per_worker={dict(resources_per_worker)} names {key!r}; Ray's "
                f"resource names are case-sensitive, and {key!r} would be a custom resource no "
                f"node has: write {key.upper()!r}"
            )
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


def type_hints(function: Callable[..., Any]) -> dict[str, Any]:
    """``function``'s annotations as types (its module's names resolved); those that cannot be
    resolved are left out (they read as ``Any``)."""
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - a name only its module's type checking imports
        return {}


#: Arguments of a module wrapper that the Lightning strategy sets itself when they are not
#: given (not the wrapper's own default): their default here, so that the other value, given,
#: is passed on, and LightningCLI shows what a run uses.
_LIGHTNING_SETS: dict[str, dict[str, Any]] = {
    "FSDPStrategy": {"use_orig_params": True},  # its kwargs.setdefault("use_orig_params", True)
}


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


def check_strategy_kwargs(
    kwargs: Mapping[str, Any], name: str, strategy: type, module: type | None = None
) -> dict[str, Any]:
    """Returns the arguments of the Lightning ``strategy`` (and of the ``module`` wrapper it
    builds, DDP's) that change something; raises for those the strategy owns or does not know.

    An argument given with its default value is dropped: LightningCLI passes every argument it
    finds behind ``**kwargs`` with its default.
    """
    defaults = {
        **(_defaults(vars(module)["__init__"]) if module is not None else {}),
        **_defaults(vars(strategy)["__init__"]),
        **_LIGHTNING_SETS.get(strategy.__name__, {}),
    }
    kwargs = {key: value for key, value in kwargs.items() if not _is_default(value, key, defaults)}
    params = {p.name: p for p in passed_on(strategy, module)}
    for key, value in kwargs.items():
        if key in OWNED_ARGS:
            raise ConfigurationError(f"{name} does not take {key}={value!r}: {OWNED_ARGS[key]}")
        if key not in params:
            raise ConfigurationError(
                f"{name} got an unknown argument {key}={value!r}; besides the worker "
                f"arguments it takes {', '.join(sorted(params))}"
            )
        wanted = _TAKES.get(key) or _what_it_takes(params[key].annotation, defaults.get(key))
        if wanted is not None and not wanted[0](value):
            raise ConfigurationError(
                f"{name} takes {key} as {wanted[1]}, got {value!r} ({type(value).__name__})"
            )
    return kwargs


#: Arguments passed on whose annotations do not say what they take (torch's DDP has none).
_TAKES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bucket_cap_mb": (
        lambda v: v is None or (_is_number(v) and math.isfinite(v) and v > 0),
        "a number of MB > 0",
    ),
    "model_averaging_period": (
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        "an int >= 1",
    ),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _what_it_takes(annotation: Any, default: Any) -> tuple[Callable[[Any], bool], str] | None:
    """A test of a value for an argument passed on, and its description; None: not known (such
    a value goes to Lightning as it is)."""
    parts = _simple_types(annotation)
    if parts is None:  # no annotation that says: the default's kind, when a flag or a number
        if isinstance(default, bool):
            return (lambda v: isinstance(v, bool)), "True or False"
        if _is_number(default):
            return (lambda v: _is_number(v) and math.isfinite(v)), "a finite number"
        return None
    names = []
    for part in parts:
        if isinstance(part, tuple):
            names.append(" or ".join(repr(choice) for choice in part))
        else:
            names.append({type(None): "None"}.get(part, getattr(part, "__name__", str(part))))
    return (lambda v: any(_takes(part, v) for part in parts)), " or ".join(names)


def _takes(part: Any, value: Any) -> bool:
    if isinstance(part, tuple):  # a Literal's choices
        return any(value == choice and type(value) is type(choice) for choice in part)
    if part is callable:
        return callable(value)
    if part is bool:
        return isinstance(value, bool)
    if part in (int, float):
        integral = isinstance(value, int) and not isinstance(value, bool)
        return integral or (part is float and isinstance(value, float) and math.isfinite(value))
    return isinstance(value, part)


def _simple_types(annotation: Any) -> list[Any] | None:
    """``annotation`` as the classes (a Literal as a tuple of its choices, a Callable as
    ``callable``) whose values it takes; None where it is anything else (Any, generics)."""
    import collections.abc
    import types

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts: list[Any] = []
        for arg in typing.get_args(annotation):
            inner = _simple_types(arg)
            if inner is None:
                return None
            parts.extend(inner)
        return parts
    if origin is typing.Literal:
        return [typing.get_args(annotation)]
    if annotation is collections.abc.Callable or origin is collections.abc.Callable:
        return [callable]
    if annotation is type(None) or annotation is None:
        return [type(None)]
    if annotation in (Any, object):
        return None
    if isinstance(annotation, type) and origin is None:
        return [annotation]
    return None


#: Arguments of the module wrapper (DDP, FSDP) that Lightning's strategy sets itself.
_WRAPPER_ARGS_SET_BY_LIGHTNING = frozenset(
    {"self", "module", "device_ids", "device_id", "output_device", "process_group"}
)


@functools.cache
def passed_on(strategy: type, module: type | None) -> tuple[inspect.Parameter, ...]:
    """The arguments of the Lightning ``strategy`` and of the ``module`` wrapper it builds that
    ours take and pass on (not those it owns, nor those Lightning sets on the wrapper itself), as
    keyword-only parameters with their types."""
    passed: dict[str, inspect.Parameter] = {}
    for source in [strategy] + ([] if module is None else [module]):
        init = vars(source)["__init__"]
        hints = type_hints(init)
        for param in inspect.signature(init).parameters.values():
            variadic = param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
            left_out = param.name in OWNED_ARGS or param.name in _WRAPPER_ARGS_SET_BY_LIGHTNING
            if variadic or left_out or param.name in passed:
                continue
            annotation = hints.get(param.name, Any)
            param = param.replace(kind=param.KEYWORD_ONLY, annotation=annotation)
            sets = _LIGHTNING_SETS.get(strategy.__name__, {})
            if param.name in sets:
                param = param.replace(default=sets[param.name])
            passed[param.name] = param
    return tuple(passed.values())


def distributed_debug_level() -> str:
    """What the debug switch sets ``TORCH_DISTRIBUTED_DEBUG`` to: ``DETAIL`` (every collective
    checked across ranks before it runs), but ``INFO`` on torch 2.15, where ``DETAIL`` makes the
    construction of DistributedDataParallel end the process (SIGSEGV in
    ``c10d::Logger::set_env_variables``; two plain gloo processes without Ray do the same)."""
    import torch
    from packaging.version import Version

    return "INFO" if Version(torch.__version__).release[:2] == (2, 15) else "DETAIL"


def check_head_bundle(head_bundle: Any) -> dict[str, float]:
    """``tune_resources``'s ``head_bundle`` as a dict of Ray resources (None: {}); raises
    unless it maps resource names to amounts Ray takes."""
    if head_bundle is None:
        return {}
    fix = "for example head_bundle={'CPU': 1}, or None for a trial process that only waits"
    if not isinstance(head_bundle, Mapping):
        raise ConfigurationError(
            f"head_bundle must be a dict of Ray resources, got {head_bundle!r}; {fix}"
        )
    for name, amount in head_bundle.items():
        problem = resource_problem("head_bundle", name, amount)
        if problem is not None:
            raise ConfigurationError(f"{problem}; {fix}")
        if name.lower() in ("cpu", "gpu") and name != name.upper():
            raise ConfigurationError(
                f"head_bundle names {name!r}: Ray's resource is {name.upper()!r} (names are "
                f"case-sensitive); {fix}"
            )
    return {name: float(amount) for name, amount in head_bundle.items()}
