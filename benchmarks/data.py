"""Ray Data through RaySGDStrategy against a plain DataLoader on each worker, same files, same step.

Writes a parquet dataset on local disk (``--rows`` rows of 64 float features and a label, 8
files), then trains one MLP with 2 workers from

- ``ray_data``: ``ray.data.read_parquet`` + a ``map_batches`` preprocessing step, streamed to the
  workers through ``RayDataLoader`` (the workers take half a CPU each, Ray Data the rest);
- ``dataloader``: each worker reads the same files with pyarrow into a torch Dataset and runs the
  same preprocessing in its DataLoader (``DistributedSampler``, as Lightning injects it).

Every run is a fresh process (its own embedded Ray), modes interleaved, medians of
``--repeats``. Reported per mode: rows per second into the model (all ranks), the median step
time, the seconds from the call to the first batch, and CPU seconds spent by the driver, by the
workers (their processes, measured in them) and by everything else on the machine during the
fit (Ray Data's tasks and Ray's daemons; the machine's total minus the two).

``--rss`` measures the driver's peak RSS for a fit on ``--rows`` and on 10x as many rows (Ray
Data only): it must not grow with the rows.

    .venv/bin/pip install -e ".[bench]" && .venv/bin/python benchmarks/data.py
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

FEATURES = 64
FILES = 8
BATCH = 256


def preprocess(batch: dict) -> dict:
    """The preprocessing step, the same on both sides: standardise, then a fixed nonlinear
    projection (as feature engineering would cost)."""
    import numpy as np

    x = np.stack(batch["x"]).astype(np.float32)
    x = (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-6)
    weights = np.random.default_rng(0).normal(size=(FEATURES, FEATURES)).astype(np.float32)
    return {"x": np.tanh(x @ weights), "y": batch["y"]}


def write(folder: Path, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for i, part in enumerate(np.array_split(np.arange(rows), FILES)):
        x = rng.normal(size=(len(part), FEATURES)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        pq.write_table(pa.table({"x": list(x), "y": y}), folder / f"part-{i}.parquet")


def run_once(mode: str, folder: str, epochs: int) -> dict:
    """One fit in this process; returns its measurements."""
    import numpy as np
    import pytorch_lightning as pl
    import ray.data
    import torch
    from torch import nn

    from ray_lightning_sgd import RaySGDStrategy
    from ray_lightning_sgd.data import RayDataLoader, connect

    torch.set_num_threads(1)
    connect()
    report = Path(tempfile.mkdtemp())

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(FEATURES, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                nn.Linear(512, 2),
            )  # fmt: skip
            self.times: list[float] = []
            self.rows = 0

        def on_train_start(self) -> None:
            torch.set_num_threads(1)
            self.cpu0, self.wall0, self.last = time.process_time(), time.time(), None

        def on_train_batch_start(self, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            else:
                self.first = time.time()
            self.last = now
            self.rows += len(batch[1])

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def on_train_end(self) -> None:
            Path(report, f"rank-{self.global_rank}.json").write_text(json.dumps({
                "cpu": time.process_time() - self.cpu0, "rows": self.rows,
                "wall": time.time() - self.first, "first": self.first,
                "step": statistics.median(self.times),
            }))  # fmt: skip

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def as_tuple(batch: dict):
        return torch.as_tensor(batch["x"]), torch.as_tensor(batch["y"])

    if mode == "ray_data":
        dataset = ray.data.read_parquet(folder).map_batches(preprocess)
        data = RayDataLoader(dataset, batch_size=BATCH, collate_fn=as_tuple)
    else:
        data = torch.utils.data.DataLoader(
            ParquetRows(folder), batch_size=BATCH, collate_fn=collate
        )
    strategy = RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.5, reuse_workers=False)
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    machine0, driver0 = machine_cpu_s(), time.process_time()
    called = time.time()
    trainer.fit(Model(), data)
    machine, driver = machine_cpu_s() - machine0, time.process_time() - driver0
    ranks = [json.loads(p.read_text()) for p in sorted(report.glob("rank-*.json"))]
    workers = sum(r["cpu"] for r in ranks)
    wall = max(r["first"] + r["wall"] for r in ranks) - min(r["first"] for r in ranks)
    return {
        "rows_per_s": sum(r["rows"] for r in ranks) / wall,
        "step_ms": 1000 * statistics.median(r["step"] for r in ranks),
        "first_batch_s": min(r["first"] for r in ranks) - called,
        "driver_cpu_s": driver,
        "worker_cpu_s": workers,
        "other_cpu_s": machine - driver - workers,
        "driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load": np.round(os.getloadavg()[0], 2),
    }


def machine_cpu_s() -> float:
    """CPU seconds spent so far by every process of this machine (its cgroup, where there is
    one: Ray's workers run niced, which psutil's ``user`` leaves out)."""
    for path, scale in (("/sys/fs/cgroup/cpuacct/cpuacct.usage", 1e-9),):
        if os.path.exists(path):
            return int(Path(path).read_text()) * scale
    stat = Path("/sys/fs/cgroup/cpu.stat")
    if stat.exists():
        usage = dict(line.split() for line in stat.read_text().splitlines())
        return int(usage["usage_usec"]) * 1e-6
    import psutil

    times = psutil.cpu_times()
    return times.user + getattr(times, "nice", 0.0) + times.system


class ParquetRows:
    """The plain side's torch Dataset: every file read with pyarrow on the worker, preprocessed
    in ``__getitems__`` batches as the DataLoader asks for them."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._table = None

    def _rows(self):
        if self._table is None:
            import pyarrow.parquet as pq

            self._table = pq.read_table(self.folder)
        return self._table

    def __len__(self) -> int:
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(p).metadata.num_rows for p in sorted(Path(self.folder).glob("*")))

    def __getitems__(self, indices: list[int]) -> dict:
        rows = self._rows().take(indices).to_pydict()
        return preprocess({"x": rows["x"], "y": rows["y"]})

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "_table": None}


def collate(batch: dict):
    import torch

    return torch.as_tensor(batch["x"]), torch.as_tensor(batch["y"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss", action="store_true", help="driver RSS at --rows and 10x rows")
    parser.add_argument("--one", nargs=2, metavar=("MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_once(args.one[0], args.one[1], args.epochs)), flush=True)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-data-"))
    sizes = [args.rows, 10 * args.rows] if args.rss else [args.rows]
    for rows in sizes:
        Path(root, str(rows)).mkdir()
        write(Path(root, str(rows)), rows)
    modes = [("ray_data", rows) for rows in sizes] if args.rss else [
        ("ray_data", args.rows), ("dataloader", args.rows)
    ]  # fmt: skip
    results: dict[tuple[str, int], list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, rows in modes:  # interleaved
            time.sleep(3)
            out = subprocess.run(
                [sys.executable, __file__, "--one", mode, str(Path(root, str(rows))),
                 "--epochs", str(args.epochs)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
            results[(mode, rows)].append(json.loads(line))
            print(mode, rows, line, flush=True)
    keys = list(next(iter(results.values()))[0])
    print("\n| mode | rows | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for (mode, rows), runs in results.items():
        medians = [statistics.median(r[k] for r in runs) for k in keys]
        print(f"| {mode} | {rows} | " + " | ".join(f"{v:.3g}" for v in medians) + " |")


if __name__ == "__main__":
    main()
