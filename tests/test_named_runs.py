"""A named run (``run_name`` with ``checkpoint_storage``) outlives its driver: a driver SIGKILLed
mid-fit and started again resumes the run and ends with the weights of a run never interrupted;
the run's folder keeps the last ``keep_last`` resume checkpoints; a run that trains something else
under the same name is refused before any worker starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import ray
import torch

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy
from tests.conftest import leftovers
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent(
    """
    import os, sys, time
    import pytorch_lightning as pl
    import torch
    from ray_lightning_sgd import RaySGDStrategy
    from tests.helpers import TinyModel, loader, quiet_trainer_kwargs
    from tests.test_named_runs import StallsInEpoch

    pl.seed_everything(0)
    model = TinyModel()
    # the workers see the stall (Ray starts them with the cluster's environment, not this one's)
    stall = {"STALL_IN_EPOCH": os.environ.get("STALL_IN_EPOCH", "")}
    strategy = RaySGDStrategy(num_workers=2, checkpoint_storage=sys.argv[1], run_name="digits-v3",
                              worker_env=stall)
    trainer = pl.Trainer(strategy=strategy, max_epochs=3, callbacks=[StallsInEpoch()],
                         enable_checkpointing=False, **quiet_trainer_kwargs())
    trainer.fit(model, loader())
    torch.save(model.state_dict(), sys.argv[2])
    print("global step", trainer.global_step, flush=True)
    """
)


class StallsInEpoch(pl.Callback):
    """With STALL_IN_EPOCH set, waits in that epoch (so that the test kills the driver then)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if str(trainer.current_epoch) == os.environ.get("STALL_IN_EPOCH"):
            time.sleep(300)


def _driver(storage: Path | str, out: Path, **env: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    environment["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # the session's cluster
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(storage), str(out)],
        env=environment, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_a_killed_driver_started_again_resumes_its_run(free_cluster, s3, tmp_path, monkeypatch):
    """On S3 (moto's server on 127.0.0.1), reached through the drivers' environment (AWS_*),
    which reaches the workers: no shared file system between the drivers and the workers.
    (Named runs on a local folder: tests/test_checkpoint_lifecycle.py.)"""
    bucket = s3.new_bucket()
    storage = f"s3://{bucket}/runs"
    env = s3.env
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # for this process's own fit below

    def names() -> list[str]:
        return [key.rsplit("/", 1)[1] for key in s3.keys(bucket, "runs/digits-v3/")]

    first = _driver(storage, tmp_path / "never.pt", STALL_IN_EPOCH="2", **env)
    deadline = time.monotonic() + 120
    # epoch 0's and epoch 1's resume checkpoints are written, then the driver waits in epoch 2
    while not any(name.startswith("resume-epoch=1-") for name in names()):
        assert first.poll() is None, first.stdout.read() if first.stdout else ""
        assert time.monotonic() < deadline, "the first driver wrote no resume checkpoint"
        time.sleep(0.5)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    while leftovers() != ([], []):  # Ray ends a dead driver's actors and placement group
        assert time.monotonic() < deadline + 60, "the dead driver's workers stayed"
        time.sleep(0.5)

    second = _driver(storage, tmp_path / "resumed.pt", **env)
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out[-3000:]
    assert "global step 18" in out, out[-3000:]  # 3 epochs of 6 steps, as if never stopped
    # the last two resume checkpoints stay, for a driver that dies later
    kept = sorted(name for name in names() if name.endswith(".ckpt"))
    assert kept == ["resume-epoch=1-step=12.ckpt", "resume-epoch=2-step=18.ckpt"], (
        kept,
        out[-3000:],
    )

    pl.seed_everything(0)
    model = TinyModel()
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2), max_epochs=3, enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(model, loader())
    resumed = torch.load(tmp_path / "resumed.pt")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=0)

    # the same name for another model: refused before any worker starts, naming the run
    class OtherModel(TinyModel):
        pass

    other = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2, checkpoint_storage=str(storage), run_name="digits-v3"),
        max_epochs=3, **quiet_trainer_kwargs(),
    )  # fmt: skip
    with pytest.raises(
        ConfigurationError, match=r"run_name='digits-v3' names a run in .*OtherModel"
    ):
        other.fit(OtherModel(), loader())
