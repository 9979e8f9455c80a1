"""The torch backend on a real worker group: real gloo process groups, set up and torn down."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from ray_lightning_sgd import BackendExecutor, TorchConfig, WorkerGroupConfig, get_worker_context
from ray_lightning_sgd.backend import BackendConfig


def _all_reduce_rank() -> tuple[int, int, str, float]:
    rank = get_worker_context().rank.global_rank
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return dist.get_rank(), dist.get_world_size(), dist.get_backend(), tensor.item()


def _is_initialized() -> bool:
    return dist.is_initialized()


@pytest.mark.parametrize("init_method", ["env", "tcp"])
def test_every_worker_joins_one_process_group(free_cluster, init_method):
    executor = BackendExecutor(
        TorchConfig(init_method=init_method), WorkerGroupConfig(num_workers=2)
    )
    with executor:
        results = executor.run(_all_reduce_rank)
        group = executor.worker_group
        assert [r[:3] for r in results] == [(0, 2, "gloo"), (1, 2, "gloo")]
        assert [r[3] for r in results] == [3.0, 3.0]
        executor.backend.on_shutdown(group, executor.backend_config)
        assert group.execute(_is_initialized) == [False, False]
    assert not dist.is_initialized(), "the driver never joins the process group"


def test_backend_defaults_to_gloo_on_cpu_and_nccl_on_gpu():
    assert TorchConfig().resolve_backend(use_gpu=False) == "gloo"
    assert TorchConfig().resolve_backend(use_gpu=True) == "nccl"
    assert TorchConfig(backend="gloo").resolve_backend(use_gpu=True) == "gloo"


def test_configs_name_their_backend():
    assert TorchConfig().backend_cls.__name__ == "TorchBackend"
    assert BackendConfig().backend_cls.__name__ == "Backend"


class _GroupWhoseWorkerCannotJoin:
    """A fake worker group of two whose rank 1 never reaches the rendezvous port: its join
    returns only when the driver stops waiting (the timeout the driver gives is recorded)."""

    def __init__(self) -> None:
        from ray_lightning_sgd._worker_group.ranks import WorkerMetadata, WorkerRank

        self.config = WorkerGroupConfig(num_workers=2, startup_timeout_s=7)
        self.metadata = [WorkerMetadata("n", "10.0.0.1", "h", 1, "a", ())] * 2
        self.workers = [
            type("W", (), {"rank": WorkerRank(r, r, 0, 2, 2, 1), "device_index": None})()
            for r in range(2)
        ]
        self.waited: list[float | None] = []

    def __len__(self) -> int:
        return 2

    def execute(self, fn):
        return [None, None]

    def execute_single(self, index, fn):
        return ("10.0.0.1", 29511)

    def execute_single_async(self, index, fn, **kwargs):
        return index

    def get(self, refs, timeout_s=None, **kwargs):
        from ray_lightning_sgd.exceptions import WorkerTimeoutError

        self.waited.append(timeout_s)
        if timeout_s is None:
            raise AssertionError("the driver waits for the join without a bound")
        raise WorkerTimeoutError(f"did not finish within {timeout_s:.1f}s")


def test_a_join_that_cannot_reach_the_port_ends_after_startup_timeout():
    from ray_lightning_sgd._backend.torch import JOIN_FLOOR_S, TorchBackend
    from ray_lightning_sgd.exceptions import WorkerTimeoutError

    group = _GroupWhoseWorkerCannotJoin()
    with pytest.raises(WorkerTimeoutError) as info:
        TorchBackend().on_start(group, TorchConfig())  # timeout_s: 1800
    assert group.waited == [JOIN_FLOOR_S]  # startup_timeout_s (7) below the floor
    message = str(info.value)
    assert "10.0.0.1:29511" in message and "startup_timeout_s" in message
    group.config = dataclasses.replace(group.config, startup_timeout_s=400)
    with pytest.raises(WorkerTimeoutError):
        TorchBackend().on_start(group, TorchConfig(timeout_s=350))
    assert group.waited[-1] == 350  # the process group's own timeout, when lower
