"""Benchmark: what the driver does while 2, 4, 8 and 16 workers train, and their cold start.

Every size runs in a fresh process on an embedded Ray of 2 CPUs (the workers take fractions of
them), trains a small MLP for a fixed time (Lightning's ``max_time``) and reports, from a
driver callback's ``on_train_start`` to its ``on_train_end`` (rank 0's events, replayed on the
driver):

- the driver process's CPU seconds (all its threads: Python and Ray's core worker) per second of
  training;
- the polls the driver sent to the workers per second and per training step, and the bytes
  their answers held (pickled; the pickling's own CPU time is left out of the driver's), and the
  news questions it put to them again while training (each rank but 0 holds one from the call's
  start; a rank that answers it, with output lines or a SIGTERM notice, gets it again);
- the cold start: from the ``fit`` call to rank 0's first batch (reported by the same callback).

    python benchmarks/scale.py [--workers 2 4 8 16] [--seconds 10] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CPUS = 2


class Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class DriverMeter(pl.Callback):
    """Runs on the driver (a driver callback): CPU and time at rank 0's train start and end."""

    def __init__(self) -> None:
        self.marks: dict[str, tuple[float, float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.marks.setdefault("first_batch", (time.time(), _cpu_s()))

    def on_train_start(self, trainer, pl_module):
        self.marks["start"] = (time.time(), _cpu_s())

    def on_train_end(self, trainer, pl_module):
        self.marks["end"] = (time.time(), _cpu_s())


def run(workers: int, seconds: float) -> dict[str, float]:
    import ray

    from ray_lightning_sgd import RaySGDStrategy, _compat
    from ray_lightning_sgd._driver import inbox

    polls = {"count": 0, "news": 0, "bytes": 0, "measure_cpu_s": 0.0, "on": False}
    ask, deliver = inbox.RunInbox._ask, inbox.RunInbox._deliver
    ask_news = getattr(inbox.RunInbox, "_ask_news", None)  # absent before the news question

    def counted_ask(self, rank):
        if polls["on"]:
            polls["count"] += 1
        return ask(self, rank)

    def counted_ask_news(self, rank):
        if polls["on"]:
            polls["news"] += 1
        return ask_news(self, rank)

    def measured_deliver(self, rank, mail, run_calls):
        if polls["on"]:
            started = time.thread_time()
            polls["bytes"] += len(pickle.dumps(mail, protocol=5))
            polls["measure_cpu_s"] += time.thread_time() - started
        return deliver(self, rank, mail, run_calls)

    inbox.RunInbox._ask, inbox.RunInbox._deliver = counted_ask, measured_deliver
    if ask_news is not None:
        inbox.RunInbox._ask_news = counted_ask_news

    class Switch(DriverMeter):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            polls["on"] = True

        def on_train_end(self, trainer, pl_module):
            polls["on"] = False
            super().on_train_end(trainer, pl_module)

    torch.set_num_threads(1)
    _compat.bind_local_ray_to_loopback()
    ray.init(address="local", num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    meter = Switch()
    strategy = RaySGDStrategy(
        num_workers=workers, num_cpus_per_worker=CPUS / workers, driver_callbacks=[meter]
    )
    trainer = pl.Trainer(
        strategy=strategy,
        max_time={"seconds": seconds},
        max_epochs=-1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(4096, 32, generator=generator),
        torch.randint(0, 2, (4096,), generator=generator),
    )
    called = time.time()
    trainer.fit(Small(), DataLoader(data, batch_size=16))
    (start, cpu_start), (end, cpu_end) = meter.marks["start"], meter.marks["end"]
    trained_s = end - start
    steps = trainer.global_step
    return {
        "workers": workers,
        "cold_start_s": meter.marks["first_batch"][0] - called,
        "trained_s": trained_s,
        "steps_per_s": steps / trained_s,
        "driver_cpu_per_s": (cpu_end - cpu_start - polls["measure_cpu_s"]) / trained_s,
        "polls_per_s": polls["count"] / trained_s,
        "polls_per_step": polls["count"] / max(1, steps),
        # news questions put again while training (each rank holds one from the call's start)
        "news_per_s": polls["news"] / trained_s,
        "kb_polled_per_s": polls["bytes"] / 1024 / trained_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run(args.run, args.seconds)))
        return
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in args.workers}
    for repeat in range(args.repeats):
        for workers in args.workers:
            time.sleep(3)  # the previous run's Ray processes exit
            done = subprocess.run(
                [sys.executable, __file__, "--run", str(workers), "--seconds", str(args.seconds)],
                check=True, capture_output=True, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
            )  # fmt: skip
            rows[workers].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat + 1} {workers} workers: {rows[workers][-1]}", file=sys.stderr)
    columns = [
        ("cold_start_s", "cold start s", 2),
        ("steps_per_s", "steps/s", 1),
        ("driver_cpu_per_s", "driver CPU s per s", 3),
        ("polls_per_s", "polls/s", 1),
        ("polls_per_step", "polls per step", 2),
        ("news_per_s", "news questions/s", 1),
        ("kb_polled_per_s", "KB polled/s", 1),
    ]
    print(
        f"\nRaySGDStrategy, embedded Ray of {CPUS} CPUs (each worker {CPUS}/N of them), "
        f"{args.seconds:g} s of training a step after another; medians of {args.repeats}\n"
    )
    print("| workers | " + " | ".join(c[1] for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for workers, runs in rows.items():
        cells = [f"{statistics.median(r[key] for r in runs):.{d}f}" for key, _, d in columns]
        print(f"| {workers} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
