"""Several Ray nodes on one machine (ray.cluster_utils.Cluster): ranks and training across nodes,
the driver's own code on a node that lacks it, and the logs and checkpoints of rank 0 on the driver
when rank 0 runs on a node with its own folders.

The cluster's second node starts in a working directory of its own, and the Trainer writes to a
relative ``default_root_dir``: rank 0 on that node writes under its folder, which the driver does
not see, as on a cluster without a shared file system. One cluster serves the module (starting one
is seconds of the suite's two cores).
"""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import ray
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from ray.cluster_utils import Cluster

from ray_lightning_sgd import RaySGDStrategy, WorkerGroup, WorkerGroupConfig
from ray_lightning_sgd._driver import artifacts
from tests.conftest import assert_only_idle_workers_left, leftovers
from tests.helpers import TinyData, TinyModel, loader, quiet_trainer_kwargs
from tests.light_functions import where


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head node (resource ``near``) and a second node (resource ``far``), 1 CPU each, whose
    processes work in folders of their own; yields the folders: ``head``, ``far``, ``driver``."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("head", "far", "driver")}
    ray.shutdown()  # this module needs a cluster of its own
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


def test_ranks_follow_nodes(two_nodes):
    group = WorkerGroup(WorkerGroupConfig(num_workers=2, placement_strategy="STRICT_SPREAD"))
    group.start()
    try:
        results = group.execute(where)
    finally:
        group.shutdown()
    assert len({node for node, *_ in results}) == 2, "one worker per node"
    assert [r[1:] for r in results] == [(0, 0, 0, 2), (1, 1, 0, 2)]
    assert leftovers() == ([], [])


def test_training_across_nodes_matches_one_node(two_nodes):
    def fit(strategy: RaySGDStrategy) -> dict[str, torch.Tensor]:
        pl.seed_everything(0)
        model = TinyModel()
        trainer = pl.Trainer(
            strategy=strategy, max_epochs=1, enable_checkpointing=False, **quiet_trainer_kwargs()
        )
        trainer.fit(model, loader())
        assert trainer.global_step == 6
        return model.state_dict()

    spread = fit(RaySGDStrategy(num_workers=2, placement_strategy="STRICT_SPREAD"))
    packed = fit(
        RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.5, placement_strategy="STRICT_PACK")
    )
    for key in spread:
        torch.testing.assert_close(spread[key], packed[key], atol=1e-6, rtol=0)
    # the second configuration freed the first one's idle workers before it started its own
    assert assert_only_idle_workers_left() == 1


SHIPPED = """
import os
from tests.helpers import TinyModel

ORIGINAL = {original!r}


class ShippedModel(TinyModel):
    def training_step(self, batch, batch_idx):
        # 1 on a worker that imported Ray's shipped copy of this file, 0 on one that read it here
        copy = float(os.path.realpath(__file__) != ORIGINAL)
        self.log("copy_max", copy, sync_dist=True, reduce_fx="max")
        self.log("copy_min", copy, sync_dist=True, reduce_fx="min")
        return super().training_step(batch, batch_idx)
"""


def test_the_drivers_own_module_reaches_a_node_that_lacks_it(two_nodes, tmp_path, monkeypatch):
    # a folder only the driver's sys.path names (added after ray.init, so not even Ray's record
    # of the driver's folders has it): the second node's worker has no way to it but Ray's copy
    src = tmp_path / "src"
    src.mkdir()
    module_file = src / "shipped_model.py"
    module_file.write_text(SHIPPED.format(original=os.path.realpath(module_file)))
    monkeypatch.syspath_prepend(str(src))
    import shipped_model

    def fit(**kwargs) -> pl.Trainer:
        trainer = pl.Trainer(
            strategy=RaySGDStrategy(num_workers=2, placement_strategy="STRICT_SPREAD", **kwargs),
            max_epochs=1,
            enable_checkpointing=False,
            **quiet_trainer_kwargs(),
        )
        trainer.fit(shipped_model.ShippedModel(), loader())
        return trainer

    try:
        with pytest.raises(
            ModuleNotFoundError, match=r"on node .* cannot import 'shipped_model'"
        ) as raised:
            fit(ship_driver_code=False, reuse_workers=False)
        assert "keep ship_driver_code=True" in str(raised.value)
        metrics = fit(reuse_workers=False).callback_metrics
    finally:
        sys.modules.pop("shipped_model", None)
    # the driver's node read the file itself, the other node imported the shipped copy
    assert (metrics["copy_min"], metrics["copy_max"]) == (0.0, 1.0)
    assert leftovers() == ([], [])


def _fit_with_artifacts(strategy, root: str):
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


def test_rank_0_files_from_another_node_land_on_the_driver(two_nodes, monkeypatch, caplog):
    folders = two_nodes
    monkeypatch.chdir(folders["driver"])
    far = RaySGDStrategy(num_workers=1, resources_per_worker={"CPU": 1, "far": 1})
    with caplog.at_level(logging.INFO, logger="ray_lightning_sgd._driver.artifacts"):
        trainer, checkpoint = _fit_with_artifacts(far, "run")
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


def test_rank_0_on_the_drivers_node_in_another_folder_sends_its_files(two_nodes, monkeypatch):
    # the head node's processes work in their own folder: a relative path there is not the
    # driver's, although the node is the same
    folders = two_nodes
    monkeypatch.chdir(folders["driver"])
    near = RaySGDStrategy(num_workers=1, resources_per_worker={"CPU": 1, "near": 1})
    _, checkpoint = _fit_with_artifacts(near, "near-run")
    assert (folders["head"] / checkpoint.best_model_path).is_file()
    assert (folders["driver"] / checkpoint.best_model_path).is_file()
    ray_lightning_sgd_shutdown()


def test_a_shared_folder_is_not_copied(two_nodes, tmp_path, caplog):
    far = RaySGDStrategy(num_workers=1, resources_per_worker={"CPU": 1, "far": 1})
    with caplog.at_level(logging.INFO, logger="ray_lightning_sgd._driver.artifacts"):
        # absolute: the same folder on both nodes
        _, checkpoint = _fit_with_artifacts(far, str(tmp_path / "shared"))
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


def test_a_sharded_checkpoint_folder_is_not_copied_and_the_files_beside_it_are(tmp_path):
    """Rank 0 on another node than the driver's: its whole checkpoint files and logs come; a
    folder in torch's distributed format does not (rank 0's shard alone would look whole)."""
    import time

    from ray_lightning_sgd._boundary.artifacts import Artifacts
    from ray_lightning_sgd._worker.artifacts import collect

    started = time.time()
    sharded = tmp_path / "epoch=0-step=6.ckpt"
    sharded.mkdir()
    for name in (".metadata", "__0_0.distcp", "meta.pt"):
        (sharded / name).write_bytes(b"shard")
    (tmp_path / "last.ckpt").write_bytes(b"whole")
    trainer = SimpleNamespace(loggers=[], checkpoint_callbacks=[SimpleNamespace(dirpath=tmp_path)])
    files = collect(Artifacts(str(tmp_path / "no-probe")), trainer, started)  # type: ignore[arg-type]
    assert files == {str(tmp_path / "last.ckpt"): b"whole"}


def ray_lightning_sgd_shutdown() -> None:
    from ray_lightning_sgd import shutdown_workers

    shutdown_workers()
    assert leftovers() == ([], [])
