"""Functions the tests run in Ray's processes that need no Lightning, in a module of their own.

A Ray process imports the module of each function it runs: Ray Data's task workers for a
pipeline's step, and a bare worker group's actors for ``execute``. A test module would bring
torch and Lightning into each of them (5 CPU-seconds a process here); this one imports NumPy
only, and each function what it needs (a Ray Data task has no use for torch).
"""

from __future__ import annotations

import numpy as np


def scaled(batch: dict) -> dict:
    """A Ray Data pipeline's map_batches step: stacks and scales the features."""
    return {"x": np.stack(batch["x"]).astype(np.float32) * 0.5, "y": batch["y"], "id": batch["id"]}


def unchanged(batch: dict) -> dict:
    """A Ray Data pipeline's map_batches step that changes nothing: Ray Data then knows no row
    count without running the pipeline (a loader without a length)."""
    return batch


def where() -> tuple[str, int, int, int, int]:
    """On a worker: its node id, global rank, node rank, local rank and number of nodes."""
    from ray_lightning_sgd import get_worker_context

    context = get_worker_context()
    rank = context.rank
    return (
        context.metadata.node_id,
        rank.global_rank,
        rank.node_rank,
        rank.local_rank,
        rank.num_nodes,
    )
