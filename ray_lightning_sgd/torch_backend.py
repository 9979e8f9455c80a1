"""The torch backend: a ``torch.distributed`` process group on every worker (gloo or NCCL).

Public names; the implementation lives in :mod:`ray_lightning_sgd._backend.torch`.
"""

from __future__ import annotations

from ray_lightning_sgd._backend.torch import BACKENDS, INIT_METHODS, TorchBackend, TorchConfig

__all__ = ["BACKENDS", "INIT_METHODS", "TorchBackend", "TorchConfig"]
