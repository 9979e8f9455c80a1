"""Every constructor argument, with values of the wrong type, range and shape: each is refused with
a ConfigurationError that names the argument, before Ray is touched. Pure logic, no cluster."""

from __future__ import annotations

import inspect
import math
import pathlib
from datetime import timedelta

import pytest
import ray
import ray.util
from pytorch_lightning.callbacks import Callback

from ray_lightning_sgd import ConfigurationError, TorchConfig
from ray_lightning_sgd._driver.strategy import RayStrategyBase
from ray_lightning_sgd.pytorch_lightning import (
    RayFSDPStrategy,
    RayModelParallelStrategy,
    RaySGDStrategy,
)

NAN, INF = math.nan, math.inf

#: (argument, bad value) for every worker argument of the strategies. A value of the wrong type
#: (a bool where an int goes, a str where a list goes), out of range (NaN, inf, negative, zero,
#: too large for a timeout) or of the wrong shape (a single item for a list, a str for a dict).
BAD_ARGUMENTS: list[tuple[str, object]] = [
    *[("num_workers", v) for v in (0, -1, 1.5, "2", True, None, NAN, (2,), (1, 2, 3), (2, 1))],
    *[("num_workers", v) for v in ((0, 2), (1.0, 2), (True, 2), [1, "2"], {1: 2})],
    *[("num_cpus_per_worker", v) for v in (0, -1, NAN, INF, -INF, "2", True, [1], 1e-9)],
    *[("use_gpu", v) for v in (1, "yes", None, 1.0)],
    *[("resources_per_worker", v) for v in ("CPU=1", [("CPU", 1)], {"CPU": -1}, {"CPU": 0})],
    *[("resources_per_worker", v) for v in ({"CPU": NAN}, {"CPU": INF}, {"GPU": 2})],
    *[("resources_per_worker", v) for v in ({"GPU": 1.5}, {1: 1}, {"": 1}, {"CPU": "1"})],
    *[("resources_per_worker", v) for v in ({"CPU": True}, {"CPU": None}, {"GPU": 0})],
    *[("resources_per_worker", v) for v in ({"cpu": 2}, {"gpu": 1}, {"Gpu": 1})],
    *[("placement_strategy", v) for v in ("pack", "", None, 1, ["PACK"], "SPREAD ")],
    *[("backend_config", v) for v in ("nccl", {}, 1, TorchConfig)],
    *[("init_hook", v) for v in (1, "print", [print], lambda x: x)],
    *[("worker_env", v) for v in ("A=1", [("A", "1")], 5, {"A": 1}, {1: "a"}, {"A": None})],
    *[("worker_env", v) for v in ({"": "1"}, {"A=B": "1"}, {"A\0": "1"}, {"A": "1\0"})],
    *[("startup_timeout_s", v) for v in (0, -1, NAN, INF, 1e15, "60", True, None)],
    *[("reuse_workers", v) for v in (1, "no", None)],
    *[("max_failures", v) for v in (-2, 1.5, "1", True, None, NAN)],
    *[("max_preemptions", v) for v in (-2, 1.0, "x", False)],
    *[("progress_timeout_s", v) for v in (0, -5, NAN, INF, 1e15, "10", True)],
    *[("hang_report_after_s", v) for v in (0, -5, NAN, INF, 1e15, "10", True)],
    *[("checkpoint_every_n_epochs", v) for v in (0, -1, 1.5, True, "1", None)],
    *[("checkpoint_storage", v) for v in ("", "   ", 1, b"/tmp", ["x"], "s4://b/x", "a\0b")],
    *[("checkpoint_storage", v) for v in ("s3:/bucket/runs", "gs:bucket", "file:/tmp/runs")],
    *[("checkpoint_every_n_steps", v) for v in (0, -1, 1.5, True, "10")],
    *[("checkpoint_every_s", v) for v in (0, -5, NAN, INF, 1e15, "60", True)],
    # not a dict of str keys; and options without the checkpoint_storage they are options of
    *[("storage_options", v) for v in ("key=x", [("key", "x")], {1: "x"}, {"key": "x"})],
    *[("run_name", v) for v in ("", ".hidden", "a/b", 1, "x" * 200, "a b")],
    *[("keep_last", v) for v in (0, -1, 1.5, True, "2", None)],
    *[("resize_interval_s", v) for v in (0, NAN, INF, 1e15, "60", True, None)],
    *[("keep_global_batch_size", v) for v in (1, "yes", None)],
    *[("driver_callbacks", v) for v in (Callback(), "cb", [1], [None], [Callback], 5)],
    *[("driver_callbacks", v) for v in ({"a": Callback()},)],
    *[("ship_driver_code", v) for v in (1, "yes", None)],
    *[("debug", v) for v in (1, "yes", None)],
    *[("return_weights", v) for v in (0, "no", None)],
]

#: (strategy, what it needs besides, argument, bad value) for the Lightning strategies' own
#: arguments (``**strategy_kwargs``), which are passed on: refused on the driver too, not by
#: Lightning or torch on every worker (or taken as something else: "no" is true).
BAD_PASSED_ON: list[tuple[type, dict, str, object]] = [
    *[(RaySGDStrategy, {}, "find_unused_parameters", v) for v in ("no", 1, None)],
    *[(RaySGDStrategy, {}, "static_graph", v) for v in (1, "yes")],
    *[(RaySGDStrategy, {}, "gradient_as_bucket_view", v) for v in (5, "x")],
    *[(RaySGDStrategy, {}, "bucket_cap_mb", v) for v in ("x", 0, -1, NAN, INF, True)],
    *[(RaySGDStrategy, {}, "ddp_comm_hook", v) for v in ("x", 1)],
    *[(RaySGDStrategy, {}, "model_averaging_period", v) for v in (0, 1.5, "2")],
    *[(RaySGDStrategy, {}, "accelerator", v) for v in ("gpu", "cpu")],
    *[(RaySGDStrategy, {}, "checkpoint_io", v) for v in ("x", object())],
    *[(RaySGDStrategy, {}, "precision_plugin", v) for v in ("x", "16-mixed")],
    *[(RayModelParallelStrategy, {"num_workers": 4}, "data_parallel_size", v) for v in ("x", 0, 3)],
    *[(RayModelParallelStrategy, {"num_workers": 4}, "tensor_parallel_size", v) for v in (-1, 2.0)],
    (
        RayModelParallelStrategy,
        {"num_workers": (2, 4), "tensor_parallel_size": 1},
        "data_parallel_size",
        4,
    ),
    *[(RayModelParallelStrategy, {}, "save_distributed_checkpoint", v) for v in ("no", 0)],
    *[(RayFSDPStrategy, {}, "sharding_strategy", v) for v in ("BOGUS", 1, "HYBRID_SHARD")],
    *[(RayFSDPStrategy, {}, "state_dict_type", v) for v in ("bogus", "FULL")],
    *[(RayFSDPStrategy, {}, "cpu_offload", v) for v in ("yes", 1)],
    *[(RayFSDPStrategy, {}, "limit_all_gathers", v) for v in ("x",)],
]

#: (field, bad value) for every field of TorchConfig.
BAD_TORCH_CONFIG: list[tuple[str, object]] = [
    *[("backend", v) for v in ("mpi", "", 1, ["gloo"], "GLOO")],
    *[("init_method", v) for v in ("file", None, 1, "env://")],
    *[("timeout_s", v) for v in (0, -1, NAN, INF, 1e15, "1800", True, None)],
    ("timeout_s", timedelta(seconds=60)),
]

#: What the strategy needs besides the argument under test (FSDP1 refuses CPU workers).
STRATEGIES = [
    (RaySGDStrategy, {}),
    (RayModelParallelStrategy, {"use_gpu": True}),
    (RayFSDPStrategy, {"use_gpu": True}),
]


@pytest.fixture
def ray_calls(monkeypatch):
    """Every function of ``ray`` and ``ray.util`` replaced by one that records its call and
    raises: the constructors must touch no Ray state."""
    calls: list[str] = []
    for module in (ray, ray.util):
        for name, value in list(vars(module).items()):
            if inspect.isfunction(value) or inspect.isbuiltin(value):
                qualified = f"{module.__name__}.{name}"

                def record(*args, _name=qualified, **kwargs):
                    calls.append(_name)
                    raise AssertionError(f"the constructor called {_name}")

                monkeypatch.setattr(module, name, record)
    return calls


def _label(value: object) -> str:
    return repr(value)[:40]


def test_the_tables_cover_every_argument():
    worker_args = {
        name
        for name, p in inspect.signature(RayStrategyBase.__init__).parameters.items()
        if name != "self" and p.kind is not p.VAR_KEYWORD
    }
    assert {name for name, _ in BAD_ARGUMENTS} == worker_args
    fields = set(inspect.signature(TorchConfig).parameters)
    assert {name for name, _ in BAD_TORCH_CONFIG} == fields


@pytest.mark.parametrize(("strategy", "base"), STRATEGIES, ids=lambda s: getattr(s, "__name__", ""))
@pytest.mark.parametrize(("argument", "value"), BAD_ARGUMENTS, ids=_label)
def test_each_bad_argument_is_a_configuration_error_naming_it(
    strategy, base, argument, value, ray_calls
):
    kwargs = {**base, argument: value}
    if argument == "run_name":
        kwargs["checkpoint_storage"] = "/tmp/runs"
    with pytest.raises(ConfigurationError) as info:
        strategy(**kwargs)
    assert argument in str(info.value)
    assert ray_calls == []


@pytest.mark.parametrize(("strategy", "base", "argument", "value"), BAD_PASSED_ON, ids=_label)
def test_each_bad_argument_passed_on_is_a_configuration_error_naming_it(
    strategy, base, argument, value, ray_calls
):
    with pytest.raises(ConfigurationError) as info:
        strategy(**{"use_gpu": strategy is not RaySGDStrategy, **base, argument: value})
    assert argument in str(info.value)
    assert ray_calls == []


def test_nccl_is_refused_for_cpu_workers_and_taken_for_gpu_workers(ray_calls):
    nccl = TorchConfig(backend="nccl")
    with pytest.raises(ConfigurationError, match=r"backend='nccl'.*use_gpu=True"):
        RaySGDStrategy(2, backend_config=nccl)
    RaySGDStrategy(2, use_gpu=True, backend_config=nccl)
    RaySGDStrategy(2, resources_per_worker={"GPU": 0.5}, backend_config=nccl)
    assert ray_calls == []


def test_good_values_passed_on_are_taken(ray_calls):
    from torch.distributed.fsdp import CPUOffload

    RaySGDStrategy(2, find_unused_parameters=True, bucket_cap_mb=25, static_graph=False)
    RaySGDStrategy(2, bucket_cap_mb=0.5, model_averaging_period=4, ddp_comm_hook=print)
    RayModelParallelStrategy(4, use_gpu=True, data_parallel_size=2, tensor_parallel_size=2)
    RayModelParallelStrategy((2, 4), use_gpu=True, data_parallel_size="auto")
    RayModelParallelStrategy(4, use_gpu=True, tensor_parallel_size=4)  # "auto": checked placed
    for offload in (True, CPUOffload(offload_params=True)):
        RayFSDPStrategy(2, use_gpu=True, sharding_strategy="shard_grad_op", cpu_offload=offload)
    RayFSDPStrategy(2, use_gpu=True, state_dict_type="sharded")
    assert ray_calls == []


@pytest.mark.parametrize(("field", "value"), BAD_TORCH_CONFIG, ids=_label)
def test_each_bad_torch_config_field_is_a_configuration_error_naming_it(field, value, ray_calls):
    with pytest.raises(ConfigurationError) as info:
        TorchConfig(**{field: value})
    assert f"TorchConfig.{field}" in str(info.value)
    assert ray_calls == []


def test_the_largest_values_and_other_shapes_are_taken(ray_calls):
    callback = Callback()
    strategy = RaySGDStrategy(
        num_workers=[1, 2],  # as YAML gives a pair
        backend_config=TorchConfig(timeout_s=1e9),
        startup_timeout_s=1e9,
        progress_timeout_s=1e9,
        resize_interval_s=1e9,
        num_cpus_per_worker=0.0001,
        checkpoint_storage=pathlib.Path("~/ckpts"),
        driver_callbacks=(callback,),
        worker_env={"A": ""},
    )
    assert strategy.num_workers == (1, 2)
    assert strategy.checkpoint_storage == "~/ckpts"  # as given, expanded at launch
    assert strategy.driver_callbacks == [callback]
    assert RaySGDStrategy(checkpoint_storage="memory://runs").checkpoint_storage == "memory://runs"
    # a local folder with a colon, which no fsspec protocol names, is a local folder
    assert RaySGDStrategy(checkpoint_storage="exp1:v2").checkpoint_storage == "exp1:v2"
    with pytest.raises(ConfigurationError, match="write 'file:///tmp/runs'"):
        RaySGDStrategy(checkpoint_storage="file:/tmp/runs")
    assert ray_calls == []


def test_model_parallel_sizes_are_checked_where_the_workers_landed(ray_calls):
    """ "auto" is what Lightning makes of it on each worker: the data-parallel size the number of
    nodes, the tensor-parallel size the number of the worker's node's workers."""
    from ray_lightning_sgd.ranks import WorkerMetadata

    def on(*nodes: str) -> list[WorkerMetadata]:
        return [WorkerMetadata(node, "10.0.0.1", "h", pid) for pid, node in enumerate(nodes)]

    tensor_two = RayModelParallelStrategy(4, use_gpu=True, tensor_parallel_size=2)
    tensor_two.check_placed(on("a", "a", "b", "b"))  # 2 nodes x 2
    with pytest.raises(ConfigurationError, match=r"1 node.*resolve to 1 x 2 = 2"):
        tensor_two.check_placed(on("a", "a", "a", "a"))
    automatic = RayModelParallelStrategy(4, use_gpu=True)
    automatic.check_placed(on("a", "a", "b", "b"))
    automatic.check_placed(on("a", "b", "c", "d"))
    with pytest.raises(ConfigurationError, match=r"\(1, 3 a node\).*resolve to 2 x 1"):
        automatic.check_placed(on("a", "a", "a", "b"))
    fsdp2 = RayModelParallelStrategy(4, use_gpu=True, data_parallel_size=4, tensor_parallel_size=1)
    fsdp2.check_placed(on("a", "a", "a", "b"))  # FSDP2 alone: anywhere
    with pytest.raises(ConfigurationError, match=r"resolve to 4 x 3 = 12"):  # "auto": 3 there
        RayModelParallelStrategy(4, use_gpu=True, data_parallel_size=4).check_placed(
            on("a", "a", "a", "b")
        )
    RaySGDStrategy(4).check_placed(on("a", "a", "a", "b"))  # DDP takes any placement
    assert ray_calls == []
