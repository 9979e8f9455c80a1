"""Warm workers: calls reuse a started worker group, and nothing leaks whichever way it ends."""

from __future__ import annotations

import gc

import pytest
import pytorch_lightning as pl
import ray
import torch

import ray_lightning_sgd
from ray_lightning_sgd import RaySGDStrategy
from ray_lightning_sgd._executor import pool
from tests.conftest import leftovers
from tests.helpers import PidModel, TinyModel, loader, quiet_trainer_kwargs


def _trainer(strategy: RaySGDStrategy, **kwargs) -> pl.Trainer:
    settings = {"max_epochs": 1, "enable_checkpointing": False, **quiet_trainer_kwargs()}
    return pl.Trainer(strategy=strategy, accelerator="cpu", **{**settings, **kwargs})


def _pid(trainer: pl.Trainer) -> int:
    return int(trainer.callback_metrics["pid"].item())


def _namespace() -> str:
    return ray.get_runtime_context().namespace


def test_fit_validate_test_predict_share_one_worker_group(ray_cluster):
    model = PidModel()
    trainer = _trainer(RaySGDStrategy(num_workers=2))
    trainer.fit(model, loader())
    groups = pool.idle_group_names()
    pids = [_pid(trainer)]
    assert len(groups) == 1, "the fit's workers stay up"
    trainer.validate(model, loader())
    pids.append(_pid(trainer))
    trainer.test(model, loader())
    pids.append(_pid(trainer))
    predictions = trainer.predict(model, loader())
    assert len(predictions) == 12
    assert pool.idle_group_names() == groups, "every call ran on the same group"
    assert len(set(pids)) == 1 and pids[0] != 0, pids


def test_a_new_trainer_with_equal_settings_reuses_the_workers(ray_cluster):
    first, second = _trainer(RaySGDStrategy(num_workers=2)), _trainer(RaySGDStrategy(num_workers=2))
    first.fit(PidModel(), loader())
    second.fit(PidModel(), loader())
    assert _pid(first) == _pid(second)
    assert len(pool.idle_group_names()) == 1


def test_other_settings_free_the_idle_workers_first(ray_cluster):
    # two workers of one CPU each fill the cluster: the second configuration only fits if the
    # first one's idle workers are stopped
    _trainer(RaySGDStrategy(num_workers=2)).fit(TinyModel(), loader())
    first = pool.idle_group_names()
    _trainer(RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.9, startup_timeout_s=10)).fit(
        TinyModel(), loader()
    )
    second = pool.idle_group_names()
    assert len(second) == 1 and second != first


def test_an_idle_worker_that_died_is_replaced(ray_cluster):
    trainer = _trainer(RaySGDStrategy(num_workers=2))
    trainer.fit(PidModel(), loader())
    before = _pid(trainer)
    (name,) = pool.idle_group_names()
    ray.kill(ray.get_actor(f"{name}-1", namespace=_namespace()), no_restart=True)
    trainer = _trainer(RaySGDStrategy(num_workers=2))
    trainer.fit(PidModel(), loader())
    assert _pid(trainer) != before
    assert pool.idle_group_names() != [name]


def test_a_failed_call_does_not_return_its_workers(ray_cluster):
    trainer = _trainer(RaySGDStrategy(num_workers=2))
    trainer.fit(PidModel(), loader())
    before = _pid(trainer)
    with pytest.raises(ValueError, match="injected failure"):
        _trainer(RaySGDStrategy(num_workers=2)).fit(TinyModel(fail_on_rank=0), loader())
    assert pool.idle_group_names() == [] and leftovers() == ([], [])
    trainer = _trainer(RaySGDStrategy(num_workers=2))
    trainer.fit(PidModel(), loader())
    assert _pid(trainer) != before, "new workers after the failure"


def test_an_interrupt_while_choosing_warm_workers_leaks_nothing(ray_cluster, monkeypatch):
    from ray_lightning_sgd.executor import BackendExecutor

    _trainer(RaySGDStrategy(num_workers=2)).fit(TinyModel(), loader())
    assert len(pool.idle_group_names()) == 1

    def interrupted(self, timeout_s):
        raise KeyboardInterrupt  # Ctrl-C while the idle group's health is checked

    monkeypatch.setattr(BackendExecutor, "is_alive", interrupted)
    strategy = RaySGDStrategy(num_workers=2)
    with pytest.raises(KeyboardInterrupt):
        # what the launcher calls first (Lightning turns the interrupt into its own exit)
        pool.acquire(strategy.backend_config, strategy.worker_group_config)
    assert pool.idle_group_names() == []
    assert leftovers() == ([], []), "the idle group taken out of the pool was left running"


def _objects_of_finished_calls() -> dict[str, int]:
    """Runs on each worker: the Trainers and models alive anywhere, frozen ones included."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()  # get_objects() leaves out the frozen generation
    try:
        names = [type(o).__name__ for o in gc.get_objects()]
    finally:
        if frozen:
            gc.freeze()
    return {name: names.count(name) for name in ("Trainer", "TinyModel")}


def test_idle_workers_keep_nothing_of_a_finished_call(ray_cluster):
    ray_lightning_sgd.shutdown_workers()  # new workers: the first call is their first (free here)
    for _ in range(2):  # the first call freezes what the imports built, none of its own objects
        _trainer(RaySGDStrategy(num_workers=2)).fit(TinyModel(), loader())
        [idle] = pool._idle
        left = idle.executor.run(_objects_of_finished_calls)
        assert left == [{"Trainer": 0, "TinyModel": 0}] * 2, left


class _PoolWatcher(pl.Callback):
    """A driver callback: notes what the pool holds while the workers train."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[str], list[str]]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen.append((pool.leased_group_names(), pool.idle_group_names()))


def test_the_pool_holds_the_workers_while_they_run_and_after(ray_cluster):
    watcher = _PoolWatcher()
    _trainer(RaySGDStrategy(num_workers=2, driver_callbacks=[watcher])).fit(TinyModel(), loader())
    [(leased, idle)] = watcher.seen
    assert len(leased) == 1 and idle == [], "a running call's workers are lent, not idle"
    assert pool.leased_group_names() == [] and pool.idle_group_names() == leased
    with pytest.raises(ValueError, match="injected failure"):
        _trainer(RaySGDStrategy(num_workers=2)).fit(TinyModel(fail_on_rank=0), loader())
    assert pool.leased_group_names() == [] and pool.idle_group_names() == []


def test_warm_workers_train_exactly_as_new_ones(ray_cluster):
    def fit(reuse: bool) -> dict[str, torch.Tensor]:
        pl.seed_everything(3)
        model = TinyModel()
        _trainer(RaySGDStrategy(num_workers=2, reuse_workers=reuse), max_epochs=2).fit(
            model, loader(shuffle=True)
        )
        return model.state_dict()

    cold = fit(reuse=False)
    assert leftovers() == ([], []), "reuse_workers=False stops the workers after the call"
    warm_first, warm_second = fit(reuse=True), fit(reuse=True)
    for key in cold:
        torch.testing.assert_close(warm_first[key], cold[key], atol=1e-6, rtol=0)
        torch.testing.assert_close(warm_second[key], cold[key], atol=1e-6, rtol=0)


def test_ways_to_release_the_workers(ray_cluster):
    with RaySGDStrategy(num_workers=2) as strategy:
        _trainer(strategy).fit(TinyModel(), loader())
        assert len(pool.idle_group_names()) == 1
    assert leftovers() == ([], []), "leaving the with-block stops the workers"

    strategy = RaySGDStrategy(num_workers=2)
    _trainer(strategy).fit(TinyModel(), loader())
    RaySGDStrategy(num_workers=1).shutdown_workers()
    assert len(pool.idle_group_names()) == 1, "another configuration's release leaves them"
    strategy.shutdown_workers()
    assert leftovers() == ([], [])

    _trainer(RaySGDStrategy(num_workers=2)).fit(TinyModel(), loader())
    assert ray_lightning_sgd.shutdown_workers() == 1
    assert leftovers() == ([], [])
