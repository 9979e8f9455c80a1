"""Train a digits classifier with RaySGDStrategy on an embedded local Ray instance.

The data is scikit-learn's bundled 8x8 digits images (1,797 samples), so nothing is downloaded.
Run it with ``python examples/digits.py``; it prints the test accuracy measured on the driver.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning_sgd import RaySGDStrategy


class DigitsData(pl.LightningDataModule):
    """scikit-learn's digits, scaled to [0, 1], split 70/15/15."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images / 16.0, dtype=torch.float32)
        y = torch.tensor(labels, dtype=torch.long)
        x_train, x_rest, y_train, y_rest = train_test_split(
            x, y, test_size=0.3, random_state=0, stratify=y
        )
        x_val, x_test, y_val, y_test = train_test_split(
            x_rest, y_rest, test_size=0.5, random_state=0, stratify=y_rest
        )
        self.train = TensorDataset(x_train, y_train)
        self.val = TensorDataset(x_val, y_val)
        self.test = TensorDataset(x_test, y_test)

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
