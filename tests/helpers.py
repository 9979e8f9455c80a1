"""Small models and data shared by the tests (importable, so ddp_spawn can pickle them)."""

from __future__ import annotations

import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning_sgd.pytorch_lightning import RayDataModule


def make_data(n: int = 96, features: int = 8, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


def loader(n: int = 96, batch_size: int = 8, shuffle: bool = False) -> DataLoader:
    return DataLoader(make_data(n), batch_size=batch_size, shuffle=shuffle)


class TinyModelSteps:
    """A two-layer classifier that logs its losses and an accuracy, for either namespace."""

    def __init__(self, fail_on_rank: int | None = None, fail_at_step: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.fail_on_rank = fail_on_rank
        self.fail_at_step = fail_at_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.fail_on_rank == self.global_rank and self.global_step == self.fail_at_step:
            raise ValueError(f"injected failure at step {self.global_step}")
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=getattr(self, "lr", 0.1))


class TinyModel(TinyModelSteps, pl.LightningModule):
    """TinyModelSteps as a pytorch_lightning module."""


def quiet_trainer_kwargs() -> dict:
    return {
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }


class CountingDataset(torch.utils.data.Dataset):
    """A dataset that counts how often the driver pickles it."""

    pickled = 0

    def __init__(self, n: int = 32) -> None:
        self.data = make_data(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]

    def __getstate__(self) -> dict:
        type(self).pickled += 1
        return self.__dict__


class GlobalStateProbe(TinyModel):
    """Fails on a worker unless the driver's deterministic flag reached it."""

    def on_train_start(self) -> None:
        if not torch.are_deterministic_algorithms_enabled():
            raise AssertionError("Trainer(deterministic=True) did not reach the worker")


class PidModel(TinyModel):
    """Logs the process id of rank 0, so a test can tell whether a call reused its workers."""

    def on_train_start(self) -> None:
        self._log_pid()

    def on_validation_start(self) -> None:
        self._log_pid()

    def on_test_start(self) -> None:
        self._log_pid()

    def _log_pid(self) -> None:
        # logged outside a step: callback_metrics on the driver then hold rank 0's pid
        self.trainer.callback_metrics["pid"] = torch.tensor(float(os.getpid()))


class TinyData(pl.LightningDataModule):
    """make_data as a DataModule (what LightningCLI builds from a config)."""

    def __init__(self, n: int = 96, batch_size: int = 8) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def train_dataloader(self) -> DataLoader:
        return loader(self.n, self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return loader(self.n // 2, self.batch_size)


def as_tuple(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A RayDataLoader's collate_fn: the (x, y) batches TinyModel takes, from Ray Data's columns."""
    return torch.as_tensor(batch["x"]), torch.as_tensor(batch["y"])


def _rows(count: int) -> list[dict]:
    x, y = make_data(count).tensors
    return [{"x": x[i].numpy(), "y": int(y[i])} for i in range(count)]


class TinyRayData(RayDataModule):
    """make_data's rows as Ray Data datasets: TinyData, streamed. Its datasets are made from its
    arguments, as LightningCLI builds a datamodule from flags."""

    def __init__(self, n: int = 96, batch_size: int = 8) -> None:
        import ray.data

        super().__init__(
            train=ray.data.from_items(_rows(n)), val=ray.data.from_items(_rows(n // 2)),
            batch_size=batch_size, collate_fn=as_tuple,
        )  # fmt: skip


def tiny_ray_data(n: int = 96, batch_size: int = 8) -> TinyRayData:
    return TinyRayData(n, batch_size)


class EpochEndCollectives(pl.LightningModule):
    """The common Lightning patterns that run collectives at epoch ends, on every rank.

    ``sync_dist=True`` metrics on step and on epoch, a torchmetrics object logged directly,
    ``self.all_gather`` and a torchmetrics ``compute()`` in ``on_validation_epoch_end`` and
    ``on_train_epoch_end``. Code of one rank that reads metrics there syncs them alone.
    """

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.val_acc = torchmetrics.classification.BinaryAccuracy()
        self.val_mean = torchmetrics.MeanMetric()
        self.train_mean = torchmetrics.MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, on_step=True, on_epoch=True)
        self.train_mean.update(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.val_acc(logits.argmax(1), y)
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.val_mean.update(loss)

    def on_validation_epoch_end(self) -> None:
        gathered = self.all_gather(torch.tensor([float(self.global_rank + 1)]))
        self.log("val_gathered", gathered.sum())
        self.log("val_mean", self.val_mean.compute())
        self.val_mean.reset()

    def on_train_epoch_end(self) -> None:
        gathered = self.all_gather(torch.tensor([float(self.global_rank + 2)]))
        self.log("train_gathered", gathered.sum())
        self.log("train_mean", self.train_mean.compute())
        self.train_mean.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PrecisionProbe(TinyModel):
    """Notes, inside ``training_step`` on each rank, what it computes in: the output's and the
    weights' dtypes, the device, the process group's backend and the CUDA generator's seed (rank
    0's notes come back to the driver as a public attribute)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        on_gpu = self.device.type == "cuda"
        self.seen = {
            "output": str(logits.dtype),
            "weights": str(self.net[0].weight.dtype),
            "device": self.device.type,
            "backend": torch.distributed.get_backend(),
            "cuda_seed": torch.cuda.initial_seed() if on_gpu else None,
        }
        return nn.functional.cross_entropy(logits.float(), y)


def hang_reports(log_text: str, about: str) -> int:
    """How many of the driver's hang reports in ``log_text`` are about ``about`` (a stack's
    line). A start slower than a test's short window is a quiet period of its own, with a
    report of its own that says where the ranks were then."""
    reports = log_text.split("No rank has made progress for")[1:]
    return sum(about in report for report in reports)
