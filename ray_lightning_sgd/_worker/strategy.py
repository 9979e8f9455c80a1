"""Runs on each worker: the strategies' methods that Lightning calls inside a worker's Trainer.

A strategy of this package is two halves joined in its namespace's module
(:mod:`ray_lightning_sgd.pytorch_lightning`, :mod:`ray_lightning_sgd.lightning`): the driver half
(:mod:`ray_lightning_sgd._driver.strategy` and :mod:`ray_lightning_sgd._driver.variants`: the
constructor, its checks, the launcher) and the worker half here, one mixin per kind of
strategy, placed before the driver half.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.data_loader import RayDataLoader
from ray_lightning_sgd._worker.resume import ResumeCheckpointBase

if TYPE_CHECKING:
    from pytorch_lightning.strategies import DDPStrategy as _Base
else:
    _Base = object


def _epoch(trainer: Any) -> int:
    """The epoch of a fit that Lightning gives samplers' ``set_epoch`` (``current_epoch`` is
    one behind it as a fit resumed from an epoch's end sets its data up)."""
    return int(trainer.fit_loop.epoch_progress.current.processed)


class OnWorkersBase(_Base):
    """Runs on each worker: what every strategy of this package does inside a worker."""

    @override
    def set_world_ranks(self) -> None:
        # the ranks were assigned by the worker group and are already in the environment
        self.flavour.rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Runs on each worker. Lightning's; then a train RayDataLoader begins at the pass of
        the epoch it is made for (a fit's first, a resumed fit's, each reload's), and a fit
        restarted from an in-epoch resume checkpoint (a preemption's) skips, in its train
        DataLoader's first epoch, the batches that epoch had trained."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.training:
            if isinstance(dataloader, RayDataLoader):
                dataloader.follow_epochs(functools.partial(_epoch, trainer))
            for callback in _compat.hidden_callbacks_of(trainer):
                if isinstance(callback, ResumeCheckpointBase):
                    callback.resume_inside_epoch(dataloader, trainer)
        return dataloader

    @override
    def on_train_start(self) -> None:
        """Runs on each worker. A train RayDataLoader that began a pass of another epoch than
        the fit's, now that a resumed fit's loop state is restored, begins again: one without
        a length began its pass to prefetch a batch as Lightning set the train data up, which
        ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` does before
        Lightning restores the checkpoint (at epoch 0, then)."""
        super().on_train_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return
        combined = _compat.train_combined_loader(trainer)
        early = [
            loader
            for loader in ([] if combined is None else combined.flattened)
            if isinstance(loader, RayDataLoader)
            and loader.reading is not None
            and loader.reading != _epoch(trainer)
        ]
        fetcher = _compat.train_data_fetcher(trainer)
        if early and fetcher is not None:
            for loader in early:
                loader.begin_again()
            iter(fetcher)  # every rank alike: the passes of the split begin again

    def resume_checkpoints(self) -> contextlib.AbstractContextManager[Any]:
        """Runs on each worker. A context in which ``Trainer.save_checkpoint`` writes a resume
        checkpoint: one file, written by rank 0, that the driver keeps for restarts."""
        return contextlib.nullcontext()

    def full_state_dict(self) -> dict[str, Any]:
        """Runs on each worker (all of them: it may be a collective). The model's whole state
        dict, on rank 0 at least, which the driver's model loads."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__} has no model to take the state dict of")
        return module.state_dict()

    def non_persistent_buffers(self) -> dict[str, Any]:
        """Runs on each worker (all of them: a sharded buffer is gathered). The model's buffers
        that its state dict leaves out (registered with ``persistent=False``: a rotary
        embedding's frequencies, a mask), whole, under the names the driver's model gives them:
        a model built on the meta device gets them too, and the driver holds rank 0's, as
        Lightning's rank 0 does."""
        from torch.distributed.tensor import DTensor

        module = self.lightning_module
        found: dict[str, Any] = {}
        for key, table, name in (
            [] if module is None else _compat.torch.non_persistent_buffers(module)
        ):
            tensor = table.get(name)
            if tensor is None:
                continue
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # every rank alike: a collective
            found[_compat.torch.unwrapped_name(key)] = tensor.detach()
        return found


class SamplesByWorldRank(_Base):
    """Runs on each worker: each worker reads its share of the data by its global rank among all
    workers (Lightning's DDP and FSDP multiply nodes by a node's processes, which on Ray differ
    from node to node)."""

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


class SGDOnWorkers(SamplesByWorldRank, OnWorkersBase):
    """Runs on each worker: RaySGDStrategy's worker half."""


class ShardedOnWorkers(OnWorkersBase):
    """Runs on each worker: what the sharded strategies share: the full weights gathered shard by
    shard for the driver, and resume checkpoints saved whole."""

    @override
    def resume_checkpoints(self) -> contextlib.AbstractContextManager[Any]:
        # one file that rank 0 writes, with every rank's shards gathered to it on the CPU: it
        # travels to the driver and back as DDP's does, and loads into the sharded model on
        # restart (torch's distributed checkpoint would leave a shard on every rank's node)
        return _compat.whole_checkpoints(self, self.lightning_strategy().__name__)  # type: ignore[attr-defined]

    @override
    def full_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # every rank takes part; rank 0 alone receives each tensor, whole and on the CPU, one
        # parameter at a time (never the whole model in one rank's device memory)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)  # type: ignore[arg-type]


#: Runs on each worker: the device meshes of this process's calls, one a shape.
_MESHES: dict[tuple[Any, ...], Any] = {}


class ModelParallelOnWorkers(ShardedOnWorkers):
    """Runs on each worker: RayModelParallelStrategy's worker half."""

    @override
    def setup_environment(self) -> None:
        """Runs on each worker. Lightning's, then the device mesh of an earlier call of the
        same shape takes the new one's place (whose process groups go): warm workers would
        otherwise gain a set of groups on every call. Kept, not destroyed at the call's end:
        rank 0 gathers the weights over them after Lightning's teardown (as a model's
        ``on_fit_end`` may), and after that the next call's gather still named a destroyed
        group (something in torch keeps the earlier mesh's group names)."""
        super().setup_environment()
        made = self.device_mesh  # type: ignore[attr-defined]
        kept = _MESHES.setdefault(_compat.torch.mesh_key(made), made)
        if kept is not made:
            _compat.torch.destroy_mesh_groups(made)
            _compat.lightning.set_device_mesh(self, kept)


class FSDPOnWorkers(SamplesByWorldRank, ShardedOnWorkers):
    """Runs on each worker: RayFSDPStrategy's worker half."""


__all__ = ["FSDPOnWorkers", "ModelParallelOnWorkers", "OnWorkersBase", "SGDOnWorkers"]
