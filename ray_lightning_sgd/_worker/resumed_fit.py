"""Runs on each worker: how a fit resumed from a resume checkpoint goes on as if never stopped.

A point written inside an epoch resumes exactly there: the restarted attempt's train DataLoader
skips the batches the epoch had trained (:func:`skip_first_batches`), where Lightning alone would
train the epoch's first batches again (it resumes a plain DataLoader exactly only at an epoch's
end). Here too: what the fit's train iterables look like (how many ranks share them, whether
Lightning restores their position itself), whether its steps can resume inside an epoch at all, the
shift of Lightning's batch counts for another number of ranks, and a warning for a scheduler that
came back sized for fewer steps than the resumed fit takes.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd._boundary.datasets import DatasetShard
from ray_lightning_sgd._compat import has_callback, train_combined_loader

if TYPE_CHECKING:
    import pytorch_lightning as pl


def warn_schedulers_that_end_too_soon(trainer: pl.Trainer) -> None:
    """Runs on each worker of a resumed fit (rank 0 warns). A scheduler sized once from the
    run's steps (``OneCycleLR(total_steps=trainer.estimated_stepping_batches)``) gets its size
    back from the checkpoint; where the run now takes more steps (an elastic run on fewer
    workers), it would raise at its last step, hours later: said now, with the fixes."""
    sized = [
        config.scheduler
        for config in trainer.lr_scheduler_configs
        if isinstance(getattr(config.scheduler, "total_steps", None), int)
    ]
    if not sized:
        return
    steps = trainer.estimated_stepping_batches  # no collective: lengths and limits
    if not math.isfinite(steps):
        return  # no end (max_epochs=-1): nothing to compare with
    for scheduler in sized:
        total = int(getattr(scheduler, "total_steps", 0))
        if total < steps and trainer.global_rank == 0:
            warnings.warn(
                f"{type(scheduler).__name__}(total_steps={total}) came back from the resume "
                f"checkpoint, but the resumed fit takes {steps:g} optimizer steps in all (on "
                f"{trainer.world_size} workers): it will raise when it passes {total}. Size it "
                "for the largest number of steps, or pass keep_global_batch_size=True to an "
                "elastic run (each epoch then keeps its steps)",
                stacklevel=2,
            )


def _is_stateful(dataloader: Any) -> bool:
    """Whether Lightning saves and restores the iterable's position (as its ``_Stateful``)."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(
        getattr(dataloader, "load_state_dict", None)
    )


def _train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The fit's train iterables, each as Lightning iterates it (never iterated here)."""
    combined = train_combined_loader(trainer)
    return list(combined.flattened) if combined is not None else [None]


def _steps_resume_inside(trainer: pl.Trainer) -> bool:
    """Whether a fit's steps resume inside an epoch as they would have gone on: not with a
    stateful DataLoader (its saved position is a batch ahead of a batch's start) nor with a
    GradientAccumulationScheduler (it sets the accumulation at an epoch's start, which a
    resumed epoch does not run again)."""
    if any(_is_stateful(loader) for loader in _train_loaders(trainer)):
        return False
    return not has_callback(trainer, "GradientAccumulationScheduler")


def _replicas(dataloader: Any) -> int:
    """How many ranks share the loader's data: its DistributedSampler's replicas (with tensor
    parallelism fewer than the world size), a Ray Data split's ranks, else 1 (each rank reads
    it all)."""
    shard = getattr(dataloader, "dataset", None)
    if isinstance(shard, DatasetShard):
        return shard.world_size
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        replicas = getattr(sampler, "num_replicas", None)
        if isinstance(replicas, int) and replicas > 0:
            return replicas
    return 1


def skip_first_batches(dataloader: Any, count: int, epoch: int) -> bool:
    """Runs on each worker. Makes the next iteration of a DataLoader the rest of ``epoch``: its
    sampler set to that epoch, the first ``count`` batches loaded and dropped (later iterations
    are whole), for a fit that resumes inside an epoch; False where it cannot: an iterable that
    is no DataLoader, or an order that is new each time.

    The epoch is set here because Lightning makes the resumed epoch's iterator before it sets
    the samplers' epoch: a shuffling DistributedSampler would deal the first epoch's order.
    """
    from torch.utils.data import DataLoader, SequentialSampler

    if not isinstance(dataloader, DataLoader):
        return False
    batch_sampler = dataloader.batch_sampler
    # what deals the order: the batch sampler's sampler, or a batch sampler of its own making
    dealer = getattr(batch_sampler, "sampler", batch_sampler or dataloader.sampler)
    if not (callable(getattr(dealer, "set_epoch", None)) or isinstance(dealer, SequentialSampler)):
        return False  # another order each time (a RandomSampler): no position to skip to
    loader_class = type(dataloader)

    def __iter__(self: Any) -> Any:  # replaces the class's own
        self.__class__ = loader_class  # once: the epochs after this one are whole
        for sampler in {id(s): s for s in (self.sampler, batch_sampler, dealer)}.values():
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        iterator = loader_class.__iter__(self)
        for _ in range(count):
            next(iterator, None)
        return iterator

    namespace = {"__iter__": __iter__, "__module__": loader_class.__module__}
    dataloader.__class__ = type(loader_class.__name__, (loader_class,), namespace)
    return True
