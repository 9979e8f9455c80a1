"""Logs and checkpoints of rank 0 on the driver, when rank 0 runs on a node with its own folders.

The cluster's second node starts in a working directory of its own, and the Trainer writes to a
relative ``default_root_dir``: rank 0 on that node writes under its folder, which the driver does
not see, as on a cluster without a shared file system.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import ray
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from ray.cluster_utils import Cluster

from ray_lightning_sgd import RaySGDStrategy
from ray_lightning_sgd._driver import artifacts
from tests.conftest import leftovers
from tests.helpers import TinyData, TinyModel


@pytest.fixture(scope="module")
def nodes_with_own_folders(tmp_path_factory):
    folders = {name: tmp_path_factory.mktemp(name) for name in ("head", "far", "driver")}
    ray.shutdown()
    here = os.getcwd()
    try:
        os.chdir(folders["head"])
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"near": 1}}
        )
        os.chdir(folders["far"])  # the node's processes start here
        cluster.add_node(num_cpus=1, resources={"far": 1})
    finally:
        os.chdir(here)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield folders
    ray.shutdown()
    cluster.shutdown()


def _fit(strategy, root: str):
    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=2,
        default_root_dir=root,
        logger=CSVLogger(save_dir=root),
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModel(), datamodule=TinyData())
    return trainer, checkpoint


def test_rank_0_files_from_another_node_land_on_the_driver(
    nodes_with_own_folders, monkeypatch, caplog
):
    folders = nodes_with_own_folders
    monkeypatch.chdir(folders["driver"])
    far = RaySGDStrategy(num_workers=1, resources_per_worker={"CPU": 1, "far": 1})
    with caplog.at_level(logging.INFO, logger="ray_lightning_sgd._driver.artifacts"):
        trainer, checkpoint = _fit(far, "run")
    best = checkpoint.best_model_path
    assert best.startswith("run/") and best.endswith(".ckpt")
    assert (folders["far"] / best).is_file(), "rank 0 wrote it on its node"
    assert (folders["driver"] / best).is_file(), "and the driver has a copy"
    assert TinyModel.load_from_checkpoint(best).net[0].weight.shape == (16, 8)
    metrics = folders["driver"] / trainer.logger.log_dir / "metrics.csv"
    assert metrics.is_file() and "val_loss" in metrics.read_text()
    assert "Copied" in caplog.text
    assert not list((folders["driver"] / "run").glob(".ray_lightning_sgd-probe-*"))
    ray_lightning_sgd_shutdown()


def test_rank_0_on_the_drivers_node_in_another_folder_sends_its_files(
    nodes_with_own_folders, monkeypatch
):
    # the head node's processes work in their own folder: a relative path there is not the
    # driver's, although the node is the same
    folders = nodes_with_own_folders
    monkeypatch.chdir(folders["driver"])
    near = RaySGDStrategy(num_workers=1, resources_per_worker={"CPU": 1, "near": 1})
    _, checkpoint = _fit(near, "near-run")
    assert (folders["head"] / checkpoint.best_model_path).is_file()
    assert (folders["driver"] / checkpoint.best_model_path).is_file()
    ray_lightning_sgd_shutdown()


def test_a_shared_folder_is_not_copied(nodes_with_own_folders, tmp_path, caplog):
    far = RaySGDStrategy(num_workers=1, resources_per_worker={"CPU": 1, "far": 1})
    with caplog.at_level(logging.INFO, logger="ray_lightning_sgd._driver.artifacts"):
        _, checkpoint = _fit(far, str(tmp_path / "shared"))  # absolute: the same folder on both
    assert os.path.isfile(checkpoint.best_model_path)
    assert "Copied" not in caplog.text
    ray_lightning_sgd_shutdown()


def test_remote_uris_are_never_copied():
    trainer = SimpleNamespace(
        default_root_dir="s3://bucket/run",
        loggers=[SimpleNamespace(save_dir="gs://bucket/logs")],
        checkpoint_callbacks=[SimpleNamespace(dirpath="memory://ckpts")],
    )
    assert artifacts.prepare(trainer) is None


def ray_lightning_sgd_shutdown() -> None:
    from ray_lightning_sgd import shutdown_workers

    shutdown_workers()
    assert leftovers() == ([], [])
