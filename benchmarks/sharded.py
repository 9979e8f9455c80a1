"""Benchmark: memory and step time of sharded training. A model of about 200 million parameters
with Adam, on 2 workers: RaySGDStrategy (DDP: every worker holds all parameters, gradients and
optimizer state), RayModelParallelStrategy with FSDP2 (each worker holds half), and Lightning's own
ModelParallelStrategy on 2 CPU processes (the same FSDP2, for the step-time ratio).

    python benchmarks/sharded.py [--repeats 3] [--layers 12] [--width 4096]
    python benchmarks/sharded.py --empty-init    # the model built on the meta device
    python benchmarks/sharded.py --modes ray_fsdp2 --empty-init --no-weights-back --width 8192

With ``--empty-init`` the model is built under ``trainer.init_module(empty_init=True)`` (as
Lightning's own tensor-parallel example builds its model): its parameters are on the meta device
until each rank materialises its shards. ``--no-weights-back``: ``return_weights=False``, the
trained weights stay in the cluster. The driver's peak memory is reported for the Ray modes.

Every run is a fresh process; runs are interleaved; medians. Figures per run, from a callback on
every rank: the peak resident memory of the largest rank, the parameter and optimizer-state bytes
each rank holds after its first step (local shards only), and the median step after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

MODES = ("ray_sgd", "ray_fsdp2", "lightning_fsdp2")
WORKERS = 2
BATCH = 8
STEPS_PER_RANK = int(os.environ.get("BENCH_STEPS", "6"))
SETTLE_S = 3.0


class Big(pl.LightningModule):
    """``layers`` square linear layers of ``width``; with ``shard``, FSDP2 shards each one."""

    def __init__(self, width: int, layers: int, shard: bool) -> None:
        super().__init__()
        self.shard = shard
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def _local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class Meter(pl.Callback):
    """Rank r writes ``out.rank<r>``: peak memory, local parameter and optimizer bytes, step."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.ends: list[float] = []
        # at each batch end: the training thread's CPU s, the process's CPU s, and the thread's
        # minor page faults and the times the kernel took the CPU from it (involuntary switches)
        self.usage: list[tuple[float, float, int, int]] = []
        self.held: dict[str, int] = {}

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.time())
        usage = resource.getrusage(resource.RUSAGE_THREAD)  # this thread's
        self.usage.append(
            (time.thread_time(), time.process_time(), usage.ru_minflt, usage.ru_nivcsw)
        )
        if not self.held:
            states = [s for o in trainer.optimizers for s in o.state.values()]
            self.held = {
                "params_mb": _local_bytes(pl_module.parameters()) // 2**20,
                "optimizer_mb": _local_bytes(
                    v for s in states for v in s.values() if torch.is_tensor(v) and v.dim()
                )
                // 2**20,
            }

    def on_fit_end(self, trainer, pl_module):
        steps = [b - a for a, b in zip(self.ends[:-1], self.ends[1:], strict=True)]
        per_step = [
            [b - a for a, b in zip(first, then, strict=True)]
            for first, then in zip(self.usage[:-1], self.usage[1:], strict=True)
        ]
        record = {
            "step": statistics.median(steps),
            # where a step's time goes: the training thread's CPU, the whole process's CPU (with
            # gloo's threads), the thread's minor page faults and involuntary switches, per step
            **{
                key: statistics.median(step[i] for step in per_step)
                for i, key in enumerate(("thread_cpu", "process_cpu", "minflt", "nivcsw"))
            },
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **self.held,
        }
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(record))


def run_mode(
    mode: str, out: str, width: int, layers: int, empty_init: bool, weights_back: bool
) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    data = DataLoader(TensorDataset(torch.randn(BATCH * STEPS_PER_RANK * WORKERS, width)), BATCH)
    kwargs: dict = {}
    if mode == "lightning_fsdp2":
        strategy: object = pl.strategies.ModelParallelStrategy(
            data_parallel_size=WORKERS, tensor_parallel_size=1
        )
        kwargs = {"accelerator": "cpu", "devices": WORKERS}
    else:
        import ray

        from ray_lightning_sgd import RayModelParallelStrategy, RaySGDStrategy, _compat

        _compat.bind_local_ray_to_loopback()
        ray.init(address="local", num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
        strategy = (
            RaySGDStrategy(num_workers=WORKERS, return_weights=weights_back)
            if mode == "ray_sgd"
            else RayModelParallelStrategy(
                num_workers=WORKERS, data_parallel_size=WORKERS, tensor_parallel_size=1,
                return_weights=weights_back,
            )
        )  # fmt: skip
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=1,
        callbacks=[Meter(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        **kwargs,
    )
    with trainer.init_module(empty_init=empty_init):
        model = Big(width, layers, shard=mode != "ray_sgd")
    trainer.fit(model, data)
    if mode != "lightning_fsdp2":  # Lightning's driver is its rank 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(f"{out}.driver").write_text(json.dumps({"maxrss_mb": peak}))


def _one_run(mode: str, width: int, layers: int, flags: list[str]) -> dict[str, float]:
    time.sleep(SETTLE_S)
    out = tempfile.mktemp(prefix=f"bench-sharded-{mode}-")
    subprocess.run(
        [sys.executable, __file__, "--run", mode, "--out", out,
         "--width", str(width), "--layers", str(layers), *flags],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORKERS)]
    driver = Path(f"{out}.driver")
    return {
        "driver_peak_mb": json.loads(driver.read_text())["maxrss_mb"] if driver.exists() else 0,
        "worker_peak_mb": max(r["maxrss_mb"] for r in ranks),
        "params_mb": max(r["params_mb"] for r in ranks),
        "optimizer_mb": max(r["optimizer_mb"] for r in ranks),
        "step": ranks[0]["step"],
        **{key: ranks[0][key] for key in ("thread_cpu", "process_cpu", "minflt", "nivcsw")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--empty-init", action="store_true", help="build it on the meta device")
    parser.add_argument("--no-weights-back", action="store_true", help="return_weights=False")
    args = parser.parse_args()
    if args.run:
        return run_mode(
            args.run, args.out, args.width, args.layers, args.empty_init, not args.no_weights_back
        )
    flags = [f for f, on in (("--empty-init", args.empty_init),
                             ("--no-weights-back", args.no_weights_back)) if on]  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    for repeat in range(args.repeats):
        for mode in args.modes:
            runs[mode].append(_one_run(mode, args.width, args.layers, flags))
            print(f"repeat {repeat + 1}/{args.repeats} {mode}: {runs[mode][-1]}", file=sys.stderr)
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"\n{params / 1e6:.0f}M parameters (fp32, {params * 4 / 2**20:.0f} MB), Adam, {WORKERS} "
        f"workers on CPU, batch {BATCH}, {STEPS_PER_RANK} steps per rank"
        f"{', built on the meta device' if args.empty_init else ''}"
        f"{', return_weights=False' if args.no_weights_back else ''}; medians of {args.repeats} "
        "fresh-process runs\n"
    )
    print(
        "| mode | params MB per worker | Adam state MB per worker | worker peak MB | "
        "driver peak MB | step s | rank 0's step: thread CPU s, process CPU s, minor faults, "
        "involuntary switches |"
    )
    print("|---|---|---|---|---|---|---|")
    reference = runs.get("lightning_fsdp2")
    for mode, rows in runs.items():
        median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        driver = f"{median['driver_peak_mb']:.0f}" if median["driver_peak_mb"] else "-"
        ratio = ""
        if reference:
            ratio = f" ({median['step'] / statistics.median(r['step'] for r in reference):.2f}x)"
        print(
            f"| {mode} | {median['params_mb']:.0f} | {median['optimizer_mb']:.0f} | "
            f"{median['worker_peak_mb']:.0f} | "
            f"{driver} | "
            f"{median['step']:.2f}{ratio} | {median['thread_cpu']:.2f}, "
            f"{median['process_cpu']:.2f}, {median['minflt']:.0f}, {median['nivcsw']:.0f} |"
        )


if __name__ == "__main__":
    main()
