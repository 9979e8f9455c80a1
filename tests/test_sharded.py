"""Sharded training on Ray: RayModelParallelStrategy (FSDP2 on CPU workers over gloo) against
Lightning's own ModelParallelStrategy and against RaySGDStrategy; RayFSDPStrategy's refusals."""

from __future__ import annotations

import inspect
import io
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as lpl
import pytest
import pytorch_lightning as pl
import torch

from ray_lightning_sgd import RayFSDPStrategy, RayModelParallelStrategy, RaySGDStrategy, _compat
from ray_lightning_sgd.exceptions import ConfigurationError
from tests.helpers import loader, quiet_trainer_kwargs
from tests.sharded_models import EPOCHS, FaultyShardedMLP, ShardedMLP

FSDP2 = {"data_parallel_size": 2, "tensor_parallel_size": 1}
CPU_FSDP2_PROBLEM = _compat.torch.cpu_fsdp2_problem(torch.__version__)
#: The tests that shard on CPU workers, which torch's FSDP2 does from 2.7 on
needs_cpu_fsdp2 = pytest.mark.skipif(CPU_FSDP2_PROBLEM is not None, reason=str(CPU_FSDP2_PROBLEM))


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory):
    """Lightning's own ModelParallelStrategy run, started at once in its own processes."""
    out = tmp_path_factory.mktemp("model-parallel-reference")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.sharded_models", str(out)],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def weights() -> dict[str, torch.Tensor]:
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, output[-3000:]
        return torch.load(out / "weights.pt")

    yield weights
    if process.poll() is None:
        process.kill()


def _fit(
    strategy, shard: bool = True, epochs: int = EPOCHS, **kwargs
) -> tuple[pl.Trainer, ShardedMLP]:
    pl.seed_everything(0)
    model = ShardedMLP(shard)
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=epochs, **{"enable_checkpointing": False, **kwargs},
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(model, loader())
    return trainer, model


def _assert_close(ours: dict, theirs: dict, tolerance: float) -> None:
    assert set(ours) == set(theirs)
    for key in ours:
        assert ours[key].shape == theirs[key].shape, key
        difference = (ours[key].float() - theirs[key].float()).abs().max().item()
        assert difference <= tolerance, f"{key} differs by {difference}"


@needs_cpu_fsdp2
def test_fsdp2_on_ray_equals_lightnings_model_parallel_strategy(ray_cluster, lightning_reference):
    trainer, model = _fit(RayModelParallelStrategy(num_workers=2, **FSDP2))
    assert trainer.global_step == EPOCHS * 96 // 8 // 2
    weights = model.state_dict()
    assert all(type(t) is torch.Tensor for t in weights.values()), "whole tensors, not shards"
    # on the workers each rank held half of each layer
    assert model.parameter_type == "DTensor"
    assert model.local_numel == model.net[0].weight.numel() // 2
    _assert_close(weights, lightning_reference(), 1e-6)
    assert trainer.callback_metrics["train_loss"] > 0


@needs_cpu_fsdp2
def test_a_tune_report_of_a_sharded_fit_carries_one_whole_checkpoint(ray_cluster, monkeypatch):
    """TuneReportCallback(save_checkpoints=True) on FSDP2: one whole checkpoint goes to the
    driver (a distributed checkpoint would be a folder of shards on each node), and the local
    temporary folder it was written in is gone."""
    from ray_lightning_sgd._boundary import tune as tune_boundary
    from ray_lightning_sgd.tune import TuneReportCallback

    reports: list[tuple] = []  # the driver's end, where a trial's process hands it to Tune
    monkeypatch.setattr(tune_boundary, "report_to_tune", lambda *report: reports.append(report))
    before = set(os.listdir(tempfile.gettempdir()))
    callback = TuneReportCallback("train_loss", on="train_epoch_end", save_checkpoints=True)
    _, model = _fit(
        RayModelParallelStrategy(num_workers=2, **FSDP2), epochs=1, callbacks=[callback]
    )
    [(metrics, data, filename)] = reports
    assert set(metrics) == {"train_loss"} and filename == "checkpoint.ckpt"
    state = torch.load(io.BytesIO(data), weights_only=False)["state_dict"]
    assert {k: v.shape for k, v in state.items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }
    new = set(os.listdir(tempfile.gettempdir())) - before
    assert not [name for name in new if name.startswith("ray_lightning_sgd-")], new


@needs_cpu_fsdp2
def test_fsdp2_trains_as_ddp(ray_cluster):
    _, sharded = _fit(RayModelParallelStrategy(num_workers=2, **FSDP2))
    _, replicated = _fit(RaySGDStrategy(num_workers=2), shard=False)
    before = ShardedMLP().state_dict()
    _assert_close(sharded.state_dict(), replicated.state_dict(), 1e-5)
    assert any(not torch.equal(before[k], v) for k, v in sharded.state_dict().items())


@needs_cpu_fsdp2
def test_a_sharded_checkpoint_is_written_by_every_rank_and_fit_resumes_from_it(
    ray_cluster, tmp_path
):
    strategy = RayModelParallelStrategy(num_workers=2, **FSDP2)
    trainer, first = _fit(strategy, epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    checkpoint = Path(trainer.checkpoint_callback.best_model_path)
    assert checkpoint.is_dir(), checkpoint  # torch's distributed checkpoint: a folder
    shards = sorted(p.name for p in checkpoint.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    # one worker loads the two shards (torch's distributed checkpoint reshards): the run is done
    # after its one epoch, and the driver gets the checkpoint's weights
    loaded = ShardedMLP()
    one = RayModelParallelStrategy(num_workers=1, data_parallel_size=1, tensor_parallel_size=1)
    trainer = pl.Trainer(
        strategy=one, max_epochs=1, enable_checkpointing=False, **quiet_trainer_kwargs()
    )
    trainer.fit(loaded, loader(), ckpt_path=checkpoint)
    _assert_close(loaded.state_dict(), first.state_dict(), 0.0)
    pl.seed_everything(0)
    resumed = ShardedMLP()
    trainer = pl.Trainer(
        strategy=RayModelParallelStrategy(num_workers=2, **FSDP2), max_epochs=EPOCHS,
        enable_checkpointing=False, **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(resumed, loader(), ckpt_path=checkpoint)
    assert trainer.global_step == EPOCHS * 96 // 8 // 2
    _, uninterrupted = _fit(RayModelParallelStrategy(num_workers=2, **FSDP2))
    _assert_close(resumed.state_dict(), uninterrupted.state_dict(), 1e-6)


@pytest.mark.parametrize("namespace", [pl, lpl], ids=["pytorch_lightning", "lightning"])
def test_both_strategies_are_registered_by_name(namespace):
    assert {"ray_model_parallel", "ray_fsdp"} <= set(namespace.strategies.StrategyRegistry)
    if CPU_FSDP2_PROBLEM is not None:  # its defaults are CPU workers
        with pytest.raises(ConfigurationError, match="RayModelParallelStrategy on CPU workers"):
            namespace.Trainer(strategy="ray_model_parallel", logger=False)
    else:
        trainer = namespace.Trainer(strategy="ray_model_parallel", logger=False)
        assert type(trainer.strategy).__name__ == "RayModelParallelStrategy"
        assert isinstance(trainer.strategy, namespace.strategies.ModelParallelStrategy)
    # registered with its defaults (CPU workers), which FSDP refuses, saying why
    with pytest.raises(ConfigurationError, match="RayFSDPStrategy needs GPU workers"):
        namespace.Trainer(strategy="ray_fsdp", logger=False)


def test_what_the_sharded_strategies_cannot_run_is_refused_at_once():
    started = time.monotonic()
    with pytest.raises(
        ConfigurationError, match=r"RayFSDPStrategy needs GPU workers.*RayModelParallelStrategy"
    ):
        RayFSDPStrategy(num_workers=2)
    with pytest.raises(ConfigurationError, match=r"unknown argument find_unused_parameters=True"):
        RayModelParallelStrategy(num_workers=2, find_unused_parameters=True)
    with pytest.raises(ConfigurationError, match=r"does not take timeout"):
        RayFSDPStrategy(num_workers=2, use_gpu=True, timeout=5)
    assert time.monotonic() - started < 1
    # torch's FSDP2 on CPU workers: from torch 2.7 on, refused before that
    assert _compat.torch.cpu_fsdp2_problem("2.7.1") is None
    assert "Install torch>=2.7" in str(_compat.torch.cpu_fsdp2_problem("2.6.0+cpu"))
    if CPU_FSDP2_PROBLEM is not None:
        with pytest.raises(ConfigurationError, match=r"on CPU workers: torch .* Install torch"):
            RayModelParallelStrategy(num_workers=2)
    else:
        RayModelParallelStrategy(num_workers=2)
    # an FSDP argument is taken as Lightning's FSDPStrategy takes it
    strategy = RayFSDPStrategy(num_workers=2, use_gpu=True, state_dict_type="sharded")
    assert isinstance(strategy, pl.strategies.FSDPStrategy)
    assert strategy._state_dict_type == "sharded"


@needs_cpu_fsdp2
def test_lightning_cli_trains_with_the_model_parallel_strategy(ray_cluster):
    from pytorch_lightning.cli import LightningCLI

    from tests.helpers import TinyData

    cli = LightningCLI(
        ShardedMLP,
        TinyData,
        args=[
            "fit",
            "--trainer.strategy=ray_lightning_sgd.RayModelParallelStrategy",
            "--trainer.strategy.num_workers=2",
            "--trainer.strategy.data_parallel_size=2",
            "--trainer.strategy.tensor_parallel_size=1",
            "--trainer.max_epochs=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
        ],
        save_config_callback=None,
        seed_everything_default=0,
    )
    assert isinstance(cli.trainer.strategy, RayModelParallelStrategy)
    assert cli.trainer.global_step == 96 // 8 // 2
    assert cli.model.parameter_type == "DTensor"


@needs_cpu_fsdp2
def test_a_sharded_run_restarts_from_its_resume_checkpoint(ray_cluster, tmp_path, caplog):
    _, uninterrupted = _fit(RayModelParallelStrategy(num_workers=2, **FSDP2), epochs=3)
    marker = str(tmp_path / "failed-once")
    pl.seed_everything(0)
    model = FaultyShardedMLP(rank=1, step=8, marker=marker)  # 6 steps an epoch: in the second
    trainer = pl.Trainer(
        strategy=RayModelParallelStrategy(num_workers=2, max_failures=1, **FSDP2), max_epochs=3,
        enable_checkpointing=False, **quiet_trainer_kwargs(),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        trainer.fit(model, loader())
    assert os.path.exists(marker), "the failure was not injected"
    assert "resumes after epoch 0 (global step 6)" in caplog.text
    assert trainer.global_step == 3 * 96 // 8 // 2
    _assert_close(model.state_dict(), uninterrupted.state_dict(), 1e-6)


def test_fsdp_takes_fsdp_precision_plugins_and_fsdp_arguments():
    """On this CPU machine: the driver's Trainer, and a worker's half on the CPU."""
    from ray_lightning_sgd._worker.entry import use_own_hardware

    strategy = RayFSDPStrategy(
        num_workers=2, use_gpu=True, limit_all_gathers=False, forward_prefetch=True
    )
    trainer = pl.Trainer(strategy=strategy, precision="bf16-mixed", logger=False)
    assert trainer.precision == "bf16-mixed"
    assert isinstance(trainer.precision_plugin, pl.plugins.FSDPPrecision)
    assert strategy.kwargs["forward_prefetch"] is True  # passed on to FullyShardedDataParallel
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    driver_plugin = trainer.precision_plugin
    use_own_hardware(strategy, strategy.ray_environment, strategy.flavour, global_rank=0)
    assert isinstance(strategy.precision_plugin, pl.plugins.FSDPPrecision)
    assert strategy.precision_plugin is not driver_plugin  # built for the worker's device
    assert strategy.precision_plugin.precision == "bf16-mixed"
    with pytest.raises(ConfigurationError, match="unknown argument bucket_cap_mb"):
        RayFSDPStrategy(num_workers=2, use_gpu=True, bucket_cap_mb=10)
    # Lightning's FSDPStrategy sets use_orig_params=True when it is not given: an explicit
    # False is passed on (not dropped as torch's default), and the signature shows True
    off = RayFSDPStrategy(num_workers=2, use_gpu=True, use_orig_params=False)
    assert off.kwargs["use_orig_params"] is False
    assert RayFSDPStrategy(num_workers=2, use_gpu=True).kwargs["use_orig_params"] is True
    shown = inspect.signature(RayFSDPStrategy).parameters["use_orig_params"].default
    assert shown is True


def test_sharded_strategies_take_a_remote_checkpoint_storage():
    """Their resume checkpoints are saved whole on rank 0's disk and uploaded, and each node
    downloads the point to one local path (tests/test_object_storage.py runs one on S3)."""
    strategy = RayModelParallelStrategy(
        num_workers=2, use_gpu=True, checkpoint_storage="s3://bucket/runs"
    )
    assert strategy.checkpoint_storage == "s3://bucket/runs"


def test_every_worker_of_a_node_copies_a_resume_point_to_the_same_path():
    from ray_lightning_sgd._boundary.resume_points import ResumePoint
    from ray_lightning_sgd._worker.resume_from import materialise

    point = ResumePoint(epoch=0, global_step=6, data=b"checkpoint bytes")
    first, second = materialise(point), materialise(point)
    try:
        assert first == second  # rank 0's path, which a sharded strategy gives every rank
        assert Path(first).read_bytes() == b"checkpoint bytes"
        other = ResumePoint(epoch=1, global_step=12, data=b"later")
        assert materialise(other) != first
    finally:
        for path in {first, materialise(ResumePoint(1, 12, b"later", name=other.name))}:
            os.unlink(path)


def _process_groups() -> int:
    """Runs on each worker. How many process groups the worker holds."""
    import torch.distributed.distributed_c10d as c10d

    return len(c10d._world.pg_map)


@needs_cpu_fsdp2
def test_a_two_dimensional_mesh_brings_the_weights_back_and_leaves_no_groups(ray_cluster):
    """4 workers, data-parallel 2 x tensor-parallel 2: each dimension a group of its own (a
    dimension over every rank would be the default group). Rank 0 gathers the weights over
    them after Lightning's teardown, call after call on warm workers, which keep one mesh
    (one set of groups) however many calls use it."""
    from ray_lightning_sgd._executor import pool

    pool.shutdown()
    counts = []
    for _ in range(2):
        strategy = RayModelParallelStrategy(
            num_workers=4, num_cpus_per_worker=0.5, data_parallel_size=2, tensor_parallel_size=2
        )
        _, model = _fit(strategy, epochs=1)
        assert model.parameter_type == "DTensor"
        assert all(not p.is_meta and torch.isfinite(p).all() for p in model.parameters())
        [idle] = pool._idle
        counts.append(idle.executor.run(_process_groups))
    # the default group and the mesh's two, kept for the next call of the same mesh
    assert counts[0] == counts[1] == [3, 3, 3, 3], counts
    pool.shutdown()  # 4 workers of half a CPU: not the settings of the next tests


@needs_cpu_fsdp2
def test_the_drivers_checkpoint_without_the_optimizers_state_says_it_cannot_resume(tmp_path):
    """After a sharded fit the driver holds the weights, not the optimizers' state (sharded on
    the workers): a checkpoint the driver writes with trainer.save_checkpoint says so."""
    trainer = pl.Trainer(
        strategy=RayModelParallelStrategy(num_workers=2, **FSDP2), max_epochs=1,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    model = ShardedMLP()
    trainer.strategy.connect(model)
    state = {"state_dict": model.state_dict(), "epoch": 1}
    with pytest.warns(RuntimeWarning, match="not the optimizers' state.*cannot resume"):
        trainer.strategy.save_checkpoint({**state, "optimizer_states": []}, tmp_path / "a.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.strategy.save_checkpoint(state, tmp_path / "weights.ckpt")  # weights_only
    assert (tmp_path / "a.ckpt").exists() and (tmp_path / "weights.ckpt").exists()
