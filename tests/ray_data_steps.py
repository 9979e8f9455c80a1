"""Steps of the tests' Ray Data pipelines, in a module of their own.

Ray Data's task workers import the module of each function they run: a test module would bring
torch and both Lightning namespaces into every task worker (5 CPU-seconds each here); this one
imports NumPy only.
"""

from __future__ import annotations

import numpy as np


def scaled(batch: dict) -> dict:
    """The pipeline's map_batches step: stacks and scales the features."""
    return {"x": np.stack(batch["x"]).astype(np.float32) * 0.5, "y": batch["y"], "id": batch["id"]}
