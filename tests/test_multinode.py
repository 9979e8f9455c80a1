"""Several Ray nodes on one machine (ray.cluster_utils.Cluster): ranks and training across nodes."""

from __future__ import annotations

import os
import sys

import pytest
import pytorch_lightning as pl
import ray
import torch
from ray.cluster_utils import Cluster

from ray_lightning_sgd import RaySGDStrategy, WorkerGroup, WorkerGroupConfig, get_worker_context
from tests.conftest import assert_only_idle_workers_left, leftovers
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs


@pytest.fixture(scope="module")
def two_nodes():
    ray.shutdown()  # this module needs a cluster of its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _where() -> tuple[str, int, int, int, int]:
    context = get_worker_context()
    rank = context.rank
    return (
        context.metadata.node_id,
        rank.global_rank,
        rank.node_rank,
        rank.local_rank,
        rank.num_nodes,
    )


def test_ranks_follow_nodes(two_nodes):
    group = WorkerGroup(WorkerGroupConfig(num_workers=2, placement_strategy="STRICT_SPREAD"))
    group.start()
    try:
        results = group.execute(_where)
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
