"""Ray Data: datasets read by ray.data from parquet files stream to the workers, split per call.

Real pipelines on the session's cluster: files written with pyarrow, ``read_parquet``, a
``map_batches`` step, uneven files. The workers take half a CPU each, which leaves Ray Data's
read and map tasks the cluster's other CPU.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import pytorch_lightning as pl
import ray
import ray.data
import torch
from torch import nn
from torch.utils.data import DataLoader

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy, _compat
from ray_lightning_sgd._boundary.data_loader import ray_data
from ray_lightning_sgd._boundary.datasets import DatasetShard, DatasetSplit
from ray_lightning_sgd._driver import datasets
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._serialization import pack, unpack
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd.data import RayDataLoader
from ray_lightning_sgd.lightning import RayDataModule as LRayDataModule
from ray_lightning_sgd.lightning import RaySGDStrategy as LRaySGDStrategy
from ray_lightning_sgd.pytorch_lightning import RayDataModule
from tests.conftest import leftovers
from tests.light_functions import scaled, unchanged

#: Rows of each parquet file: uneven, and an odd total (the equal split drops one row a pass).
FILE_ROWS = (301, 250, 170)
ROWS = sum(FILE_ROWS)
FEATURES = 8


@pytest.fixture
def cpu_for_ray_data(ray_cluster):
    """The shared cluster with a CPU for Ray Data's tasks: the idle workers of earlier tests are
    stopped unless they are two of half a CPU (this module's), which the next test reuses."""
    for idle in list(pool._idle):
        config = idle.worker_group_config
        if config.num_workers > 2 or dict(config.resources_per_worker) != {"CPU": 0.5}:
            pool.shutdown(config)


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> str:
    """A folder of parquet files written with pyarrow: features, a label and a row id."""
    folder = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(0)
    first = 0
    for i, n in enumerate(FILE_ROWS):
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        table = pa.table(
            {
                "x": list(x),
                "y": (x.sum(axis=1) > 0).astype(np.int64),
                "id": np.arange(first, first + n),
            }
        )
        pq.write_table(table, folder / f"part-{i}.parquet")
        first += n
    return str(folder)


def _val_rows(n: int = 200) -> list[dict]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return [{"x": x[i], "y": int(x[i].sum() > 0), "id": 10_000 + i} for i in range(n)]


class RecorderSteps:
    """A classifier of the rows that notes, on each rank, the ids of every batch it read."""

    def __init__(
        self, folder: str, die_at: tuple[int, int, int] | None = None, schedule: bool = False
    ) -> None:
        super().__init__()
        self.schedule = schedule
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))
        self.folder = folder
        self.die_at = die_at  # (rank, epoch, batch): that rank's process ends there, once

    def _note(self, stage: str, ids: list[int], **extra) -> None:
        record = {"stage": stage, "epoch": self.current_epoch, "pid": os.getpid(), **extra}
        record["ids"] = ids
        with open(Path(self.folder, f"rank-{self.global_rank}.jsonl"), "a") as file:
            file.write(json.dumps(record) + "\n")

    def _loss(self, batch: dict) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch["x"]), batch["y"])

    def training_step(self, batch, batch_idx):
        if self.die_at == (self.global_rank, self.current_epoch, batch_idx):
            marker = Path(self.folder, "died")
            if not marker.exists():
                marker.touch()
                os._exit(1)
        self._note("train", batch["id"].tolist(), batches=self.trainer.num_training_batches)
        loss = self._loss(batch)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        stage = "sanity" if self.trainer.sanity_checking else "val"
        self._note(stage, batch["id"].tolist(), batches=self.trainer.num_val_batches)
        self.log("val_loss", self._loss(batch), sync_dist=True, batch_size=len(batch["id"]))

    def predict_step(self, batch, batch_idx):
        # the row's key goes back with its prediction: Ray Data's rows come in no fixed order
        return {"id": batch["id"], "label": self.net(batch["x"]).argmax(-1)}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.schedule:
            return optimizer
        # a schedule over the run's steps: needs the loader's length
        total = self.trainer.estimated_stepping_batches
        self._note("schedule", [], total_steps=total)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class Recorder(RecorderSteps, pl.LightningModule):
    pass


class LRecorder(RecorderSteps, L.LightningModule):
    pass


def _records(folder: Path) -> dict[int, list[dict]]:
    return {
        int(path.stem.split("-")[1]): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(folder.glob("rank-*.jsonl"))
    }


def _ids(records: list[dict], stage: str, epoch: int, pid: int | None = None) -> list[int]:
    return [
        i
        for r in records
        if r["stage"] == stage and r["epoch"] == epoch and pid in (None, r["pid"])
        for i in r["ids"]
    ]


def _data_state() -> tuple[list[str], int]:
    """The split coordinators alive, and the objects in the object store."""
    from ray._private import state
    from ray._private.internal_api import memory_summary

    alive = [
        a["ActorClassName"]
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == "SplitCoordinator"
    ]
    # the address of this driver's cluster: without one Ray looks for the last cluster recorded
    # on the machine, which an earlier test's `ray start` head may have been
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    found = re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", summary)
    return alive, int(found.group(1)) if found else -1


def _assert_nothing_of_the_calls_left(objects_before: int) -> None:
    deadline = time.monotonic() + 20  # ray.kill is asynchronous
    while True:
        coordinators, objects = _data_state()
        if (not coordinators and objects <= objects_before) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert coordinators == [], "a split's coordinator outlived its call"
    # other tests' objects may leave the shared store meanwhile; none of the calls' may stay
    assert objects <= objects_before, "blocks of the calls stayed in the object store"


def _trainer_kwargs() -> dict:
    return {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
    }


def test_each_rank_streams_an_equal_share_of_every_pass_and_predict_reads_every_row(
    cpu_for_ray_data, parquet, tmp_path
):
    # no idle warm workers of earlier tests hold the CPUs that Ray Data's tasks need (Ray
    # 2.52's read_parquet samples the files with tasks as the dataset is made)
    train = ray.data.read_parquet(parquet).map_batches(scaled)
    val = ray.data.from_items(_val_rows())  # a row count Ray Data knows without running it
    _, objects_before = _data_state()  # from_items put the validation rows there
    model = Recorder(str(tmp_path), schedule=True)
    strategy = RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.5)
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=2, num_sanity_val_steps=2, **_trainer_kwargs()
    )
    # the map_batches step hides the row count from Ray Data: num_rows tells it
    trainer.fit(model, RayDataLoader(train, batch_size=32, num_rows=ROWS),
                RayDataLoader(val, batch_size=16))  # fmt: skip

    records = _records(tmp_path)
    assert sorted(records) == [0, 1]
    share = ROWS // 2  # the equal split drops the odd row of each pass
    for epoch in (0, 1):
        ranks = [_ids(records[r], "train", epoch) for r in (0, 1)]
        assert [len(ids) for ids in ranks] == [share, share], epoch
        assert not set(ranks[0]) & set(ranks[1]), "a row was read by both ranks in one epoch"
        assert len(set(ranks[0] + ranks[1])) == ROWS - 1
        # validation is sharded too: each rank validates its half
        vals = [_ids(records[r], "val", epoch) for r in (0, 1)]
        assert [len(ids) for ids in vals] == [100, 100]
        assert set(vals[0]) | set(vals[1]) == {row["id"] for row in _val_rows()}
    # the sanity check read 2 batches and left its pass half-read; the epochs went on
    assert [len(_ids(records[r], "sanity", 0)) for r in (0, 1)] == [32, 32]
    # lengths known: Lightning's batch counts, and the schedule's number of steps
    first = next(r for r in records[0] if r["stage"] == "train")
    assert first["batches"] == -(-share // 32)
    schedule = next(r for r in records[0] if r["stage"] == "schedule")
    assert schedule["total_steps"] == 2 * first["batches"]
    assert next(r for r in records[0] if r["stage"] == "val")["batches"] == [7]
    assert trainer.global_step == 2 * first["batches"]

    # sync_dist over equal shards: the metric of a DataLoader over the same rows
    checked = trainer.validate(model, RayDataLoader(val, batch_size=16))[0]["val_loss"]
    rows = _val_rows()
    local = pl.Trainer(devices=1, **_trainer_kwargs())
    expected = local.validate(model, DataLoader(rows, batch_size=16))[0]["val_loss"]
    assert checked == pytest.approx(expected, abs=1e-6)

    # predict drops no row: one prediction per row, each with its key
    predictions = trainer.predict(model, RayDataLoader(train, batch_size=64))
    ids = torch.cat([p["id"] for p in predictions]).tolist()
    assert sorted(ids) == list(range(ROWS))
    gc.collect()
    _assert_nothing_of_the_calls_left(objects_before)
    assert leftovers()[0], "the warm workers stay for the next call, as with a DataLoader"


class Passes(pl.LightningModule):
    """Notes the passes its batches came from, in turn (a pass's shuffle seed is s + pass); with
    ``estimate``, reads ``estimated_stepping_batches`` in ``configure_optimizers``, which sets
    the train data up before Lightning restores a checkpoint's loop state."""

    def __init__(self, estimate: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.passes: list[int] = []
        self.estimate = estimate

    def training_step(self, batch, batch_idx):
        reading = self.trainer.train_dataloader.reading
        if not self.passes or self.passes[-1] != reading:
            self.passes.append(reading)
        return self.layer(batch["id"].float().unsqueeze(1)).sum()

    def configure_optimizers(self):
        if self.estimate:
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _shuffled(data) -> RayDataLoader:
    return RayDataLoader(data, batch_size=16, local_shuffle_buffer_size=32, local_shuffle_seed=5)


def test_a_train_loader_made_anew_each_epoch_shuffles_each_epoch_with_its_own_seed(
    cpu_for_ray_data,
):
    """reload_dataloaders_every_n_epochs=1: the DataModule returns a new RayDataLoader at each
    epoch, whose pass (the shuffle's seed s + n) is its epoch's, not 0 every epoch. Without a
    length, where Lightning begins a pass twice an epoch (once to prefetch a batch as it sets
    the data up, again as the epoch starts): the epoch's both times, not the next epoch's."""
    data = ray.data.from_items([{"id": i} for i in range(64)]).map_batches(unchanged)

    class Reloaded(pl.LightningDataModule):
        def train_dataloader(self):
            return _shuffled(data)

    model = Passes()
    strategy = RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.5)
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=3, reload_dataloaders_every_n_epochs=1, **_trainer_kwargs()
    )
    trainer.fit(model, datamodule=Reloaded())
    assert model.passes == [0, 1, 2]  # a public attribute: rank 0's comes back


def test_a_fit_resumed_from_a_checkpoint_reads_the_passes_of_its_epochs(cpu_for_ray_data, tmp_path):
    """ckpt_path after 2 epochs: epochs 2 and 3 read passes 2 and 3, also when the model's
    configure_optimizers set the train data up before the checkpoint's loop state came back;
    without a length (max_steps for the schedule), when the loader began pass 0 then, to
    prefetch a batch. (Without a length Lightning resumes the end of epoch 1 as the rest of
    that epoch, which reads pass 2 here: the pass of the epoch the restored loop counts.)"""
    from pytorch_lightning.callbacks import ModelCheckpoint

    data = ray.data.from_items([{"id": i} for i in range(64)]).map_batches(unchanged)
    strategy = RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.5)
    kwargs = {**_trainer_kwargs(), "enable_checkpointing": True, "default_root_dir": tmp_path}
    first = Passes(estimate=True)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    pl.Trainer(strategy=strategy, max_epochs=2, max_steps=4, callbacks=[saving], **kwargs).fit(
        first, _shuffled(data)
    )
    assert first.passes == [0, 1]
    resumed = Passes(estimate=True)
    again = RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.5)  # the same warm workers
    trainer = pl.Trainer(strategy=again, max_epochs=4, max_steps=8, **kwargs)
    trainer.fit(resumed, _shuffled(data), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.passes == [2, 3]


class TerminatedPasses(Passes):
    """Rank 1's process receives SIGTERM (a spot node's notice) at global step 5, once; steps
    of 0.25 s (the ranks exchange notices about every 0.5 s)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 5 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.25)
        return super().training_step(batch, batch_idx)


def test_a_preempted_fit_without_a_length_trains_its_epochs_as_long_as_without(
    cpu_for_ray_data, tmp_path, caplog
):
    """A preemption in epoch 1 of a loader without a length (4 batches a rank an epoch): the
    restart resumes inside the epoch and its pass leaves out what the epoch had trained, so the
    fit takes 8 steps, as without the preemption (a whole pass more before)."""
    data = ray.data.from_items([{"id": i} for i in range(64)]).map_batches(unchanged)
    model = TerminatedPasses(str(tmp_path / "terminated"))
    strategy = RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.5)
    trainer = pl.Trainer(strategy=strategy, max_epochs=2, **_trainer_kwargs())
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        trainer.fit(model, RayDataLoader(data, batch_size=8))
    assert (tmp_path / "terminated").exists(), "no SIGTERM was sent"
    assert "after a preemption" in caplog.text, caplog.text
    where = re.search(r"fit resumes in epoch 1 after (\d+) batches", caplog.text)
    assert where is not None and 1 <= int(where[1]) <= 3, caplog.text
    assert trainer.global_step == 8
    assert model.passes[-1] == 1  # the resumed epoch's pass (rank 0's, as it came back)


def test_a_rank_lost_mid_epoch_restarts_the_fit_and_the_new_attempt_splits_again(
    free_cluster, parquet, tmp_path
):
    data = LRayDataModule(train=ray.data.read_parquet(parquet), batch_size=32)
    _, objects_before = _data_state()
    model = LRecorder(str(tmp_path), die_at=(1, 1, 3))
    # elastic up to 3: three workers of half a CPU would leave Ray Data's tasks half of one, and
    # every read would wait for good (here: until progress_timeout_s); each attempt takes 2
    strategy = LRaySGDStrategy(
        num_workers=(2, 3), num_cpus_per_worker=0.5, max_failures=1, progress_timeout_s=30
    )
    trainer = L.Trainer(strategy=strategy, max_epochs=3, **_trainer_kwargs())
    trainer.fit(model, datamodule=data)
    assert strategy.world_sizes == {0: 2, 1: 2, 2: 2}

    assert Path(tmp_path, "died").exists()
    assert trainer.current_epoch == 3
    # rank 0's datamodule comes back into the driver's, which keeps its own dataset (a shard
    # in its place would send the next call a split that ended with this one)
    assert isinstance(data.train, ray.data.Dataset)
    records = _records(tmp_path)
    # Ray Data knows no row count for read_parquet without reading it: no length, no total
    assert {r["batches"] for rank in records.values() for r in rank} == {float("inf")}
    assert {r["stage"] for rank in records.values() for r in rank} == {"train"}  # no val data
    share = ROWS // 2
    last = {rank: records[rank][-1]["pid"] for rank in (0, 1)}
    assert records[1][0]["pid"] != last[1], "rank 1 was not restarted"
    for epoch in (1, 2):  # the restarted attempt read epoch 1 again, from its own split
        ranks = [_ids(records[r], "train", epoch, pid=last[r]) for r in (0, 1)]
        assert [len(ids) for ids in ranks] == [share, share], epoch
        assert not set(ranks[0]) & set(ranks[1])
    assert trainer.global_step == 3 * -(-share // 32)
    _assert_nothing_of_the_calls_left(objects_before)


def test_workers_that_leave_less_than_a_cpu_are_refused_before_any_actor_starts(ray_cluster):
    """Every CPU taken, or half of one left: a read task asks a whole CPU, and none could run
    (a materialised dataset runs none: half a CPU left is room enough for it)."""
    before = leftovers()  # idle warm workers of earlier tests
    items = ray.data.from_items([{"id": i} for i in range(8)])
    cases = [(2, 1.0, ray.data.range(8)), (3, 0.5, ray.data.range(8)), (2, 1.0, items)]
    for workers, cpus, data in cases:
        strategy = RaySGDStrategy(num_workers=workers, num_cpus_per_worker=cpus)
        trainer = pl.Trainer(strategy=strategy, max_epochs=1, **_trainer_kwargs())
        taken = f"take {workers * cpus:g} of the cluster's 2 CPUs"
        with pytest.raises(ConfigurationError, match=taken + ".*num_cpus_per_worker"):
            trainer.fit(Recorder("."), RayDataLoader(data, batch_size=4))
    assert leftovers() == before
    config = WorkerGroupConfig(num_workers=3, resources_per_worker={"CPU": 0.5})
    datasets.check_room(config, [items])  # 0.5 CPU left: enough where no task runs
    with pytest.raises(ConfigurationError, match=r"take 1\.5 of"):
        datasets.check_room(config, [items, ray.data.range(8)])


@pytest.mark.skipif(
    _compat.torch.cpu_fsdp2_problem(torch.__version__) is not None, reason="FSDP2 needs CUDA"
)
def test_ray_data_a_sharded_strategy_cannot_take_is_refused_before_any_actor_starts(ray_cluster):
    """A sharded predict (ranks read different numbers of rows; each forward gathers from every
    rank: it would wait for good) and tensor parallelism (a group's ranks need the same batch)."""
    from ray_lightning_sgd.pytorch_lightning import RayModelParallelStrategy

    before = leftovers()
    data = RayDataLoader(ray.data.range(8), batch_size=4)
    fsdp2 = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    sharded = RayModelParallelStrategy(num_workers=2, num_cpus_per_worker=0.5, **fsdp2)
    trainer = pl.Trainer(strategy=sharded, max_epochs=1, **_trainer_kwargs())
    with pytest.raises(ConfigurationError, match=r"predict over a Ray Data dataset.*DataLoader"):
        trainer.predict(Recorder("."), data)
    tensor = {"data_parallel_size": 1, "tensor_parallel_size": 2}
    parallel = RayModelParallelStrategy(num_workers=2, num_cpus_per_worker=0.5, **tensor)
    trainer = pl.Trainer(strategy=parallel, max_epochs=1, **_trainer_kwargs())
    with pytest.raises(ConfigurationError, match=r"tensor_parallel_size=2 over a Ray Data"):
        trainer.fit(Recorder("."), data)
    assert leftovers() == before


def test_tensor_parallelism_auto_is_resolved_where_the_workers_landed():
    from ray_lightning_sgd._driver.datasets import check_strategy
    from ray_lightning_sgd.pytorch_lightning import RayModelParallelStrategy
    from ray_lightning_sgd.ranks import WorkerMetadata

    def on(*nodes: str) -> list[WorkerMetadata]:
        return [WorkerMetadata(node, "10.0.0.1", "h", pid) for pid, node in enumerate(nodes)]

    def tensor(workers: int, *nodes: str) -> int | None:  # as "auto" resolves, where placed
        return RayModelParallelStrategy(workers, use_gpu=True).tensor_parallel_size(on(*nodes))

    check_strategy("S", False, False, None)  # not known before the workers are placed
    check_strategy("S", False, False, tensor(2, "a", "b"), auto=True)  # a worker a node: 1
    with pytest.raises(ConfigurationError, match=r"tensor_parallel_size=2 \('auto'"):
        check_strategy("S", False, False, tensor(4, "a", "a", "b", "b"), auto=True)
    check_strategy("S", True, False, 1)  # FSDP2 alone fits
    with pytest.raises(ConfigurationError, match="predict"):
        check_strategy("S", True, True, 1)
    check_strategy("S", False, True, 1)  # DDP's predict has no collective in its forward


def test_a_dataset_made_on_a_worker_is_refused_not_read_whole_by_every_rank(
    ray_cluster, monkeypatch
):
    """Made in setup() or a *_dataloader hook, on the workers: no split reached it, and every
    rank would have read every row (each row trained world-size times an epoch)."""
    from ray_lightning_sgd._boundary import data_loader

    # from_items: blocks already in the object store, no read task (warm workers of earlier
    # tests may hold the cluster's CPUs)
    loader = RayDataLoader(ray.data.from_items([{"id": i} for i in range(8)]), batch_size=4)
    monkeypatch.setattr(data_loader, "_process_group_size", lambda: 2)
    with pytest.raises(ConfigurationError, match=r"not split over the 2 ranks.*on the driver"):
        next(iter(loader))
    monkeypatch.setattr(data_loader, "_process_group_size", lambda: 1)  # one process: all of it
    assert sum(len(batch["id"]) for batch in loader) == 8


def test_a_bare_dataset_is_refused_with_the_loader_to_wrap_it_in(ray_cluster):
    trainer = pl.Trainer(strategy=RaySGDStrategy(num_workers=2), max_epochs=1, **_trainer_kwargs())
    with pytest.raises(ConfigurationError, match=r"RayDataLoader\(dataset, batch_size"):
        trainer.fit(Recorder("."), ray.data.range(8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"drop_last": "yes"}, "drop_last must be True or False, got 'yes'"),
        ({"dtypes": "float"}, "dtypes must be a torch.dtype"),
        ({"num_rows": -1}, "num_rows must be an int >= 0, got -1"),
        ({"collate_fn": 3}, "collate_fn must be a function or None, got 3"),
        (
            {"collate_fn": dict, "dtypes": torch.float16},
            "takes collate_fn or dtypes, not both (Ray Data refuses them together), got "
            "dtypes=torch.float16",
        ),
    ],
)
def test_bad_loader_arguments_are_configuration_errors(kwargs, message):
    shard = DatasetShard(iterator=None, rank=0, world_size=2, rows=None)
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        RayDataLoader(shard, **kwargs)
    with pytest.raises(ConfigurationError, match=r"takes a ray\.data\.Dataset, got list"):
        RayDataLoader([1, 2])


def test_bad_datamodule_arguments_are_configuration_errors():
    with pytest.raises(ConfigurationError, match=r"unknown options bogus;.*local_shuffle_seed"):
        RayDataModule(bogus=1)
    with pytest.raises(ConfigurationError, match="batch_size must be an int >= 1, got 'x'"):
        RayDataModule(batch_size="x")
    with pytest.raises(ConfigurationError, match="eval_batch_size must be an int >= 1, got 0"):
        RayDataModule(eval_batch_size=0)


def test_a_datamodules_train_only_options_leave_the_other_stages_every_row():
    """drop_last, num_rows and the local shuffle are the train loader's: a predict that dropped
    a partial batch would lose rows, a validation would take the train set's row count."""
    shard = DatasetShard(iterator=None, rank=0, world_size=2, rows=None)
    module = RayDataModule(
        train=shard, val=shard, predict=shard, batch_size=8, drop_last=True, num_rows=100,
        local_shuffle_buffer_size=16, local_shuffle_seed=3,
    )  # fmt: skip
    train, val, predict = (
        module.train_dataloader(), module.val_dataloader(), module.predict_dataloader()
    )  # fmt: skip
    assert (train.drop_last, train.num_rows, train.local_shuffle_buffer_size) == (True, 100, 16)
    for other in (val, predict):
        assert (other.drop_last, other.num_rows, other.local_shuffle_buffer_size) == (
            False, None, None,
        )  # fmt: skip
        assert other.local_shuffle_seed == 3  # the rest applies to every stage


class _Batches:
    """A split's iterator whose every pass yields ``count`` batches."""

    def __init__(self, count: int) -> None:
        self.count = count

    def iter_torch_batches(self, **options):
        return iter([{"id": torch.zeros(1)}] * self.count)


def test_a_pass_shorter_than_num_rows_says_so_rather_than_end_no_epoch():
    """num_rows=100 on 2 ranks, batches of 10: 5 a pass. A pass that ends after 3 would leave
    Lightning waiting for its last batch (no epoch end: no validation, no checkpoint)."""
    shard = DatasetShard(iterator=_Batches(3), rank=0, world_size=2, rows=None)
    loader = RayDataLoader(shard, batch_size=10, num_rows=100)
    assert len(loader) == 5
    with pytest.raises(ConfigurationError, match=r"num_rows=100\) gives .* 5 batches .* after 3"):
        list(loader)
    full = DatasetShard(iterator=_Batches(5), rank=0, world_size=2, rows=None)
    assert len(list(RayDataLoader(full, batch_size=10, num_rows=100))) == 5
    cut = RayDataLoader(shard, batch_size=10, num_rows=100)
    assert len(list(itertools.islice(cut, 2))) == 2  # a pass cut short (a limit): fine
    unequal = DatasetShard(iterator=_Batches(3), rank=0, world_size=2, rows=None, equal=False)
    assert len(list(RayDataLoader(unequal, batch_size=10, num_rows=100))) == 3  # no length


def test_a_fit_resumed_inside_an_epoch_leaves_out_the_batches_that_epoch_had_trained():
    """A preemption's resume point after 2 batches of epoch 3: the epoch's pass leaves out its
    first 2 batches, so that the epoch trains 5 in all, with or without a length (without one it
    read a whole pass more); a pass begun early and given up hands the skip on."""
    from ray_lightning_sgd._worker.resume import ResumeCheckpointBase

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    callback = ResumeCheckpointBase(0, None)
    callback.load_state_dict({"batches": 2, "replicas": 2})
    shard = DatasetShard(iterator=_Batches(5), rank=0, world_size=2, rows=None)
    loader = RayDataLoader(shard, batch_size=10)  # no length
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of "cannot deal that epoch's order again"
        callback.resume_inside_epoch(loader, trainer)
    early = iter(loader)
    next(early)  # Lightning set the data up before the loop state came back: given up
    loader.begin_again()
    assert len(list(loader)) == 3  # the resumed epoch: 2 trained before, 3 now
    assert len(list(loader)) == 5  # the next epoch reads its whole pass


def test_a_loader_knows_its_length_only_from_a_known_row_count():
    split = DatasetSplit(iterators=("it0", "it1"), rows=101, equal=True)
    assert len(RayDataLoader(split.shard(1), batch_size=10)) == 5  # 50 rows a rank
    assert len(RayDataLoader(split.shard(1), batch_size=10, drop_last=True)) == 5
    assert split.shard(1).iterator == "it1"
    unknown = DatasetSplit(iterators=("it0", "it1"), rows=None, equal=True).shard(0)
    with pytest.raises(TypeError, match="num_rows"):
        len(RayDataLoader(unknown, batch_size=10))
    assert len(RayDataLoader(unknown, batch_size=10, num_rows=101)) == 5
    # predict's split is not equal: the ranks' rows are unknown
    unequal = DatasetSplit(iterators=("it0", "it1"), rows=101, equal=False).shard(0)
    with pytest.raises(TypeError):
        len(RayDataLoader(unequal, batch_size=10, num_rows=101))


def test_without_ray_data_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.data", None)  # as if pyarrow were missing
    with pytest.raises(ImportError, match=re.escape('pip install "ray_lightning_sgd[data]"')):
        ray_data()


def test_datasets_are_set_aside_from_the_payload_and_replaced_on_the_other_side():
    class Big:  # stands for a Dataset: it must not be pickled
        def __reduce__(self):
            raise AssertionError("pickled")

    big, other = Big(), Big()
    packed = pack({"a": big, "b": [big, other]}, set_aside=(Big,))
    assert packed.set_aside == (big, other)
    assert unpack(packed, replacements=["A", "B"]) == {"a": "A", "b": ["A", "B"]}


class _SeedsSeen:
    """A split's iterator that notes the shuffle seed of each pass and yields nothing."""

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def iter_torch_batches(self, **options):
        self.seeds.append(options["local_shuffle_seed"])
        return iter(())


def test_a_resumed_fit_shuffles_each_epoch_as_the_uninterrupted_fit():
    """A restart (or a resize) from the end of epoch 2 reads epoch 3 with the seed s + 3, as
    the fit that never stopped did; a new loader's pass count alone would start over at s + 0.
    The worker's strategy sets it as Lightning sets the train loader up, from the epoch it
    gives samplers (``current_epoch`` is still 2 there in a fit resumed from an epoch's end)."""
    seen = _SeedsSeen()
    shard = DatasetShard(iterator=seen, rank=0, world_size=2, rows=None)
    loader = RayDataLoader(shard, batch_size=8, local_shuffle_buffer_size=16, local_shuffle_seed=10)
    trainer = pl.Trainer(max_epochs=5, **_trainer_kwargs())
    trainer.fit_loop.epoch_progress.current.processed = 3  # restored: epoch 2 ended
    trainer.training = True
    strategy = RaySGDStrategy(num_workers=2)
    strategy._lightning_module = SimpleNamespace(trainer=trainer)
    assert strategy.process_dataloader(loader) is loader
    for _ in range(2):  # epochs 3 and 4
        list(loader)
        list(loader)  # a pass begun again in the same epoch (a prefetch, then the epoch's)
        trainer.fit_loop.epoch_progress.current.processed += 1
    assert seen.seeds == [13, 13, 14, 14]
    trainer.validating = True  # a validation loader counts its own passes
    other = RayDataLoader(shard, batch_size=8, local_shuffle_buffer_size=16, local_shuffle_seed=10)
    list(strategy.process_dataloader(other))
    assert seen.seeds[-1] == 10


def test_a_seeded_local_shuffle_deals_the_same_order_for_the_same_seed_and_pass(ray_cluster):
    # from_items: blocks already in the object store, no read task (warm workers of earlier
    # tests may hold the cluster's CPUs); the loader iterates the whole dataset on the driver
    data = ray.data.from_items([{"id": i} for i in range(64)])

    def two_passes() -> list[list[int]]:
        loader = RayDataLoader(
            data, batch_size=8, local_shuffle_buffer_size=64, local_shuffle_seed=3
        )
        return [torch.cat([batch["id"] for batch in loader]).tolist() for _ in range(2)]

    first = two_passes()
    assert two_passes() == first  # the same seed: the same order, pass by pass
    assert sorted(first[0]) == list(range(64)) and first[0] != list(range(64))
    assert first[1] != first[0]  # the next pass: the next seed
