"""Benchmark: who uses the CPU while RaySGDStrategy's workers train, and what Ray's worker
niceness costs the steps.

The issue-30 workload (2 workers, a 3-layer 1024-wide MLP, batch 128, one torch thread per
process, SGD) trains 160 steps on an embedded Ray of 2 CPUs; between rank 0's steps 10 and 150 a
driver callback reads every process's CPU time (the driver, the workers, Ray's own processes)
and rank 0 times its steps. Ray starts its workers at niceness 15 (``RAY_worker_niceness``), so
every other process on the machine (the driver, Ray's daemons) runs before them; ``nice0`` starts
the workers at niceness 0 (``worker_env={"RAY_worker_niceness": "0"}``), as a ``ddp`` process
runs. Every run is a fresh process; the two modes are interleaved; medians.

    python benchmarks/background_cpu.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import pytorch_lightning as pl
import torch
from bench import MLP  # the issue-30 workload's model: benchmarks/bench.py --layers 3
from torch.utils.data import DataLoader, TensorDataset

MODES = ("default", "nice0")
FIRST, LAST, STEPS = 10, 150, 160


class StepTimer(pl.Callback):
    """On rank 0: the time of steps FIRST and LAST, written to ``out``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.times: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step in (FIRST, LAST):
            self.times[trainer.global_step] = time.perf_counter()
            if len(self.times) == 2:
                with open(self.out, "w") as file:
                    json.dump((self.times[LAST] - self.times[FIRST]) / (LAST - FIRST), file)


def _processes() -> dict[int, tuple[str, float]]:
    """Every process of this run: its kind and CPU seconds so far."""
    import psutil

    me = os.getpid()
    found = {}
    for process in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        command = " ".join(process.info["cmdline"] or [])
        if process.info["pid"] == me:
            kind = "driver"
        elif "ray::" in command or "default_worker" in command:
            kind = "Ray workers (training actors, idle workers)"
        elif "ray" in command:
            kind = "Ray's daemons (GCS, raylet, agents, log monitor)"
        else:
            continue
        times = process.info["cpu_times"]
        found[process.info["pid"]] = (kind, times.user + times.system)
    return found


class CpuMeter(pl.Callback):
    """On the driver (rank 0's events replayed): every process's CPU at steps FIRST and LAST."""

    def __init__(self) -> None:
        self.marks: dict[int, tuple[float, dict[int, tuple[str, float]]]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        for mark in (FIRST, LAST):
            if step >= mark and mark not in self.marks:
                self.marks[mark] = (time.monotonic(), _processes())


def run(mode: str) -> dict[str, float]:
    import ray

    from ray_lightning_sgd import RaySGDStrategy, _compat

    torch.set_num_threads(1)
    _compat.bind_local_ray_to_loopback()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = tempfile.mktemp(prefix="bench-background-")
    meter = CpuMeter()
    env = {"RAY_worker_niceness": "0"} if mode == "nice0" else None
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2, driver_callbacks=[meter], worker_env=env),
        max_steps=STEPS, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[StepTimer(out)],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    rows = 128 * 2 * STEPS
    data = TensorDataset(
        torch.randn(rows, 1024, generator=generator),
        torch.randint(0, 10, (rows,), generator=generator),
    )
    trainer.fit(MLP(features=1024, hidden=1024, layers=3), DataLoader(data, batch_size=128))
    (start, before), (end, after) = meter.marks[FIRST], meter.marks[LAST]
    seconds = end - start
    figures: dict[str, float] = {"step_ms": json.load(open(out)) * 1000}
    for pid, (kind, cpu) in after.items():
        used = cpu - before.get(pid, (kind, 0.0))[1]
        figures[kind] = figures.get(kind, 0.0) + used / seconds
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run(args.run)))
        return
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            time.sleep(3)  # the previous run's Ray processes exit
            done = subprocess.run(
                [sys.executable, __file__, "--run", mode], check=True, capture_output=True,
                text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
            )  # fmt: skip
            results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat + 1} {mode}: {results[mode][-1]}", file=sys.stderr)
    kinds = sorted({k for runs in results.values() for r in runs for k in r} - {"step_ms"})
    print(
        f"\n2 CPU workers on an embedded Ray of 2 CPUs, steps {FIRST} to {LAST} of rank 0; "
        f"CPU seconds per second by process kind; medians of {args.repeats}\n"
    )
    print("| workers' niceness | step ms | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 2) + "|")
    for mode, runs in results.items():
        cells = [f"{statistics.median(r['step_ms'] for r in runs):.1f}"] + [
            f"{statistics.median(r.get(k, 0.0) for r in runs):.3f}" for k in kinds
        ]
        print(f"| {'15 (Ray)' if mode == 'default' else '0'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
