"""Each worker trains on its own hardware, with the precision the user asked for.

The resolution is a pure function, tested here for CPU and CUDA workers without CUDA; the driver
keeps what the user asked for (a GPU-less driver in front of GPU workers included); CPU workers
train in that precision; what the workers' hardware cannot run is refused with a clear error.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as lpl
import pytest
import pytorch_lightning as pl
import torch

from ray_lightning_sgd import RaySGDStrategy
from ray_lightning_sgd import lightning as rls_lightning
from ray_lightning_sgd._backend.torch import check_one_rank_per_gpu
from ray_lightning_sgd._boundary.payload import GlobalState
from ray_lightning_sgd._boundary.precision import (
    PRECISIONS,
    PrecisionChoice,
    PrecisionRequest,
    WorkerHardware,
    make_plugin,
    matches,
    resolve_precision,
)
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._worker.entry import use_own_hardware
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata
from ray_lightning_sgd.exceptions import ConfigurationError
from tests.helpers import PrecisionProbe, loader, quiet_trainer_kwargs

CPU = WorkerHardware("cpu")
H100 = WorkerHardware("cuda", name="H100", bf16=True)
V100 = WorkerHardware("cuda", name="Tesla V100 (compute capability 7.0)", bf16=False)
H100_TE = WorkerHardware("cuda", name="H100", bf16=True, transformer_engine=True)


@pytest.mark.parametrize(
    ("precision", "hardware", "expected"),
    [
        ("32-true", CPU, ("32-true", "full", "cpu")),
        ("32-true", H100, ("32-true", "full", "cuda")),
        ("64-true", H100, ("64-true", "double", "cuda")),
        ("16-true", CPU, ("16-true", "half", "cpu")),
        ("bf16-true", H100, ("bf16-true", "half", "cuda")),
        ("16-mixed", H100, ("16-mixed", "mixed", "cuda")),
        ("16-mixed", V100, ("16-mixed", "mixed", "cuda")),
        ("bf16-mixed", H100, ("bf16-mixed", "mixed", "cuda")),
        ("bf16-mixed", CPU, ("bf16-mixed", "mixed", "cpu")),
        # Lightning on a CPU machine: fp16 autocast does not run there, bf16 does
        ("16-mixed", CPU, ("bf16-mixed", "mixed", "cpu")),
        ("transformer-engine", H100_TE, ("transformer-engine", "transformer-engine", "cuda")),
    ],
)
def test_each_precision_resolves_as_lightning_would_on_the_workers(precision, hardware, expected):
    choice = resolve_precision(PrecisionRequest(precision), hardware)
    assert (choice.precision, choice.kind, choice.device) == expected
    # only a change of precision is told to the user
    assert (choice.note is not None) == (choice.precision != precision)


@pytest.mark.parametrize(
    ("precision", "hardware", "words"),
    [
        ("bf16-mixed", V100, ["'bf16-mixed'", "bfloat16", "Tesla V100", "'16-mixed'"]),
        ("bf16-true", V100, ["'bf16-true'", "Tesla V100"]),
        ("transformer-engine", CPU, ["'transformer-engine'", "CPUs", "use_gpu=True"]),
        ("transformer-engine", H100, ["transformer_engine", "every node"]),
        ("transformer-engine-float16", CPU, ["'transformer-engine-float16'", "CPUs"]),
        ("8-bit", H100, ["'8-bit'", "32-true"]),
    ],
)
def test_what_the_workers_cannot_run_is_refused_naming_it(precision, hardware, words):
    with pytest.raises(ConfigurationError) as info:
        resolve_precision(PrecisionRequest(precision), hardware)
    for word in words:
        assert word in str(info.value)


def test_a_users_plugin_is_kept_and_bitsandbytes_needs_gpus():
    class BitsandbytesPrecision(pl.plugins.Precision):  # what the check reads: the class name
        precision = "nf4"

    plugin = pl.plugins.DoublePrecision()
    choice = resolve_precision(PrecisionRequest("32-true", plugin=plugin), CPU)
    assert choice.kind == "plugin"
    assert choice.precision == "64-true"
    assert make_plugin(choice, PrecisionRequest("32-true", plugin=plugin), pl.plugins) is plugin
    request = PrecisionRequest("32-true", plugin=BitsandbytesPrecision())
    assert resolve_precision(request, H100).kind == "plugin"
    with pytest.raises(ConfigurationError, match=r"BitsandbytesPrecision.*CUDA GPUs only.*CPUs"):
        resolve_precision(request, CPU)


def test_a_users_float16_plugin_gets_a_gradient_scaler_on_gpu_workers():
    """plugins=[MixedPrecision("16-mixed", "cuda", scaler=...)] made on a driver without CUDA:
    torch disables its GradScaler there; a GPU worker makes another of its class (FSDP's
    ShardedGradScaler, say), as float16 without loss scaling lets small gradients vanish. One
    disabled on a driver with a GPU was disabled by the user: it stays so. Here, without CUDA,
    torch disables the new one too: the test sees that it was made, and how."""
    made: list[tuple] = []

    class Recording(torch.amp.GradScaler):
        def __init__(self, device="cuda", **kwargs) -> None:
            made.append((device, kwargs))
            super().__init__(device, **kwargs)

    class CudaOnly(torch.amp.GradScaler):
        """As torch.cuda.amp.GradScaler: no device argument (its first is init_scale)."""

        def __init__(self, init_scale=2.0**16, **kwargs) -> None:
            made.append(("no device", {"init_scale": init_scale, **kwargs}))
            super().__init__("cuda", init_scale=init_scale, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "CUDA is not available"
        for scaler in (Recording("cuda", init_scale=1024.0), CudaOnly()):
            plugin = pl.plugins.MixedPrecision("16-mixed", "cuda", scaler=scaler)
            assert not scaler.is_enabled()
            request = PrecisionRequest("16-mixed", plugin=plugin, made_without_cuda=True)
            choice = resolve_precision(request, H100)
            assert not matches(plugin, choice, pl.plugins)  # not kept as it came
            assert make_plugin(choice, request, pl.plugins) is plugin
            assert type(plugin.scaler) is type(scaler) and plugin.scaler is not scaler
            # on CPU workers (bf16 autocast needs no scaler) it stays as it came
            assert matches(plugin, resolve_precision(request, CPU), pl.plugins)
            # made on a driver with a GPU: disabled by the user, kept so
            by_hand = PrecisionRequest("16-mixed", plugin=plugin, made_without_cuda=False)
            assert matches(plugin, resolve_precision(by_hand, H100), pl.plugins)
    # torch kept none of a disabled scaler's settings: the new ones have torch's defaults, and
    # a scaler class without a device argument gets none
    assert made == [
        ("cuda", {"init_scale": 1024.0}), ("no device", {"init_scale": 2.0**16}),  # the user's
        ("cuda", {}), ("no device", {"init_scale": 2.0**16}),  # the workers'
    ]  # fmt: skip


@pytest.mark.parametrize(
    "plugins", [pl.plugins, lpl.plugins], ids=["pytorch_lightning", "lightning"]
)
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if "transformer" not in p])
def test_plugins_are_built_for_the_cpu_as_lightning_builds_them(plugins, precision):
    choice = resolve_precision(PrecisionRequest(precision), CPU)
    plugin = make_plugin(choice, PrecisionRequest(precision), plugins)
    assert isinstance(plugin, plugins.Precision)
    assert plugin.precision == choice.precision
    assert matches(plugin, choice, plugins)
    # a plugin of another precision, or the driver's stand-in, is rebuilt
    assert not matches(
        plugins.DoublePrecision() if precision != "64-true" else plugins.Precision(),
        choice,
        plugins,
    )
    if choice.kind == "mixed":
        assert plugin.device == "cpu"
        assert not matches(plugins.MixedPrecision(choice.precision, "cuda"), choice, plugins)  # type: ignore[arg-type]


def test_a_choice_for_cuda_builds_a_cuda_autocast():
    choice = PrecisionChoice("bf16-mixed", "mixed", "cuda")
    plugin = make_plugin(choice, PrecisionRequest("bf16-mixed"), pl.plugins)
    assert (plugin.precision, plugin.device) == ("bf16-mixed", "cuda")


@pytest.mark.parametrize(
    ("namespace", "strategy_class"),
    [(pl, RaySGDStrategy), (lpl, rls_lightning.RaySGDStrategy)],
    ids=["pytorch_lightning", "lightning"],
)
@pytest.mark.parametrize(
    "precision", ["16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true", "transformer-engine"]
)
def test_a_driver_without_gpus_keeps_the_precision_asked_for_gpu_workers(
    namespace, strategy_class, precision
):
    strategy = strategy_class(num_workers=2, use_gpu=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = namespace.Trainer(
            strategy=strategy, precision=precision, **quiet_trainer_kwargs()
        )
    assert trainer.precision == precision
    assert strategy.precision_request == PrecisionRequest(
        precision, None, "auto", made_without_cuda=not torch.cuda.is_available()
    )
    assert isinstance(trainer.precision_plugin, strategy.precision_class)
    # Lightning's message about the driver's CPU ("Using precision='bf16-mixed' instead") is wrong
    # for GPU workers and is not shown
    assert not [w for w in caught if "not supported on CPU" in str(w.message)]
    # init_module builds in the dtype a GPU rank 0's plugin would: a "true" precision's
    with trainer.init_module():
        built = torch.nn.Linear(2, 2)
    expected = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
    assert built.weight.dtype == {**expected, "transformer-engine": torch.bfloat16}.get(
        precision, torch.float32
    )
    assert torch.get_default_dtype() == torch.float32


def test_cpu_workers_get_lightnings_own_choice_and_the_request_is_kept():
    strategy = RaySGDStrategy(num_workers=2)
    with pytest.warns(UserWarning, match="not supported on CPU"):
        trainer = pl.Trainer(strategy=strategy, precision="16-mixed", **quiet_trainer_kwargs())
    assert trainer.precision == "bf16-mixed"  # what Lightning says on this CPU-only machine
    assert isinstance(trainer.precision_plugin, pl.plugins.MixedPrecision)
    assert strategy.precision_request.precision == "16-mixed"
    user = pl.plugins.DoublePrecision()
    strategy = RaySGDStrategy(num_workers=2, use_gpu=True)
    trainer = pl.Trainer(strategy=strategy, plugins=[user], **quiet_trainer_kwargs())
    assert trainer.precision_plugin is user
    assert strategy.precision_request.plugin is user


@pytest.mark.parametrize(
    ("precision", "built"), [("16-mixed", "bf16-mixed"), ("64-true", "64-true")]
)
def test_a_worker_builds_the_plugin_for_its_own_device(precision, built):
    """The worker half, on this CPU: the driver's stand-in becomes the plugin Lightning would
    choose here, and a change of precision is told to the user."""
    strategy = RaySGDStrategy(num_workers=1, use_gpu=True)
    pl.Trainer(strategy=strategy, precision=precision, **quiet_trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        use_own_hardware(strategy, strategy.ray_environment, strategy.flavour, global_rank=0)
    plugin = strategy.precision_plugin
    assert plugin.precision == built
    assert not isinstance(plugin, strategy.precision_class)
    assert isinstance(strategy.accelerator, pl.accelerators.CPUAccelerator)
    assert strategy.parallel_devices == [torch.device("cpu")]
    notes = [str(w.message) for w in caught if "does not run on CPUs" in str(w.message)]
    assert len(notes) == (built != precision)


def test_global_state_carries_the_seed_the_workers_seed_cuda_with():
    torch.manual_seed(1234)
    assert GlobalState.capture().torch_seed == 1234
    pl.seed_everything(7)
    assert GlobalState.capture().torch_seed == 7


def test_more_than_one_gpu_per_worker_is_refused():
    with pytest.raises(ConfigurationError, match=r"2 GPUs.*one device.*one worker per GPU"):
        RaySGDStrategy(num_workers=2, resources_per_worker={"CPU": 1, "GPU": 2})


def test_workers_sharing_a_gpu_are_refused_with_nccl():
    def meta(node: str, *gpus: str) -> WorkerMetadata:
        return WorkerMetadata(node, f"10.0.0.{node}", "host", 1, gpu_ids=gpus)

    check_one_rank_per_gpu([meta("1", "0"), meta("1", "1"), meta("2", "0")])  # distinct GPUs
    with pytest.raises(ConfigurationError) as info:
        check_one_rank_per_gpu([meta("1", "0"), meta("2", "0"), meta("1", "0")])
    for words in ("workers 0, 2", "GPU 0", "10.0.0.1", "whole", "TorchConfig(backend='gloo')"):
        assert words in str(info.value)


def test_settings_the_workers_cannot_run_are_refused_before_any_worker_starts(ray_cluster):
    idle_before = pool.idle_group_names()
    for accelerator in ("cpu", pl.accelerators.CPUAccelerator()):
        conflict = RaySGDStrategy(num_workers=2, use_gpu=True)
        trainer = pl.Trainer(strategy=conflict, accelerator=accelerator, **quiet_trainer_kwargs())
        with pytest.raises(ConfigurationError, match=r"accelerator='cpu'.*RaySGDStrategy\(use_gpu"):
            trainer.fit(PrecisionProbe(), loader())
    # a driver with a GPU (and Transformer Engine) accepts what its CPU workers cannot run; here,
    # the request that such a driver's Trainer would have kept
    cpu_workers = RaySGDStrategy(num_workers=2)
    trainer = pl.Trainer(strategy=cpu_workers, **quiet_trainer_kwargs())
    cpu_workers._precision_request = PrecisionRequest("transformer-engine")
    with pytest.raises(ConfigurationError, match=r"'transformer-engine' runs on CUDA GPUs.*CPUs"):
        trainer.fit(PrecisionProbe(), loader())
    assert pool.idle_group_names() == idle_before


@pytest.mark.parametrize(
    ("precision", "output", "weights"),
    [
        ("bf16-mixed", "torch.bfloat16", "torch.float32"),
        ("16-mixed", "torch.bfloat16", "torch.float32"),  # as Lightning on a CPU
        ("64-true", "torch.float64", "torch.float64"),
        ("bf16-true", "torch.bfloat16", "torch.bfloat16"),
    ],
)
def test_cpu_workers_train_in_the_precision_asked_for(ray_cluster, precision, output, weights):
    model = PrecisionProbe()
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2),
        precision=precision,
        max_epochs=1,
        limit_train_batches=2,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, loader())
    assert model.seen["output"] == output
    assert model.seen["weights"] == weights
    # the driver's model ends in the dtype rank 0 trained in, as ddp's rank 0's (its plugin
    # converts the model in place in setup): float64 under 64-true, float32 under mixed ones
    assert {str(p.dtype) for p in model.parameters()} == {weights}
    assert (model.seen["device"], model.seen["backend"]) == ("cpu", "gloo")


def test_workers_on_halves_of_one_gpu_are_refused_before_nccl_starts(ray_cluster):
    """The session's cluster declares GPUs it does not have: Ray places two halves on one, and
    the error comes before any worker touches CUDA."""
    strategy = RaySGDStrategy(
        num_workers=2, resources_per_worker={"CPU": 1, "GPU": 0.5}, reuse_workers=False
    )
    trainer = pl.Trainer(strategy=strategy, max_epochs=1, **quiet_trainer_kwargs())
    with pytest.raises(ConfigurationError, match=r"workers 0, 1 share GPU \d.*backend='gloo'"):
        trainer.fit(PrecisionProbe(), loader())
