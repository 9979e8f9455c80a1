"""Real CUDA runs; skipped on machines without a GPU (``bash tests/gpu/run.sh`` runs them).

With one GPU, NCCL runs one worker (NCCL runs one rank per GPU) and two workers share the GPU over
gloo; with two or more, two workers train over NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import ray
import torch

from ray_lightning_sgd import RaySGDStrategy, TorchConfig
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd.exceptions import ConfigurationError
from tests.conftest import assert_only_idle_workers_left
from tests.helpers import PrecisionProbe, loader, quiet_trainer_kwargs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPUS = torch.cuda.device_count()


class Ballast(PrecisionProbe):
    """Holds 256 MB on the GPU while it trains."""

    def on_train_start(self) -> None:
        self._ballast = torch.empty(64 * 2**20, device=self.device)


def _fit(
    strategy: RaySGDStrategy, model: PrecisionProbe | None = None, **kwargs
) -> tuple[pl.Trainer, PrecisionProbe]:
    pl.seed_everything(0)
    model = PrecisionProbe() if model is None else model
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=1,
        enable_checkpointing=False,
        **kwargs,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, loader())
    return trainer, model


def test_fit_with_nccl_on_gpus(ray_cluster):
    workers = min(2, GPUS)
    trainer, model = _fit(RaySGDStrategy(num_workers=workers, use_gpu=True))
    assert trainer.global_step == 96 // 8 // workers
    assert model.seen["device"] == "cuda"
    assert model.seen["backend"] == "nccl"
    assert model.seen["cuda_seed"] == 0  # seed_everything(0) on the driver
    # torch.manual_seed on the driver seeds the workers' CUDA generators too, as on one machine
    # (without seed_everything, whose PL_GLOBAL_SEED makes Lightning reseed every process)
    del os.environ["PL_GLOBAL_SEED"]
    torch.manual_seed(5)
    model = PrecisionProbe()
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=workers, use_gpu=True),
        max_epochs=1,
        limit_train_batches=1,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, loader())
    assert model.seen["cuda_seed"] == 5
    assert all(p.device.type == "cpu" for p in model.parameters()), "weights come back to the CPU"


def test_two_workers_share_one_gpu_over_gloo_and_nccl_refuses_it(ray_cluster):
    shared = {"CPU": 1, "GPU": 0.5}
    trainer, model = _fit(
        RaySGDStrategy(
            num_workers=2,
            resources_per_worker=shared,
            backend_config=TorchConfig(backend="gloo"),
            reuse_workers=False,
        )
    )
    assert trainer.global_step == 96 // 8 // 2
    assert (model.seen["device"], model.seen["backend"]) == ("cuda", "gloo")
    if GPUS == 1:  # Ray places both halves on the one GPU: NCCL cannot run them
        with pytest.raises(ConfigurationError, match=r"share GPU 0.*TorchConfig\(backend='gloo'\)"):
            _fit(RaySGDStrategy(num_workers=2, resources_per_worker=shared, reuse_workers=False))


@pytest.mark.parametrize(
    ("precision", "output"), [("16-mixed", "torch.float16"), ("bf16-mixed", "torch.bfloat16")]
)
def test_mixed_precision_autocasts_on_the_gpus(ray_cluster, precision, output):
    trainer, model = _fit(RaySGDStrategy(num_workers=1, use_gpu=True), precision=precision)
    assert model.seen["output"] == output
    assert model.seen["weights"] == "torch.float32"
    assert trainer.precision == precision


_HIDDEN_DRIVER = """
import json, sys, warnings
import pytorch_lightning as pl, ray, torch
from ray_lightning_sgd import RaySGDStrategy
from tests.helpers import PrecisionProbe, loader, quiet_trainer_kwargs
assert not torch.cuda.is_available()
ray.init(address=sys.argv[1])
warnings.simplefilter("always")
pl.seed_everything(0)
model = PrecisionProbe()
with warnings.catch_warnings(record=True) as caught:
    trainer = pl.Trainer(strategy=RaySGDStrategy(num_workers=1, use_gpu=True, reuse_workers=False),
                         precision="16-mixed", max_epochs=1, enable_checkpointing=False,
                         **quiet_trainer_kwargs())
before = {k: v.clone() for k, v in model.state_dict().items()}
trainer.fit(model, loader())
changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
print(json.dumps({"precision": trainer.precision, "seen": model.seen, "changed": changed,
                  "devices": sorted({str(p.device) for p in model.parameters()}),
                  "cpu_warning": any("not supported on CPU" in str(w.message) for w in caught)}))
"""


def test_a_driver_without_cuda_trains_gpu_workers_in_the_precision_asked_for(free_cluster):
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
    }
    address = ray.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, "-c", _HIDDEN_DRIVER, address],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["precision"] == "16-mixed"
    assert report["seen"]["output"] == "torch.float16", report
    assert report["seen"]["device"] == "cuda"
    assert report["changed"] and report["devices"] == ["cpu"]
    assert not report["cpu_warning"]


def _cuda_memory() -> tuple[int, int]:
    """Runs on each worker. The bytes its tensors hold on the GPU, and its allocator keeps."""
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def test_warm_workers_free_the_gpu_memory_of_a_finished_call(ray_cluster):
    pool.shutdown()
    _fit(RaySGDStrategy(num_workers=1, use_gpu=True), Ballast())
    [idle] = pool._idle
    [(allocated, reserved)] = idle.executor.run(_cuda_memory)
    # what may stay: cuBLAS's workspace (a few MB), never the call's model or its 256 MB
    assert allocated < 32 * 2**20, f"{allocated} bytes of a finished call still on the GPU"
    assert reserved < 64 * 2**20, f"{reserved} bytes cached by the allocator after the call"
    # and the warm workers train again (a new strategy of equal settings: Lightning refuses a
    # strategy whose GPU devices an earlier Trainer set)
    _fit(RaySGDStrategy(num_workers=1, use_gpu=True), Ballast())
    assert assert_only_idle_workers_left() == 1


def test_sharded_strategies_train_on_gpus_in_bf16(ray_cluster):
    """FSDP2 (RayModelParallelStrategy) and FSDP1 (RayFSDPStrategy) over NCCL in bf16-mixed, one
    worker per GPU; the driver gets the whole weights on the CPU."""
    from ray_lightning_sgd import RayFSDPStrategy, RayModelParallelStrategy
    from tests.sharded_models import ShardedMLP

    workers = min(2, GPUS)
    for strategy, shard in (
        (RayModelParallelStrategy(num_workers=workers, use_gpu=True, data_parallel_size=workers,
                                  tensor_parallel_size=1), True),
        (RayFSDPStrategy(num_workers=workers, use_gpu=True), False),
    ):  # fmt: skip
        pl.seed_everything(0)
        model = ShardedMLP(shard)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = pl.Trainer(
            strategy=strategy, precision="bf16-mixed", max_epochs=1, enable_checkpointing=False,
            **quiet_trainer_kwargs(),
        )  # fmt: skip
        trainer.fit(model, loader())
        assert trainer.precision == "bf16-mixed"
        after = model.state_dict()
        assert set(after) == set(before), type(strategy).__name__
        assert all(t.device.type == "cpu" and type(t) is torch.Tensor for t in after.values())
        assert any(not torch.equal(before[k], after[k]) for k in before), type(strategy).__name__


def test_fsdp_on_gpus_gives_a_model_built_on_the_meta_device_its_weights(ray_cluster, tmp_path):
    """RayFSDPStrategy (FSDP1) under ``init_module(empty_init=True)``: the driver's model is on
    the meta device, FSDP materialises it on the workers (``reset_parameters``), and the driver
    ends with rank 0's trained weights on the CPU."""
    from ray_lightning_sgd import RayFSDPStrategy
    from tests.test_weights import MetaLlama, SaveRankZeroWeights, _tokens

    trainer = pl.Trainer(
        strategy=RayFSDPStrategy(num_workers=min(2, GPUS), use_gpu=True),
        max_epochs=1, enable_checkpointing=False,
        callbacks=[SaveRankZeroWeights(tmp_path / "rank0.pt")], **quiet_trainer_kwargs(),
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = MetaLlama(materialise=False, shard=False)
    assert all(t.is_meta for t in model.state_dict().values())
    trainer.fit(model, _tokens())
    weights = model.state_dict()
    assert not [k for k, v in weights.items() if v.is_meta]
    rank_zero = torch.load(tmp_path / "rank0.pt")
    assert set(weights) == set(rank_zero)
    assert all(torch.equal(weights[k], rank_zero[k].cpu()) for k in weights)
