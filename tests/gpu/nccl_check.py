"""NCCL sanity check: one worker per GPU of this machine joins an NCCL process group through this
package's worker group and torch backend, checks an all-reduce's result and times it.

    python tests/gpu/nccl_check.py [--mb 256] [--repeats 20]

Bus bandwidth is counted as nccl-tests counts it (algorithm bandwidth x 2(n-1)/n); with one GPU
there is no link to measure, and the check shows that NCCL starts and reduces on the device.
"""

from __future__ import annotations

import argparse
import json
import time

import ray
import torch

from ray_lightning_sgd import _compat
from ray_lightning_sgd.executor import BackendExecutor
from ray_lightning_sgd.torch_backend import TorchConfig
from ray_lightning_sgd.worker_group import WorkerGroupConfig


def all_reduce(megabytes: int, repeats: int) -> dict[str, float | int | str]:
    """Runs on each worker. All-reduces a tensor of ``megabytes`` ``repeats`` times."""
    import torch.distributed as dist

    world = dist.get_world_size()
    x = torch.full((megabytes * 2**20 // 4,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    expected = world * (world + 1) / 2
    assert x[0].item() == expected and x[-1].item() == expected, (x[0].item(), expected)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    algbw = x.numel() * 4 / seconds / 1e9
    return {
        "rank": dist.get_rank(),
        "world": world,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(),
        "ms": round(seconds * 1e3, 3),
        "algbw_GBps": round(algbw, 1),
        "busbw_GBps": round(algbw * 2 * (world - 1) / world, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    assert gpus > 0, "no CUDA GPU"
    _compat.bind_local_ray_to_loopback()
    ray.init(address="local", num_cpus=gpus, num_gpus=gpus, include_dashboard=False)
    executor = BackendExecutor(
        TorchConfig(backend="nccl"),
        WorkerGroupConfig(num_workers=gpus, resources_per_worker={"CPU": 1, "GPU": 1}),
    )
    started = time.perf_counter()
    executor.start()
    print(f"{gpus} worker(s) joined an NCCL group in {time.perf_counter() - started:.1f} s")
    try:
        for result in executor.run(all_reduce, args.mb, args.repeats):
            print(json.dumps(result))
    finally:
        executor.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
