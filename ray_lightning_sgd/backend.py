"""The backend interface: what a worker group runs when it starts and before it stops.

Public names for people who build other backends; the implementation lives in
:mod:`ray_lightning_sgd._backend`.
"""

from __future__ import annotations

from ray_lightning_sgd._backend.base import Backend, BackendConfig

__all__ = ["Backend", "BackendConfig"]
