"""Several Ray nodes on one machine (ray.cluster_utils.Cluster): ranks and training across nodes."""

from __future__ import annotations

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
