"""Runs on each worker: the exchange of SIGTERM (preemption) notices between the ranks of a fit.

A worker that receives SIGTERM sets a flag (:data:`ray_lightning_sgd._worker_group.worker.preemption`);
at step boundaries the ranks share their flags (:class:`_Notices`), so that every rank stops at the
same boundary, where :class:`~ray_lightning_sgd._worker.resume.ResumeCheckpointBase` writes a
resume checkpoint. The same exchange carries rank 0's word that a timed resume checkpoint is due
(``checkpoint_every_s``, by rank 0's clock), so that every rank saves it at the same boundary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ray_lightning_sgd._worker_group.worker import preemption

if TYPE_CHECKING:
    import pytorch_lightning as pl


#: About how often the ranks of a fit exchange their SIGTERM notices (seconds).
_EXCHANGE_EVERY_S = 0.5
#: The most step boundaries between two exchanges.
_MAX_BOUNDARIES = 1000


class _Notices:
    """Every rank: which ranks received SIGTERM, exchanged at step boundaries by one all-reduce
    of a flag per rank, about every :data:`_EXCHANGE_EVERY_S` (so at most that, and a step,
    after a notice). Each exchange also agrees on the next: each rank proposes as many
    boundaries as its recent steps take that long, and the fewest proposed wins.

    Why not at every boundary: an all-reduce there cost a step of about 3.7 ms on two CPU
    workers 0.85 ms more, also when it ran beside the step (``benchmarks/bench.py --small``).
    """

    def __init__(self) -> None:
        self._boundaries = 0  # step boundaries this attempt has passed
        self._next = 1  # the boundary of the next exchange: the first one at once
        self._last: tuple[int, float] | None = None  # (boundary, time) of the last exchange

    def at_boundary(self, trainer: pl.Trainer, due: bool = False) -> tuple[list[int], bool]:
        """Called at each step boundary, on every rank alike: the ranks that received SIGTERM,
        and whether any rank said a checkpoint is ``due``, when this boundary exchanges them
        (else [] and False)."""
        self._boundaries += 1
        if self._boundaries < self._next:
            return [], False
        import torch
        import torch.distributed as dist

        mine = preemption.received.is_set()
        world, rank = trainer.world_size, trainer.global_rank
        if world == 1 or not (dist.is_available() and dist.is_initialized()):
            return ([rank] if mine else []), due
        proposal = 1
        if self._last is not None:
            boundary, at = self._last
            per_step = (time.monotonic() - at) / max(1, self._boundaries - boundary)
            proposal = max(1, min(_MAX_BOUNDARIES, int(_EXCHANGE_EVERY_S / max(per_step, 1e-6))))
        values = torch.zeros(world + 2, dtype=torch.int64, device=trainer.strategy.root_device)
        values[rank] = int(mine)
        values[world] = -proposal  # the maximum of the negatives: the fewest proposed
        values[world + 1] = int(due)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        flags = values.tolist()
        self._next = self._boundaries - flags[world]
        self._last = (self._boundaries, time.monotonic())
        return [r for r in range(world) if flags[r]], bool(flags[world + 1])
