"""Train a digits classifier with RaySGDStrategy on an embedded local Ray instance.

The data is the 8x8 digits images (1,797 samples) that scikit-learn bundles, kept in
``examples/data/digits.npz`` (``examples/data/README.md`` says where it comes from), so nothing is
downloaded. Run it with ``python examples/digits.py``; it prints the test accuracy measured on the driver.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning_sgd import RaySGDStrategy

DIGITS = Path(__file__).resolve().parent / "data" / "digits.npz"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images as rows of 64 pixel values 0-16, and their labels 0-9."""
    with np.load(DIGITS) as data:
        return data["images"].reshape(-1, 64), data["labels"].astype(np.int64)


def split(labels: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of a 70/15/15 train/validation/test split that keeps each digit's share in
    every part (each digit's samples shuffled with ``seed``, then cut at 70% and 85%; NumPy's
    legacy generator, whose stream every NumPy release keeps)."""
    rng = np.random.RandomState(seed)
    parts: tuple[list, list, list] = ([], [], [])
    for digit in np.unique(labels):
        samples = rng.permutation(np.flatnonzero(labels == digit))
        cuts = np.split(samples, [round(0.7 * len(samples)), round(0.85 * len(samples))])
        for part, taken in zip(parts, cuts, strict=True):
            part.append(taken)
    train, val, test = (np.sort(np.concatenate(part)) for part in parts)
    return train, val, test


class DigitsData(pl.LightningDataModule):
    """The digits, scaled to [0, 1], split 70/15/15."""

    def __init__(
        self, batch_size: int = 64, digits: tuple[np.ndarray, np.ndarray] | None = None
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        images, labels = load_digits() if digits is None else digits
        x = torch.tensor(images / 16.0, dtype=torch.float32)
        y = torch.tensor(labels, dtype=torch.long)
        self.train, self.val, self.test = (
            TensorDataset(x[rows], y[rows]) for rows in split(labels)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log(f"{stage}_loss", loss, sync_dist=True, prog_bar=stage == "train")
        self.log(f"{stage}_acc", acc, sync_dist=True, prog_bar=stage != "train")
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def accuracy_on_driver(model: nn.Module, data: DigitsData) -> float:
    """Accuracy of the driver's copy of the model, which fit() filled with the trained weights."""
    model.eval()
    with torch.no_grad():
        x, y = data.test.tensors
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=10)
    args = parser.parse_args()

    pl.seed_everything(0)
    data = DigitsData()
    model = DigitsClassifier()
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=args.num_workers),
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    results = trainer.test(model, datamodule=data)
    print(f"trainer.test on the workers: {results}")
    print(f"test accuracy on the driver: {accuracy_on_driver(model, data):.4f}")


if __name__ == "__main__":
    main()
