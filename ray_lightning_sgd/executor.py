"""The backend executor: a worker group and a backend joined into one lifecycle.

Public names for people who build other backends; the implementation lives in
:mod:`ray_lightning_sgd._executor`.
"""

from __future__ import annotations

from ray_lightning_sgd._executor.executor import BackendExecutor, ExecutorState

__all__ = ["BackendExecutor", "ExecutorState"]
