"""A model that FSDP2 shards in ``configure_model``, and Lightning's own run of it for reference.

``python -m tests.sharded_models OUT`` trains it under Lightning's ``ModelParallelStrategy`` on 2
CPU processes (Lightning starts rank 1 by running this command again) and saves the full weights
to ``OUT/weights.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn

from tests.helpers import loader

EPOCHS = 2


class ShardedMLP(pl.LightningModule):
    """A three-layer MLP; with ``shard``, ``configure_model`` shards each layer and the whole
    over the data-parallel mesh with FSDP2 (``fully_shard``); without, it is left to DDP."""

    def __init__(self, shard: bool = True) -> None:
        super().__init__()
        self.shard = shard
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)
        )

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # what the workers train: DTensor shards under FSDP2, plain tensors under DDP
        self.parameter_type = type(self.net[0].weight).__name__
        self.local_numel = self.net[0].weight.to_local().numel() if self.shard else None
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class FaultyShardedMLP(ShardedMLP):
    """Rank ``rank``'s process exits at global step ``step``, the first time only (``marker``)."""

    def __init__(self, rank: int, step: int, marker: str) -> None:
        super().__init__()
        self.fault = (rank, step, marker)

    def training_step(self, batch, batch_idx):
        rank, step, marker = self.fault
        if self.global_rank == rank and self.global_step == step and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        return super().training_step(batch, batch_idx)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """All ranks: the model's whole weights (rank 0 receives them; the others an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def main() -> None:
    out = Path(sys.argv[1])
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = ShardedMLP()
    trainer = pl.Trainer(
        strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        default_root_dir=str(out / "lightning"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(model, loader())
    weights = full_weights(model)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        torch.save(weights, out / "weights.part")
        os.replace(out / "weights.part", out / "weights.pt")
    # both processes leave the process group before they exit: gloo's threads, left running at
    # interpreter exit, ended the process with SIGABRT once in a while
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
