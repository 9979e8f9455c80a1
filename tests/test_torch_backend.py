"""The torch backend on a real worker group: real gloo process groups, set up and torn down."""

from __future__ import annotations

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
