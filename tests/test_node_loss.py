"""A node leaves a multi-node ray.cluster_utils.Cluster while a rank on it trains."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import ray
import torch
from packaging.version import Version
from ray.cluster_utils import Cluster

from ray_lightning_sgd import RaySGDStrategy, WorkerDiedError
from tests.conftest import leftovers
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs, tiny_ray_data

# with Ray 2.52, removing a node of a ray.cluster_utils.Cluster ends the test process itself (seen in
# CI: the whole pytest run vanished without output); Ray 2.60 removes only the node's processes
pytestmark = pytest.mark.skipif(
    Version(ray.__version__) < Version("2.60"),
    reason="ray.cluster_utils.Cluster.remove_node of Ray < 2.60 ends the test process",
)


@pytest.fixture(scope="module")
def head_node():
    ray.shutdown()  # these tests remove nodes: they need a cluster of their own
    # the cluster marks a removed node dead within about 3 s instead of Ray's 15 (a health check
    # every 3 s, dead after 5 misses): each test waits for the previous test's node to be gone
    checks = {
        "health_check_period_ms": 1000,
        "health_check_timeout_ms": 1000,
        "health_check_failure_threshold": 3,
    }
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": checks}
    )
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def head_and_worker_node(head_node):
    """The module's head node and a new worker node, which the test removes."""
    worker_node = head_node.add_node(num_cpus=1)
    head_node.wait_for_nodes()
    yield head_node, worker_node
    if worker_node in head_node.worker_nodes:
        head_node.remove_node(worker_node, allow_graceful=False)


class NodeReporter(TinyModel):
    """Writes each rank's node id to a folder (in the first attempt: a restart leaves the files),
    then trains slowly enough to be caught mid-fit."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def on_train_start(self) -> None:
        report = Path(self.folder, f"rank-{self.global_rank}")
        if not report.exists():
            report.write_text(ray.get_runtime_context().get_node_id())

    def training_step(self, batch, batch_idx):
        if not Path(self.folder, "node-removed").exists():  # slow only until the node is gone
            time.sleep(0.1)
        return super().training_step(batch, batch_idx)


def _once_both_ranks_train(folder: Path, action) -> threading.Thread:
    """Runs ``action`` in a thread once both ranks of a NodeReporter fit have reported."""

    def wait_then_act() -> None:
        deadline = time.monotonic() + 60
        while len(list(folder.glob("rank-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        action()

    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("graceful", [False, True], ids=["node-killed", "node-drained"])
def test_losing_a_node_fails_the_fit_within_10_seconds(head_and_worker_node, tmp_path, graceful):
    cluster, worker_node = head_and_worker_node
    removed_at: list[float] = []

    def remove_the_worker_node() -> None:
        time.sleep(1)  # both ranks are in the training loop
        removed_at.append(time.monotonic())
        cluster.remove_node(worker_node, allow_graceful=graceful)

    remover = _once_both_ranks_train(tmp_path, remove_the_worker_node)
    strategy = RaySGDStrategy(
        num_workers=2, placement_strategy="STRICT_SPREAD", reuse_workers=False
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=100,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    with pytest.raises(WorkerDiedError) as caught:
        trainer.fit(NodeReporter(str(tmp_path)), loader())
    took = time.monotonic() - removed_at[0]
    remover.join()
    assert took < 10, f"the driver took {took:.1f}s to report the lost node"
    lost_rank = next(
        int(p.name.split("-")[1])
        for p in tmp_path.glob("rank-*")
        if p.read_text() == worker_node.node_id
    )
    err = caught.value
    assert err.rank == lost_rank, str(err)
    assert err.node_id == worker_node.node_id
    assert f"rank {lost_rank}" in str(err)
    assert leftovers() == ([], [])
    assert trainer.interrupted


#: Long enough (0.1 s a step until the node is gone) that the first attempt outlasts the drain
EPOCHS = 30


def test_a_preempted_node_restarts_the_fit_without_counting_a_failure(
    head_and_worker_node, tmp_path, caplog
):
    cluster, worker_node = head_and_worker_node
    drained: list[str] = []

    def preempt_the_worker_node() -> None:
        # what an autoscaler does to a spot node it was told about: drain for preemption, then
        # the node goes away
        result = subprocess.run(
            [str(Path(sys.executable).with_name("ray")), "drain-node",
             f"--address={cluster.address}", f"--node-id={worker_node.node_id}",
             "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot instance reclaimed",
             "--deadline-remaining-seconds=1"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        drained.append(result.stdout + result.stderr)
        cluster.remove_node(worker_node, allow_graceful=False)
        (tmp_path / "node-removed").touch()

    preempter = _once_both_ranks_train(tmp_path, preempt_the_worker_node)
    # max_failures=0: a worker failure would end the fit; a preemption restarts it (no limit)
    strategy = RaySGDStrategy(
        num_workers=2, num_cpus_per_worker=0.5, placement_strategy="SPREAD", reuse_workers=False
    )
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=EPOCHS, enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        trainer.fit(NodeReporter(str(tmp_path)), loader())
    preempter.join()
    nodes = {p.read_text() for p in tmp_path.glob("rank-*")}  # the first attempt's
    assert worker_node.node_id in nodes, "no rank ran on the preempted node"
    assert trainer.global_step == EPOCHS * 6  # the restarted fit ran to its end
    assert "Restart 1 (no limit) after a preemption" in caplog.text, (caplog.text, drained)
    assert "its node was preempted" in caplog.text
    assert leftovers() == ([], [])


class EpochSizeReporter(NodeReporter):
    """Also notes, at each epoch's start, how many workers train it (the attempt that trains an
    epoch last overwrites what a lost one noted); slow while a single worker trains."""

    def on_train_epoch_start(self) -> None:
        if self.global_rank == 0:
            Path(self.folder, f"epoch-{self.current_epoch}").write_text(
                str(self.trainer.world_size)
            )

    def training_step(self, batch, batch_idx):
        # slow until the node is gone, and on one worker: the run regroups before its end
        removed = Path(self.folder, "node-removed").exists()
        time.sleep(0.2 if self.trainer.world_size == 1 or not removed else 0.02)
        return TinyModel.training_step(self, batch, batch_idx)


ELASTIC_EPOCHS = 12


def test_an_elastic_fit_shrinks_when_a_node_is_lost_and_grows_when_one_comes_back(
    head_and_worker_node, tmp_path, caplog
):
    cluster, worker_node = head_and_worker_node
    strategy = RaySGDStrategy(
        num_workers=(1, 2), max_failures=1, resize_interval_s=1, reuse_workers=False
    )
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=ELASTIC_EPOCHS,
        enable_checkpointing=False, **quiet_trainer_kwargs(),
    )  # fmt: skip
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit(EpochSizeReporter(str(tmp_path)), loader())
        except BaseException as err:  # noqa: BLE001  (the main thread raises it)
            failed.append(err)

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert fitting.is_alive(), f"the fit ended before {what}: {failed}"
            assert time.monotonic() < deadline, f"no {what} within 60 s"
            time.sleep(0.05)

    # the fit runs in a thread: Cluster adds nodes from the main thread only
    fitting = threading.Thread(target=fit, daemon=True)
    added = None
    with caplog.at_level(logging.INFO, logger="ray_lightning_sgd"):
        fitting.start()
        try:
            # the checkpoint of epoch 0 is written once epoch 1 starts
            wait_for(lambda: (tmp_path / "epoch-1").exists(), "second epoch")
            cluster.remove_node(worker_node, allow_graceful=False)
            (tmp_path / "node-removed").touch()
            wait_for(
                lambda: "1" in {p.read_text() for p in tmp_path.glob("epoch-*")},
                "epoch on one worker",
            )
            added = cluster.add_node(num_cpus=1)  # as an autoscaler's new node joins
            fitting.join(120)
        finally:
            if fitting.is_alive():
                trainer.strategy.launcher.kill(15)  # type: ignore[union-attr]
                fitting.join(30)
            if added is not None:
                cluster.remove_node(added, allow_graceful=False)
    assert not failed, failed
    sizes = strategy.world_sizes
    assert trainer.current_epoch == ELASTIC_EPOCHS
    assert sorted(sizes) == list(range(ELASTIC_EPOCHS))
    # what rank 0 saw at each epoch's start, in the attempt that trained the epoch last
    assert sizes == {e: int((tmp_path / f"epoch-{e}").read_text()) for e in sizes}
    # two workers, then one after the node was lost, then two again at an epoch boundary
    runs = [size for i, size in sorted(sizes.items()) if i == 0 or sizes[i - 1] != size]
    assert runs == [2, 1, 2], sizes
    # 12 batches an epoch: 6 optimizer steps on each of two workers, 12 on one
    assert trainer.global_step == sum(12 // size for size in sizes.values())
    assert trainer.world_size == 2
    assert "Restart 1 (of max_failures=1) after a worker failure" in caplog.text
    assert "Regroup 1: the cluster has room for more than 1 workers" in caplog.text
    assert "World size by epoch: epoch" in caplog.text
    assert leftovers() == ([], [])


class RowsPerEpoch(pl.LightningModule):
    """Counts, on rank 0, the rows of each epoch and the world size that read them (the attempt
    that trains an epoch last overwrites what a lost one noted)."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.net = torch.nn.Linear(8, 2)
        self.rows = 0

    def on_train_epoch_start(self) -> None:
        self.rows = 0
        if self.global_rank == 0:
            Path(self.folder, f"rank-{self.trainer.world_size}").touch()

    def training_step(self, batch, batch_idx):
        self.rows += len(batch[1])
        if not Path(self.folder, "node-removed").exists():
            time.sleep(0.1)  # slow until the node is gone: the loss comes mid-epoch
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:
            Path(self.folder, f"epoch-{self.current_epoch}").write_text(
                f"{self.trainer.world_size} {self.rows}"
            )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_elastic_fit_on_ray_data_splits_again_at_the_size_it_shrank_to(
    head_and_worker_node, tmp_path
):
    cluster, worker_node = head_and_worker_node
    # half a CPU a worker, one a node: the lost node takes a rank with it
    strategy = RaySGDStrategy(
        num_workers=(1, 2), num_cpus_per_worker=0.5, placement_strategy="STRICT_SPREAD",
        max_failures=1, resize_interval_s=600, reuse_workers=False,
    )  # fmt: skip
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=2, enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )  # fmt: skip

    def remove_node_in_epoch_1() -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / "epoch-0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.remove_node(worker_node, allow_graceful=False)
        (tmp_path / "node-removed").touch()

    remover = threading.Thread(target=remove_node_in_epoch_1, daemon=True)
    remover.start()
    trainer.fit(RowsPerEpoch(str(tmp_path)), datamodule=tiny_ray_data())
    remover.join()
    assert (tmp_path / "rank-2").exists() and (tmp_path / "rank-1").exists()
    epochs = [(tmp_path / f"epoch-{e}").read_text() for e in range(2)]
    # 96 rows: 48 a rank on two workers; the attempt on one, split again, reads them all
    assert epochs == ["2 48", "1 96"], epochs
    assert strategy.world_sizes == {0: 2, 1: 1}
    assert leftovers() == ([], [])
