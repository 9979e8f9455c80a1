"""Object storage, for real: moto's S3 server on 127.0.0.1 (``s3`` in tests/conftest.py), reached by
the workers over HTTP as any S3 endpoint. A lost rank resumes from an S3 checkpoint written inside
an epoch; workers that cannot reach the storage are refused before training; Lightning's own
``s3://`` paths leave what ``ddp`` leaves; a sharded named run keeps its last checkpoints there and
resumes; an upload that fails leaves the previous checkpoint as the resume point."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from ray_lightning_sgd import ConfigurationError, RayModelParallelStrategy, RaySGDStrategy
from ray_lightning_sgd._boundary.resume_points import newest_complete_point
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs
from tests.s3 import KEY, S3, SECRET, s3_server

ROOT = Path(__file__).resolve().parents[1]


def _wait_for_key(
    endpoint: str, bucket: str, suffix: str, timeout_s: float = 60, alone: bool = False
) -> str:
    """Runs anywhere (a worker too): waits until an object whose key ends with ``suffix``
    exists in ``bucket`` (with ``alone``: and no other resume checkpoint, which rank 0 deletes
    once the driver holds the new one, with keep_last=1); returns its key."""
    server = S3(endpoint)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keys = server.keys(bucket)
        found = [key for key in keys if key.endswith(suffix)]
        others = [key for key in keys if "/resume-" in key and not key.endswith(suffix)]
        if found and not (alone and others):
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no object ending with {suffix} in {bucket} within {timeout_s}s")


class LostAfterCheckpoint(TinyModel):
    """Rank 1's process exits once at global step ``step``, once the checkpoint named
    ``suffix`` is the bucket's only one (keep_last=1: the driver holds its point)."""

    def __init__(self, step: int, endpoint: str, bucket: str, suffix: str, marker: str) -> None:
        super().__init__()
        self.fault = (step, endpoint, bucket, suffix, marker)

    def training_step(self, batch, batch_idx):
        step, endpoint, bucket, suffix, marker = self.fault
        if self.global_rank == 1 and self.global_step == step and not os.path.exists(marker):
            _wait_for_key(endpoint, bucket, suffix, alone=True)
            Path(marker).touch()
            os._exit(3)
        return super().training_step(batch, batch_idx)


def _trainer(strategy, max_epochs: int = 3, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=max_epochs,
        enable_checkpointing=False, **{**quiet_trainer_kwargs(), **kwargs},
    )  # fmt: skip


def test_a_lost_rank_resumes_from_an_s3_checkpoint_inside_the_epoch(
    ray_cluster, s3, tmp_path, caplog, capfd
):
    """max_failures=1, checkpoint_every_n_steps=4 (and every 2 epochs: no epoch end's
    checkpoint before epoch 1's, which a waiting in-epoch one would never replace) and
    storage_options (the endpoint and keys, given once): rank 1 is lost at step 9, once the
    checkpoint of step 8 (2 batches into epoch 1) reached S3 and the driver holds it; the fit
    resumes there, trains each remaining batch once, and ends with the weights of a run never
    interrupted; a succeeded fit's folder leaves the bucket."""
    pl.seed_everything(0)
    reference = TinyModel()
    _trainer(RaySGDStrategy(num_workers=2)).fit(reference, loader(shuffle=True))

    bucket = s3.new_bucket()
    marker = str(tmp_path / "lost")
    pl.seed_everything(0)
    model = LostAfterCheckpoint(9, s3.endpoint, bucket, "resume-epoch=1-step=8-batches=2.ckpt",
                                marker)  # fmt: skip
    strategy = RaySGDStrategy(
        num_workers=2, max_failures=1, checkpoint_every_n_steps=4, checkpoint_every_n_epochs=2,
        keep_last=1, checkpoint_storage=f"s3://{bucket}/runs", storage_options=s3.storage_options,
    )  # fmt: skip
    assert SECRET not in repr(strategy._run_config)
    logger = CSVLogger(tmp_path / "logs")
    trainer = _trainer(strategy, logger=logger, log_every_n_steps=1)
    with caplog.at_level(logging.INFO, logger="ray_lightning_sgd"):
        trainer.fit(model, loader(shuffle=True))
    assert os.path.exists(marker), "rank 1 was not lost"
    assert "fit resumes in epoch 1 after 2 batches (global step 8)" in caplog.text, caplog.text
    assert SECRET not in caplog.text and SECRET not in "".join(capfd.readouterr())
    assert trainer.global_step == 18
    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["step"]) for row in rows if row["train_loss"]] == list(range(18))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-6, rtol=0)
    assert s3.keys(bucket, "runs/run-") == []  # the launch's own folder went with its success


class RecordsTraining(TinyModel):
    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def training_step(self, batch, batch_idx):
        Path(self.marker).touch()
        return super().training_step(batch, batch_idx)


def test_workers_that_cannot_reach_the_storage_are_refused_before_training(
    ray_cluster, s3, tmp_path, monkeypatch
):
    """The driver reaches the endpoint (its environment: its check passes); the workers' nodes
    do not (their AWS_ENDPOINT_URL, set by worker_env, points nowhere). Rank 0 says so before
    any step, naming the storage and the fix, and never the secret key."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    bucket = s3.new_bucket()
    marker = tmp_path / "trained"
    strategy = RaySGDStrategy(
        num_workers=2, max_failures=1, checkpoint_storage=f"s3://{bucket}/runs",
        worker_env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"},
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as raised:
        _trainer(strategy).fit(RecordsTraining(str(marker)), loader())
    message = str(raised.value)
    assert f"rank 0 (on {os.uname().nodename}) cannot write s3://{bucket}/runs/run-" in message
    assert "storage_options=" in message and "worker_env=" in message
    assert SECRET not in message and KEY not in message
    assert not marker.exists(), "a step trained before the refusal"
    assert time.monotonic() - started < 60


def test_a_storage_the_driver_cannot_reach_is_refused_without_its_secret(s3, monkeypatch):
    """storage_options with a secret and an endpoint nothing listens on: the driver's check
    refuses before Ray is touched, naming the storage, and shows no option's value."""
    from ray_lightning_sgd._driver import launcher

    def connect() -> None:
        raise AssertionError("Ray was touched")

    monkeypatch.setattr(launcher.cluster, "connect", connect)
    options = {
        **s3.storage_options,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    strategy = RaySGDStrategy(
        num_workers=2, max_failures=1, checkpoint_storage="s3://nowhere/runs",
        storage_options=options,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"checkpoint_storage='s3://nowhere/runs'") as err:
        _trainer(strategy).fit(TinyModel(), loader())
    assert SECRET not in str(err.value) and SECRET not in repr(strategy.storage_options)


OWN_PATHS = textwrap.dedent(
    """
    import json, sys
    import pytorch_lightning as pl
    from tests.test_object_storage import fit_with_own_s3_paths

    mode, base, out = sys.argv[1:4]
    fit_with_own_s3_paths(mode, base, out)
    """
)


def fit_with_own_s3_paths(mode: str, base: str, out: str) -> None:
    """Lightning's own S3 paths: ``default_root_dir`` (where a ModelCheckpoint without a
    dirpath writes) and a ModelCheckpoint's ``dirpath``; fit, then test the best checkpoint.
    The endpoint and keys come from the environment (``AWS_*``)."""
    if mode == "ddp":
        strategy: dict = {"strategy": "ddp", "devices": 2}
    else:
        strategy = {"strategy": RaySGDStrategy(num_workers=2)}
    pl.seed_everything(0)
    model = TinyModel()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, default_root_dir=base, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(monitor="val_loss", save_top_k=1),
            ModelCheckpoint(dirpath=f"{base}/ckpts", monitor="val_acc", mode="max", save_top_k=2,
                            save_last=True, filename="{epoch}-{val_acc:.4f}"),
        ],
        **strategy,
    )  # fmt: skip
    trainer.fit(model, loader(shuffle=True), loader(32))
    results = trainer.test(model, loader(32), ckpt_path="best")
    if trainer.global_rank == 0:
        paths = [cb.best_model_path for cb in trainer.checkpoint_callbacks]
        with open(out, "w") as file:
            json.dump({"best": paths, "test": results, "step": trainer.global_step}, file)


def test_lightnings_own_s3_paths_leave_what_ddp_leaves(ray_cluster, s3, tmp_path, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    bucket = s3.new_bucket()
    script = tmp_path / "own_paths.py"
    script.write_text(OWN_PATHS)
    ddp = subprocess.Popen(
        [sys.executable, str(script), "ddp", f"s3://{bucket}/ddp", str(tmp_path / "ddp.json")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        fit_with_own_s3_paths("ray", f"s3://{bucket}/ray", str(tmp_path / "ray.json"))
    finally:
        out, _ = ddp.communicate(timeout=300)
    assert ddp.returncode == 0, out[-3000:]
    got, expected = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("ray", "ddp"))
    assert got["step"] == expected["step"] == 12  # 6 steps an epoch
    assert [p.replace("/ray/", "/ddp/") for p in got["best"]] == expected["best"]
    assert got["best"][0].startswith(f"s3://{bucket}/ray/checkpoints/epoch=")
    assert got["test"][0]["test_loss"] == pytest.approx(expected["test"][0]["test_loss"], abs=1e-6)
    objects = {
        m: [k.removeprefix(f"{m}/") for k in s3.keys(bucket, f"{m}/")] for m in ("ray", "ddp")
    }
    assert objects["ray"] == objects["ddp"], objects
    assert "ckpts/last.ckpt" in objects["ray"] and len(objects["ray"]) == 4, objects


def test_a_sharded_named_run_keeps_its_last_checkpoints_on_s3_and_resumes(ray_cluster, s3, caplog):
    """FSDP2 (RayModelParallelStrategy) with a named run on S3 and checkpoints every 2 steps:
    each checkpoint is saved whole on rank 0's disk and uploaded; keep_last=2 leaves the newest
    two (in-epoch ones counted); a second fit of the run resumes from the newest."""
    from tests.sharded_models import ShardedMLP
    from tests.test_sharded import FSDP2, needs_cpu_fsdp2

    if needs_cpu_fsdp2.args[0]:
        pytest.skip(needs_cpu_fsdp2.kwargs["reason"])
    bucket = s3.new_bucket()

    def fit(epochs: int) -> pl.Trainer:
        strategy = RayModelParallelStrategy(
            num_workers=2, checkpoint_storage=f"s3://{bucket}/runs", run_name="sharded",
            storage_options=s3.storage_options, checkpoint_every_n_steps=2, keep_last=2, **FSDP2,
        )  # fmt: skip
        pl.seed_everything(0)
        trainer = _trainer(strategy, max_epochs=epochs)
        trainer.fit(ShardedMLP(), loader())
        return trainer

    assert fit(1).global_step == 6  # 96 samples, 8 a batch, 2 ranks: 6 steps an epoch
    # checkpoints at steps 2 and 4 and the epoch's end (step 6); one written while another was
    # uploaded may be replaced by a newer one before its own upload
    newest, other = _kept(s3.keys(bucket), "resume-epoch=0-step=6.ckpt")
    assert re.fullmatch(r"resume-epoch=0-step=(2|4)-batches=\1\.ckpt", other), newest
    with caplog.at_level(logging.INFO, logger="ray_lightning_sgd"):
        assert fit(2).global_step == 12
    assert "resumes from its resume checkpoint of epoch 0 (global step 6)" in caplog.text
    newest, other = _kept(s3.keys(bucket), "resume-epoch=1-step=12.ckpt")
    assert re.fullmatch(r"resume-epoch=1-step=(8|10)-batches=(2|4)\.ckpt", other), newest


def _kept(keys: list[str], newest: str) -> tuple[list[str], str]:
    """The names of a named run's objects, which must be its run.json, ``newest`` and one
    other resume checkpoint (keep_last=2), and that other one's name."""
    names = [key.removeprefix("runs/sharded/") for key in keys]
    others = [name for name in names if name not in ("run.json", newest)]
    assert len(names) == 3 and len(others) == 1, names
    return names, others[0]


class WaitsForTheStoreToGo(TinyModel):
    """Rank 0, at epoch 1's start: once epoch 0's checkpoint is in the bucket, says it is
    ready and waits until the test has stopped the server."""

    def __init__(self, endpoint: str, bucket: str, folder: str) -> None:
        super().__init__()
        self.where = (endpoint, bucket, folder)

    def on_train_epoch_start(self) -> None:
        endpoint, bucket, folder = self.where
        if self.global_rank == 0 and self.current_epoch == 1:
            _wait_for_key(endpoint, bucket, "resume-epoch=0-step=6.ckpt")
            Path(folder, "ready").touch()
            deadline = time.monotonic() + 60
            while not Path(folder, "stopped").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def test_an_upload_that_fails_leaves_the_previous_checkpoint_as_the_resume_point(
    ray_cluster, s3, tmp_path, capfd
):
    """The store goes away after epoch 0's checkpoint (its server stops): the uploads of the
    later ones fail, training goes on, the fit's end says so; the bucket still holds epoch 0's
    checkpoint, whole, the run's newest, with no part of a failed upload beside it."""
    with s3_server() as store:  # the session's objects, on a server of this test's own
        bucket = store.new_bucket()
        port = int(store.endpoint.rsplit(":", 1)[1])
        options = {**store.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}}
        stopper_done = threading.Event()

        def stop_when_ready() -> None:
            deadline = time.monotonic() + 120
            while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            store.stop()
            (tmp_path / "stopped").touch()
            stopper_done.set()

        stopper = threading.Thread(target=stop_when_ready, daemon=True)
        stopper.start()
        strategy = RaySGDStrategy(
            num_workers=2, checkpoint_storage=f"s3://{bucket}/runs", run_name="refused",
            storage_options=options,
        )  # fmt: skip
        pl.seed_everything(0)
        trainer = _trainer(strategy, max_epochs=3)
        trainer.fit(WaitsForTheStoreToGo(store.endpoint, bucket, str(tmp_path)), loader())
        assert stopper_done.wait(5) and trainer.global_step == 18  # training went on
        err = capfd.readouterr().err
        assert "could not be sent" in err and "The fit's last resume checkpoint" in err, err
        assert SECRET not in err
    with s3_server(port) as again:  # the same objects, served again
        assert again.keys(bucket) == [
            "runs/refused/resume-epoch=0-step=6.ckpt",
            "runs/refused/run.json",
        ]
        from ray_lightning_sgd import _files

        _files.use_storage_options(f"s3://{bucket}/runs", again.storage_options)
        point, damaged = newest_complete_point(f"s3://{bucket}/runs/refused")
        assert point is not None and (point.epoch, point.global_step, damaged) == (0, 6, [])
