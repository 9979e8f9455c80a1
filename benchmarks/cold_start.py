"""Benchmark: where a cold start goes, part by part, against what Lightning's ``ddp`` pays for a
new process.

The parts of a cold ``RaySGDStrategy`` start, each timed in a fresh driver process with the
public pieces the strategy is made of (``WorkerGroup``, ``TorchBackend``), in the order the
strategy runs them:

- Ray start: ``ray.init`` of an embedded Ray (outside ``fit``'s time in ``benchmarks/bench.py``);
- actor start: the placement group and the worker actors, up to each worker having imported
  torch and this package;
- CUDA init (GPU workers only): each worker's CUDA context (``torch.cuda.init`` and a first
  tensor on its device), the longest worker's;
- process group: ``TorchBackend.on_start`` (gloo, or NCCL with GPUs), every worker joined;
- Lightning import: the Trainer's namespace imported on every worker, the longest worker's
  (the strategy does it as it unpacks the first call's Trainer);
- the rest of a cold ``fit``'s start (shipping the Trainer, Lightning's set-up on the workers) is
  ``bench.py``'s ``ray_sgd_cold`` start (the call to rank 0's first batch) less the parts above.

``ddp``'s counterparts, in a new Python process as Lightning's ``ddp`` starts one per extra
device: importing torch, importing Lightning, and the CUDA context.

    python benchmarks/cold_start.py [--workers 2] [--repeats 3] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _cuda_init() -> float:
    """Runs on a worker: its CUDA context, timed."""
    import torch

    from ray_lightning_sgd import get_worker_context

    started = time.perf_counter()
    torch.cuda.init()
    device = torch.device("cuda", get_worker_context().device_index or 0)
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _import_lightning() -> float:
    """Runs on a worker: the Lightning namespace's import, timed, as the strategy's worker half
    imports it (with the cyclic collector paused)."""
    from ray_lightning_sgd._worker_group.imports import import_modules

    started = time.perf_counter()
    import_modules(["pytorch_lightning"])
    return time.perf_counter() - started


def parts(workers: int, gpu: bool) -> dict[str, float]:
    """One fresh driver: each part of a cold start, in the strategy's order."""
    import ray

    from ray_lightning_sgd import TorchBackend, TorchConfig, WorkerGroup, WorkerGroupConfig, _compat

    times: dict[str, float] = {}
    started = time.perf_counter()
    _compat.bind_local_ray_to_loopback()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    times["ray_start"] = time.perf_counter() - started
    resources = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
    group = WorkerGroup(WorkerGroupConfig(num_workers=workers, resources_per_worker=resources))
    started = time.perf_counter()
    group.start()
    times["actor_start"] = time.perf_counter() - started
    times["cuda_init"] = max(group.execute(_cuda_init)) if gpu else 0.0
    started = time.perf_counter()
    TorchBackend().on_start(group, TorchConfig())
    times["process_group"] = time.perf_counter() - started
    times["lightning_import"] = max(group.execute(_import_lightning))
    TorchBackend().on_shutdown(group, TorchConfig())
    group.shutdown()
    return times


def new_process(gpu: bool) -> dict[str, float]:
    """What a new process of Lightning's ``ddp`` pays before its first collective."""
    code = (
        "import time, json; t = time.perf_counter(); import torch; a = time.perf_counter(); "
        "import pytorch_lightning; b = time.perf_counter(); "
        + (
            "torch.cuda.init(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
            if gpu
            else ""
        )
        + "c = time.perf_counter(); "
        "print(json.dumps({'torch_import': a - t, 'lightning_import': b - a, 'cuda_init': c - b}))"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="GPU workers (one GPU each)")
    parser.add_argument("--parts", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parts:
        print(json.dumps(parts(args.workers, args.gpu)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    command = [sys.executable, __file__, "--parts", "--workers", str(args.workers)]
    for repeat in range(args.repeats):
        time.sleep(3)  # the previous run's Ray processes exit
        done = subprocess.run(
            command + (["--gpu"] if args.gpu else []),
            check=True, capture_output=True, text=True, env=env,
        )  # fmt: skip
        ours.append(json.loads(done.stdout.strip().splitlines()[-1]))
        theirs.append(new_process(args.gpu))
        print(f"repeat {repeat + 1}: {ours[-1]} | new process: {theirs[-1]}", file=sys.stderr)

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"\nCold start by part, {args.workers} {'GPU' if args.gpu else 'CPU'} workers; medians "
        f"of {args.repeats} fresh processes (seconds)\n"
    )
    print("| part | RaySGDStrategy's workers | a new ddp process |")
    print("|---|---|---|")
    print(f"| Ray start (`ray.init`) | {median(ours, 'ray_start'):.2f} | - |")
    print(
        f"| actor start (with torch's import) | {median(ours, 'actor_start'):.2f} | "
        f"{median(theirs, 'torch_import'):.2f} (torch's import) |"
    )
    print(f"| CUDA init | {median(ours, 'cuda_init'):.2f} | {median(theirs, 'cuda_init'):.2f} |")
    print(f"| process group | {median(ours, 'process_group'):.2f} | - |")
    print(
        f"| Lightning import | {median(ours, 'lightning_import'):.2f} | "
        f"{median(theirs, 'lightning_import'):.2f} |"
    )


if __name__ == "__main__":
    main()
