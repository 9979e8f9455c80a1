"""The digits classifier of ``digits.py``, fed by Ray Data: parquet files, a preprocessing step on
the cluster's CPUs, each worker streaming its share.

The digits images of ``digits.py`` are written to parquet files in a temporary folder (as a
dataset would lie on shared storage), read back with ``ray.data.read_parquet``, scaled by a
``map_batches`` step that runs in Ray Data's tasks, and streamed to 2 workers through
``RayDataModule``. Run it with ``python examples/digits_ray_data.py``; it prints the test accuracy
that the workers measured and the one measured on the driver's copy of the model.

The workers take half a CPU each (``num_cpus_per_worker=0.5``): Ray Data's read and map tasks need
CPUs beside the workers'.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytorch_lightning as pl
import ray.data
import torch
from digits import DigitsClassifier, load_digits, split

from ray_lightning_sgd import RaySGDStrategy
from ray_lightning_sgd.data import RayDataModule, connect


def write_parquet(folder: Path) -> dict[str, str]:
    """Writes the digits (raw pixel values 0-16), split 70/15/15, as parquet files: one folder
    a split, two files each."""
    images, labels = load_digits()
    paths = {}
    for name, rows in zip(("train", "val", "test"), split(labels), strict=True):
        x, y = images[rows], labels[rows]
        paths[name] = str(folder / name)
        Path(paths[name]).mkdir()
        for part, rows in enumerate(np.array_split(np.arange(len(y)), 2)):
            table = pa.table({"pixels": list(x[rows].astype(np.float32)), "label": y[rows]})
            pq.write_table(table, f"{paths[name]}/part-{part}.parquet")
    return paths


def scale(batch: dict) -> dict:
    """The preprocessing step, run by Ray Data's tasks: pixels to [0, 1]."""
    return {"x": np.stack(batch["pixels"]) / np.float32(16.0), "label": batch["label"]}


def as_tuple(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The batches DigitsClassifier takes: (images, labels)."""
    return torch.as_tensor(batch["x"]), torch.as_tensor(batch["label"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=10)
    args = parser.parse_args()

    pl.seed_everything(0)
    connect()  # the embedded Ray the strategy would start (else Ray Data starts one its own way)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_parquet(Path(folder))
        data = RayDataModule(
            train=ray.data.read_parquet(paths["train"]).map_batches(scale),
            val=ray.data.read_parquet(paths["val"]).map_batches(scale),
            test=ray.data.read_parquet(paths["test"]).map_batches(scale),
            batch_size=64,
            collate_fn=as_tuple,
            local_shuffle_buffer_size=256,  # rows shuffled within each worker's stream
            local_shuffle_seed=0,
        )
        model = DigitsClassifier()
        trainer = pl.Trainer(
            strategy=RaySGDStrategy(num_workers=args.num_workers, num_cpus_per_worker=0.5),
            max_epochs=args.max_epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(model, datamodule=data)
        results = trainer.test(model, datamodule=data)
        print(f"trainer.test on the workers: {results}")
        rows = ray.data.read_parquet(paths["test"]).map_batches(scale).take_all()  # 269 rows
        x = torch.as_tensor(np.stack([r["x"] for r in rows]))
        y = torch.as_tensor(np.array([r["label"] for r in rows]))
        model.eval()
        with torch.no_grad():
            accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
        print(f"test accuracy on the driver: {accuracy:.4f}")


if __name__ == "__main__":
    main()
