"""The launcher's pure parts: prediction merging, the unpicklable-object search, global state."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

from ray_lightning_sgd._boundary.payload import GlobalState
from ray_lightning_sgd._boundary.results import RankPredictions
from ray_lightning_sgd._driver.packing import _find_unpicklable
from ray_lightning_sgd._driver.results import merge_predictions


def _distributed_batches(n: int, world: int, batch: int, output):
    """Splits range(n) as DistributedSampler(shuffle=False) does, padding by repetition."""
    total = -(-n // world) * world
    indices = list(range(n)) + list(range(total - n))
    ranks = []
    for rank in range(world):
        mine = indices[rank:total:world]
        batches = [mine[i : i + batch] for i in range(0, len(mine), batch)]
        ranks.append(RankPredictions([[output(b) for b in batches]], [batches]))
    return ranks


@pytest.mark.parametrize(("n", "world", "batch"), [(10, 2, 3), (37, 4, 8), (8, 2, 4), (5, 4, 2)])
def test_tensor_predictions_merge_into_dataset_order(n, world, batch):
    ranks = _distributed_batches(n, world, batch, lambda b: torch.tensor(b).float().unsqueeze(1))
    [merged] = merge_predictions(ranks)
    expected = [list(range(n))[i : i + batch] for i in range(0, n, batch)]
    assert [m.squeeze(1).long().tolist() for m in merged] == expected


def test_dict_and_tuple_outputs_are_split_per_sample():
    ranks = _distributed_batches(
        7, 2, 2, lambda b: {"idx": torch.tensor(b), "pair": (torch.tensor(b), [str(i) for i in b])}
    )
    [merged] = merge_predictions(ranks)
    assert [m["idx"].tolist() for m in merged] == [[0, 1], [2, 3], [4, 5], [6]]
    assert isinstance(merged[0]["pair"], tuple)
    assert [m["pair"][1] for m in merged] == [["0", "1"], ["2", "3"], ["4", "5"], ["6"]]


def test_unsplittable_outputs_fall_back_to_rank_order_with_a_warning():
    ranks = _distributed_batches(4, 2, 2, lambda b: torch.tensor(float(sum(b))))
    with pytest.warns(UserWarning, match="could not split predictions"):
        [merged] = merge_predictions(ranks)
    assert [m.item() for m in merged] == [2.0, 4.0]


def test_a_tuple_of_values_per_batch_is_no_list_per_sample_whatever_its_length():
    # (a float, a str) per batch of 2: a record, as ddp's rank 0 returns it, not 2 samples
    ranks = _distributed_batches(8, 2, 2, lambda b: (float(sum(b)), f"batch {b}"))
    with pytest.warns(UserWarning, match="could not split predictions"):
        [merged] = merge_predictions(ranks)
    assert merged == [(2.0, "batch [0, 2]"), (10.0, "batch [4, 6]"), (4.0, "batch [1, 3]"),
                      (12.0, "batch [5, 7]")]  # fmt: skip
    # a list of one value per sample is split and ordered
    ranks = _distributed_batches(4, 2, 2, lambda b: [f"row {i}" for i in b])
    assert merge_predictions(ranks) == [[["row 0", "row 1"], ["row 2", "row 3"]]]
    # a tuple of one value per sample beside a batched column (a collate_fn's zip(*batch))
    ranks = _distributed_batches(4, 2, 2, lambda b: {"x": torch.tensor(b), "path": tuple(b)})
    [merged] = merge_predictions(ranks)
    assert [m["x"].tolist() for m in merged] == [[0, 1], [2, 3]]
    assert [m["path"] for m in merged] == [(0, 1), (2, 3)]


def test_several_dataloaders_merge_separately():
    first = _distributed_batches(4, 2, 2, lambda b: torch.tensor(b))
    second = _distributed_batches(6, 2, 3, lambda b: torch.tensor(b) * 10)
    ranks = [
        RankPredictions(a.outputs + b.outputs, a.indices + b.indices)
        for a, b in zip(first, second, strict=True)
    ]
    merged = merge_predictions(ranks)
    assert [t.tolist() for t in merged[0]] == [[0, 1], [2, 3]]
    assert [t.tolist() for t in merged[1]] == [[0, 10, 20], [30, 40, 50]]


class _Holder:
    def __init__(self):
        self.name = "fine"
        self.inner = {"items": [1, 2, threading.Lock()]}
        self.me = self  # a back-reference must not be blamed


def test_the_innermost_unpicklable_object_is_named():
    found = _find_unpicklable({"model": _Holder()}, "payload")
    assert found == "payload['model'].inner['items'][2] (a _thread.lock)"


def test_picklable_objects_have_no_culprit():
    assert _find_unpicklable({"f": lambda x: x + 1, "n": [1, 2]}, "payload") is None


def test_global_state_round_trips():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = GlobalState.capture()
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    state.restore()
    got = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


def test_worker_env_keeps_the_variables_lightning_inherits_that_it_sets(monkeypatch):
    """worker_env={"CUBLAS_WORKSPACE_CONFIG": ...} (deterministic cuBLAS on GPU workers) wins
    over the driver's environment, which sets the others of Lightning's inherited variables
    and unsets those it lacks."""
    from ray_lightning_sgd._boundary import payload

    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    worker_env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OTHER": "x"}
    state = GlobalState.capture(worker_env)
    monkeypatch.setattr(payload, "_started_with", {})  # the worker started without them
    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # a warm worker's, from an earlier call
    state.restore()
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    assert os.environ.get("PL_GLOBAL_SEED") == "7"
    assert "PL_SEED_WORKERS" not in os.environ


def test_a_workers_own_value_of_an_inherited_variable_stays_unless_the_driver_sets_it(
    monkeypatch,
):
    """CUBLAS_WORKSPACE_CONFIG from the job's runtime_env, the node or a container image: the
    worker had it before its first call; the driver lacks it, and it stays."""
    from ray_lightning_sgd._boundary import payload

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    state = GlobalState.capture()
    monkeypatch.setattr(payload, "_started_with", None)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the worker's own
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    state.restore()  # the first call snapshots the worker's own values
    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # set during that call
    state.restore()
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":16:8"
    assert os.environ.get("PL_GLOBAL_SEED") == "7", "the driver's value wins"
    assert "PL_SEED_WORKERS" not in os.environ


def test_a_trackers_variables_reach_the_workers_where_the_trainer_logs_to_it(monkeypatch):
    """The driver's ``WANDB_*`` (credentials, endpoint, mode) go to the workers of a Trainer
    with a W&B logger; ``worker_env`` wins over them; variables of trackers the Trainer does
    not log to, and a warm worker's from an earlier call, do not stay."""
    from ray_lightning_sgd._boundary import payload

    monkeypatch.setenv("WANDB_API_KEY", "driver-key")
    monkeypatch.setenv("WANDB_BASE_URL", "http://driver")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://driver-mlflow")
    monkeypatch.setenv("WANDB_SERVICE", "driver-service")  # the driver's own process's
    state = GlobalState.capture({"WANDB_BASE_URL": "http://worker"}, ("WANDB_",))
    assert "WANDB_SERVICE" not in state.env
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key)  # a worker on a node without them
    monkeypatch.setenv("WANDB_MODE", "offline")  # a warm worker's, set during an earlier call
    monkeypatch.setattr(payload, "_started_with", {})
    state.restore()
    assert os.environ.get("WANDB_API_KEY") == "driver-key"
    assert os.environ.get("WANDB_BASE_URL") == "http://worker"
    assert "WANDB_MODE" not in os.environ
    assert "MLFLOW_TRACKING_URI" not in os.environ


def test_mixed_batched_and_unbatched_columns_are_not_split_per_item():
    ranks = _distributed_batches(4, 2, 2, lambda b: (torch.tensor(b), "tag"))
    with pytest.warns(UserWarning, match="could not split predictions"):
        merge_predictions(ranks)


def test_no_batches_merge_to_nothing():
    assert merge_predictions([RankPredictions([[]], [[]])]) == [[]]
