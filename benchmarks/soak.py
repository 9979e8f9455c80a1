"""Soak: many consecutive fit and validate calls in one driver; nothing may pile up.

    python benchmarks/soak.py --calls 30

Prints, after a first warm-up call, the driver's open file descriptors and resident memory, and our
live actors and placement groups, then the same after the calls; exits non-zero if more than the one
warm group is left, the descriptors grew, or memory grew by 100 MB or more.
"""

from __future__ import annotations

import argparse
import sys

import psutil
import pytorch_lightning as pl
import ray
import torch
from ray.util.placement_group import placement_group_table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning_sgd import RaySGDStrategy, _compat, shutdown_workers
from ray_lightning_sgd.worker_group import NAME_PREFIX


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _ours() -> tuple[int, int]:
    actors = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(NAME_PREFIX)
    ]
    groups = [
        g
        for g in placement_group_table().values()
        if g["name"].startswith(NAME_PREFIX) and g["state"] != "REMOVED"
    ]
    return len(actors), len(groups)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    _compat.bind_local_ray_to_loopback()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 32, generator=generator), torch.randint(0, 2, (256,)))
    model = Model()

    def trainer() -> pl.Trainer:
        return pl.Trainer(
            strategy=RaySGDStrategy(num_workers=2),
            max_epochs=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
        )

    trainer().fit(model, DataLoader(data, batch_size=32))
    process = psutil.Process()
    fds, rss = process.num_fds(), process.memory_info().rss
    print(f"after warm-up: {fds} fds, {rss / 2**20:.0f} MB, actors/groups {_ours()}")
    for call in range(args.calls):
        t = trainer()
        if call % 2:
            t.validate(model, DataLoader(data, batch_size=32), verbose=False)
        else:
            t.fit(model, DataLoader(data, batch_size=32))
    grown_fds = process.num_fds() - fds
    grown_mb = (process.memory_info().rss - rss) / 2**20
    left = _ours()
    print(
        f"after {args.calls} calls: {process.num_fds()} fds ({grown_fds:+d}), "
        f"{process.memory_info().rss / 2**20:.0f} MB ({grown_mb:+.0f} MB), actors/groups {left}"
    )
    shutdown_workers()
    print(f"after shutdown_workers(): actors/groups {_ours()}")
    ok = left == (2, 1) and grown_fds <= 0 and grown_mb < 100 and _ours() == (0, 0)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
