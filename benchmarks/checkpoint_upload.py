"""Benchmark: what a resume checkpoint holds training up, by where it goes.

Each fit (``RaySGDStrategy(num_workers=2)``, a model of ``--mb`` MB of float32 weights, plain SGD
so that the checkpoint is the weights' size) trains ``--epochs`` epochs of ``--samples`` samples
(batches of 8 on each of the 2 workers; 256 samples: about half a second an epoch for 51 MB on
two cores, as in the issue's measurement); a callback on rank 0
times each epoch boundary: from the end of an epoch's last batch (the user's epoch-end hooks run
before the strategy's resume checkpoint) to the next epoch's first batch, or the fit's end. The
modes, interleaved round by round:

- ``none``: no resume checkpoints (no restarts): Lightning's own boundary, the baseline;
- ``driver``: ``max_failures=1`` without a storage: the checkpoint's bytes go to the driver;
- ``local``: ``checkpoint_storage`` a local folder;
- ``s3``: ``checkpoint_storage`` an ``s3://`` URI on moto's S3 server (127.0.0.1, this process),
  with ``storage_options``.

A mode's **blocked** time is the median boundary less the ``none`` median: what the checkpoint
holds the training thread up. The **upload** is the time ``ray_lightning_sgd._files.upload``
takes for the same checkpoint file from this process to the storage (to S3: the HTTP upload to
moto; to the local folder: the copy and its sync), median of three.

    python benchmarks/checkpoint_upload.py [--mb 51] [--epochs 4] [--rounds 3] [--samples 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Wide(pl.LightningModule):
    """One square linear layer of about ``mb`` MB of float32 weights."""

    def __init__(self, mb: float) -> None:
        super().__init__()
        self.width = int((mb * 1e6 / 4) ** 0.5)
        self.layer = nn.Linear(self.width, self.width, bias=False)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


class Boundaries(pl.Callback):
    """Rank 0: the seconds from each epoch's end (its last batch done) to the next epoch's
    first batch, or the fit's end; written to ``out`` as JSON at the fit's end."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.ended: float | None = None
        self.gaps: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.ended = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.ended is not None:
            self.gaps.append(time.perf_counter() - self.ended)
            self.ended = None

    def on_train_end(self, trainer, pl_module) -> None:
        if self.ended is not None:
            self.gaps.append(time.perf_counter() - self.ended)
        if trainer.global_rank == 0:
            Path(self.out).write_text(json.dumps(self.gaps))


def fit(mode: str, mb: float, epochs: int, samples: int, s3: dict, work: Path) -> list[float]:
    from ray_lightning_sgd import RaySGDStrategy

    kwargs: dict = {}
    if mode != "none":
        kwargs["max_failures"] = 1
    if mode == "local":
        kwargs["checkpoint_storage"] = str(work / "runs")
    if mode == "s3":
        kwargs.update(checkpoint_storage=f"s3://{s3['bucket']}/runs", storage_options=s3["options"])
    model = Wide(mb)
    data = TensorDataset(torch.randn(samples, model.width))
    out = work / f"{mode}.json"
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2, **kwargs), accelerator="cpu", max_epochs=epochs,
        callbacks=[Boundaries(str(out))], enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))
    # the first boundary's checkpoint may find the workers' scratch folders cold: all count
    return json.loads(out.read_text())


def upload_seconds(mb: float, s3: dict, work: Path) -> dict[str, float]:
    from ray_lightning_sgd import _files

    source = work / "checkpoint.bin"
    source.write_bytes(os.urandom(int(mb * 1e6)))
    _files.use_storage_options(f"s3://{s3['bucket']}", s3["options"])
    times: dict[str, list[float]] = {"local": [], "s3": []}
    for i in range(3):
        for mode, uri in (
            ("local", str(work / "uploads" / f"c{i}.bin")),
            ("s3", f"s3://{s3['bucket']}/uploads/c{i}.bin"),
        ):
            started = time.perf_counter()
            _files.upload(str(source), uri)
            times[mode].append(time.perf_counter() - started)
    source.unlink()
    return {mode: statistics.median(values) for mode, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=51.0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from ray_lightning_sgd import _compat
    from tests.s3 import s3_server

    _compat.ray.bind_local_ray_to_loopback()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    modes = ["none", "driver", "local", "s3"]
    gaps: dict[str, list[float]] = {mode: [] for mode in modes}
    with s3_server() as server, tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        bucket = server.new_bucket("bench")
        s3 = {"bucket": bucket, "options": server.storage_options}
        fit("none", args.mb, 1, 16, s3, work)  # warm workers, and the imports
        for round_ in range(args.rounds):
            for mode in modes:
                gaps[mode] += fit(mode, args.mb, args.epochs, args.samples, s3, work)
                print(f"round {round_}: {mode} boundaries {gaps[mode][-args.epochs :]}", flush=True)
        uploads = upload_seconds(args.mb, s3, work)
    ray.shutdown()
    median = {mode: statistics.median(values) for mode, values in gaps.items()}
    blocked = {mode: max(0.0, median[mode] - median["none"]) for mode in modes[1:]}
    result = {
        "mb": args.mb, "epochs": args.epochs, "rounds": args.rounds, "samples": args.samples,
        "boundary_median_s": median, "blocked_s": blocked, "upload_s": uploads,
        "s3_blocked_over_local_blocked": blocked["s3"] / max(blocked["local"], 1e-9),
        "s3_blocked_over_upload": blocked["s3"] / uploads["s3"],
    }  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
