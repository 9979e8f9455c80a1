"""A real NCCL run on CUDA GPUs; skipped on machines without them."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from ray_lightning_sgd import RaySGDStrategy
from tests.conftest import assert_only_idle_workers_left
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class DeviceRecorder(TinyModel):
    def on_train_start(self) -> None:
        assert self.device.type == "cuda", self.device
        assert torch.distributed.get_backend() == "nccl"


def test_fit_with_nccl_on_gpus(ray_cluster):
    workers = min(2, torch.cuda.device_count())
    pl.seed_everything(0)
    model = DeviceRecorder()
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=workers, use_gpu=True),
        max_epochs=1,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, loader())
    assert trainer.global_step == 96 // 8 // workers
    assert all(p.device.type == "cpu" for p in model.parameters()), (
        "weights come back to the driver"
    )
    assert assert_only_idle_workers_left() == 1
