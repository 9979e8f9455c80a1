"""The executor's lifecycle on a real worker group with the no-op base backend."""

from __future__ import annotations

import os

import pytest

from ray_lightning_sgd import BackendExecutor, WorkerGroupConfig, WorkerGroupError
from ray_lightning_sgd.backend import BackendConfig
from ray_lightning_sgd.executor import ExecutorState
from tests.conftest import leftovers


def _pid() -> int:
    return os.getpid()


def _fail() -> None:
    raise RuntimeError("worker says no")


def test_lifecycle_runs_and_always_shuts_down(free_cluster):
    executor = BackendExecutor(BackendConfig(), WorkerGroupConfig(num_workers=2))
    assert executor.state is ExecutorState.NEW
    with pytest.raises(WorkerGroupError, match="call start\\(\\) first"):
        executor.run(_pid)
    with pytest.raises(RuntimeError, match="worker says no"), executor:
        assert executor.state is ExecutorState.RUNNING
        assert len(set(executor.run(_pid))) == 2
        executor.run(_fail)
    assert executor.state is ExecutorState.SHUT_DOWN
    assert leftovers() == ([], [])
    executor.shutdown()  # a second shutdown is a no-op
    with pytest.raises(WorkerGroupError, match="cannot start an executor that is shut down"):
        executor.start()


def test_init_hook_runs_on_every_worker_and_its_failure_cleans_up(free_cluster):
    config = WorkerGroupConfig(num_workers=2, init_hook=_fail)
    with pytest.raises(RuntimeError, match="worker says no"):
        BackendExecutor(BackendConfig(), config).start()
    assert leftovers() == ([], [])
