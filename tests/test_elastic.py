"""Elastic worker counts on the shared two-CPU cluster: arguments, sizing, the growth probe.

Losing and regaining a node mid-fit is in tests/test_node_loss.py (a cluster of its own).
"""

from __future__ import annotations

import time

import pytest
import pytorch_lightning as pl
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy, ResourcesUnavailableError
from ray_lightning_sgd._backend.base import BackendConfig
from ray_lightning_sgd._boundary.resume_points import ResumePoint
from ray_lightning_sgd._driver.run import Run, describe_sizes
from ray_lightning_sgd._driver.scaling import GrowthPolicy, PlacementGroupProbe
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata
from tests.conftest import leftovers
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": (2, 1)}, r"min > max; pass \(min, max\), e.g. \(1, 2\)"),
        ({"num_workers": (0, 2)}, r"a \(min, max\) pair of them .* got \(0, 2\)"),
        ({"num_workers": (1, 2, 3)}, r"got \(1, 2, 3\)"),
        ({"num_workers": (1.0, 2)}, r"got \(1.0, 2\)"),
        ({"num_workers": (3, 4), "keep_global_batch_size": True}, r"divide max=4.*to 2 or less"),
        ({"num_workers": (3, 5), "keep_global_batch_size": True}, r"divide max=5.*to 1 or less"),
        ({"num_workers": 2, "keep_global_batch_size": True}, r"applies to an elastic"),
        ({"keep_global_batch_size": 1}, "keep_global_batch_size must be True or False"),
        ({"resize_interval_s": 0}, "resize_interval_s must be a number of seconds > 0"),
    ],
)
def test_bad_elastic_arguments_are_refused_in_the_constructor(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        RaySGDStrategy(**kwargs)


def test_the_sizes_an_elastic_run_may_take():
    assert RaySGDStrategy(num_workers=(2, 4)).worker_group_config.sizes == (4, 3, 2)
    # keeping the global batch: only sizes that divide the most
    kept = RaySGDStrategy(num_workers=(1, 6), keep_global_batch_size=True)
    assert kept.worker_group_config.sizes == (6, 3, 2, 1)
    assert kept.num_workers == (1, 6)
    # a pair of equal counts, or a list (LightningCLI, YAML), is a fixed size or a pair
    assert RaySGDStrategy(num_workers=(3, 3)).num_workers == 3
    assert RaySGDStrategy(num_workers=[1, 2]).num_workers == (1, 2)  # type: ignore[arg-type]


def test_an_elastic_fit_takes_what_the_cluster_places_and_keeps_the_global_batch(ray_cluster):
    # (1, 4) keeping the global batch: sizes 4, 2 and 1; the two-CPU cluster places 2, each of
    # which accumulates 4 / 2 = 2 batches per optimizer step
    strategy = RaySGDStrategy(num_workers=(1, 4), keep_global_batch_size=True)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=2, enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(TinyModel(), loader())  # 12 batches: 6 per rank, 3 optimizer steps per epoch
    assert strategy.world_sizes == {0: 2, 1: 2}
    assert trainer.world_size == 2
    assert trainer.global_step == 2 * 3
    assert trainer.accumulate_grad_batches == 1  # the driver's own Trainer is left as it was


def test_an_elastic_run_waits_for_its_min_only_where_the_cluster_could_hold_it(ray_cluster):
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=(3, 4)), accelerator="cpu", max_epochs=1,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ResourcesUnavailableError, match=r"cannot place 3 workers .* fit only 2"):
        trainer.fit(TinyModel(), loader())
    assert time.monotonic() - started < 10


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeProbe:
    """A room probe whose reservations are placed once ``room`` is set, after ``answer_after``
    reads (a placement group's answer is asynchronous)."""

    def __init__(self, answer_after: int = 1) -> None:
        self.room = False
        self.answer_after = answer_after
        self.started: list[int] = []
        self.removed = 0
        self._reads = 0

    def can_grow(self) -> bool:
        return True

    def start(self, size: int) -> object:
        self.started.append(size)
        self._reads = 0
        return object()

    def placed(self, reservation: object) -> bool:
        self._reads += 1
        return self.room and self._reads >= self.answer_after

    def remove(self, reservation: object) -> None:
        self.removed += 1


def test_growth_waits_for_room_then_for_the_next_resume_checkpoint():
    ray_was_up = ray.is_initialized()  # a pure policy: it never starts a local Ray instance
    clock, probe = Clock(), FakeProbe(answer_after=2)
    latest: list[ResumePoint | None] = [ResumePoint(2, 20)]
    policy = GrowthPolicy(4, 30, max_epochs=10, latest=lambda: latest[0], probe=probe, clock=clock)
    policy.attempt_started(1)  # one worker, on a cluster with room for more
    assert policy.decide() is None and probe.started == [], "probed before resize_interval_s"
    clock.now += 31
    probe.room = True
    assert policy.decide() is None and probe.started == [1]  # a reservation, not yet placed
    assert policy.decide() is None, "the checkpoint held when room appeared is no boundary"
    assert probe.removed == 1, "the placed reservation was kept"
    for point in (ResumePoint(9, 90), ResumePoint(3, 27, batches=3)):
        # the last epoch's (nothing left to train), a preemption's inside an epoch (no boundary)
        latest[0] = point
        assert policy.decide() is None
    latest[0] = ResumePoint(3, 30)
    decision = policy.decide()
    assert decision is not None and "after epoch 3" in decision.reason
    # the resize found no more room (the next attempt has 1 worker again): look less often
    policy.attempt_started(1)
    assert policy._next_probe == clock.now + 60
    assert ray.is_initialized() == ray_was_up, "the growth policy started Ray"


def test_growth_gives_up_a_probe_the_cluster_does_not_place_and_never_grows_at_max():
    clock, probe = Clock(), FakeProbe()
    policy = GrowthPolicy(2, 1, max_epochs=None, latest=lambda: ResumePoint(5, 50), probe=probe,
                          clock=clock)  # fmt: skip
    policy.attempt_started(1)
    clock.now += 2
    assert policy.decide() is None and len(probe.started) == 1
    clock.now += 10  # the probe's wait is over: no room
    assert policy.decide() is None and probe.removed == 1
    assert policy.decide() is None, "no room: a checkpoint ends nothing"
    probes = len(probe.started)
    policy.attempt_started(2)  # the most workers: never probes again
    clock.now += 100
    assert policy.decide() is None and len(probe.started) == probes


def test_the_placement_group_probe_finds_no_room_where_the_larger_group_cannot_be_placed(
    free_cluster,
):
    # STRICT_SPREAD needs a node per worker: a one-node cluster never has room for 2; SPREAD
    # on the two-CPU cluster has room for the second worker, unless the group keeps a CPU free
    # (a call streaming Ray Data), which two workers of one CPU would not: then no reservation
    keep = {"CPU": 1.0}
    cases = (("STRICT_SPREAD", {}, False), ("SPREAD", {}, True), ("SPREAD", keep, None))
    for strategy, keep_free, room in cases:
        config = WorkerGroupConfig(
            num_workers=2, sizes=(2, 1), placement_strategy=strategy, keep_free=keep_free
        )
        probe = PlacementGroupProbe(lambda config=config: config)
        reservation = probe.start(1)
        if room is None:
            assert reservation is None
            continue
        deadline = time.monotonic() + 5
        while not probe.placed(reservation) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe.placed(reservation) is room, strategy
        probe.remove(reservation)
    assert leftovers() == ([], [])


def test_an_elastic_group_takes_only_sizes_that_leave_what_it_keeps_free():
    config = WorkerGroupConfig(
        num_workers=4, sizes=(4, 3, 2), resources_per_worker={"CPU": 0.5}, keep_free={"CPU": 1}
    )
    totals = {"CPU": 2.0}
    assert [n for n in config.sizes if config.leaves_free(n, totals)] == [2]
    assert [n for n in config.sizes if config.leaves_free(n, {"CPU": 2.5})] == [3, 2]
    # the smallest size is the group's only choice, whatever it leaves (check_room's to refuse)
    assert config.leaves_free(2, {"CPU": 0.0})
    keeps_nothing = WorkerGroupConfig(num_workers=4, sizes=(4, 3, 2))
    assert all(keeps_nothing.leaves_free(n, {"CPU": 2.0}) for n in keeps_nothing.sizes)


def test_a_probe_that_finds_no_size_leaving_room_reserves_nothing_and_is_asked_again_later():
    clock, probe = Clock(), NoRoomProbe()
    policy = GrowthPolicy(
        2, interval_s=30, max_epochs=None, latest=lambda: None, probe=probe, clock=clock
    )
    policy.attempt_started(1)
    clock.now += 30
    assert policy.decide() is None and probe.asked == 1
    assert policy.decide() is None and probe.asked == 1, "the next look waits an interval"
    clock.now += 30
    assert policy.decide() is None and probe.asked == 2
    policy.close()  # nothing reserved, nothing to remove


class NoRoomProbe:
    """A probe whose next size would take what the call keeps free: it reserves nothing."""

    def __init__(self) -> None:
        self.asked = 0

    def can_grow(self) -> bool:
        return True

    def start(self, size: int) -> None:
        self.asked += 1

    def placed(self, reservation: object) -> bool:
        raise AssertionError("no reservation to read")

    def remove(self, reservation: object) -> None:
        raise AssertionError("no reservation to remove")


def test_what_keep_global_batch_size_cannot_scale_is_refused_before_ray_starts():
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=(1, 2), keep_global_batch_size=True),
        accelerator="cpu", callbacks=[GradientAccumulationScheduler({0: 2})],
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="GradientAccumulationScheduler"):
        trainer.fit(TinyModel(), loader())
    manual = TinyModel()
    manual.automatic_optimization = False
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=(1, 2), keep_global_batch_size=True),
        accelerator="cpu", **quiet_trainer_kwargs(),
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="manual optimization"):
        trainer.fit(manual, loader())


def _workers(size: int) -> list[WorkerMetadata]:
    return [
        WorkerMetadata(node_id="n", node_ip="127.0.0.1", hostname="h", pid=rank)
        for rank in range(size)
    ]


def test_world_sizes_by_epoch_follow_the_attempt_that_trained_each_epoch():
    run = Run()
    for resume, size in ((None, 2), (ResumePoint(1, 12), 1), (ResumePoint(4, 36), 2)):
        run.resume = resume  # lost during epoch 3: epochs 2 and 3 retrained
        run.attempt_started(_workers(size))
    run.fit_ended(7)
    by_epoch = run.world_sizes
    assert by_epoch == {0: 2, 1: 2, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2}
    assert (
        describe_sizes(by_epoch)
        == "epochs 0-1: 2 workers; epochs 2-4: 1 worker; epochs 5-6: 2 workers"
    )
    # a preemption's point inside epoch 5: that epoch ends on the restart's size
    run.resume_point_arrived(ResumePoint(5, 44, batches=2))
    run.attempt_started(_workers(1))
    run.fit_ended(7)
    assert run.world_sizes == {**by_epoch, 5: 1, 6: 1}


def test_a_new_driver_reads_from_its_name_where_a_preemptions_checkpoint_resumes(tmp_path):
    """A preemption's checkpoint (inside epoch 2, after 3 batches) found by a new driver of a
    named run: epoch 2 trains again on the new size, and the log says "in epoch 2"; before,
    the name gave no batches, so epoch 2 was missing from world_sizes and the log said "after"."""
    from ray_lightning_sgd._boundary.resume_points import checkpoint_name, stored_points
    from ray_lightning_sgd._driver import runs

    folder = tmp_path / "digits"
    folder.mkdir()
    torch.save({"epoch": 1}, folder / checkpoint_name(1, 12))
    torch.save({"epoch": 2}, folder / checkpoint_name(2, 15, batches=3))
    point = runs.resume_named_run(str(folder), "digits", {"strategy": "RaySGDStrategy"})
    assert point is not None and (point.epoch, point.global_step, point.batches) == (2, 15, 3)
    assert point.describe() == "in epoch 2 after 3 batches (global step 15)"
    run = Run(point)
    run.attempt_started(_workers(2))
    run.fit_ended(4)
    assert run.world_sizes == {2: 2, 3: 2}
    # an epoch's end has no batches in its name, as before: older runs' files read alike; at
    # one epoch and step, an in-epoch point comes first (before: the listing's order)
    torch.save({"epoch": 2}, folder / checkpoint_name(2, 15))
    assert [p.batches for p in stored_points(str(folder))] == [None, 3, None]


def test_a_warm_elastic_group_is_reused_only_at_the_largest_size_the_cluster_places(free_cluster):
    config = WorkerGroupConfig(num_workers=2, sizes=(2, 1))

    def call() -> tuple[int, bool]:
        """The size of the group a call gets, and whether it was warm."""
        executor, warm = pool.acquire(BackendConfig(), config)
        pool.release(executor, keep=True)
        return len(executor.worker_group), warm

    taken = placement_group([{"CPU": 1}])  # one of the cluster's two CPUs
    ray.get(taken.ready())
    try:
        assert call() == (1, False)
        assert call() == (1, True), "the CPU is still taken: the warm group is the largest"
    finally:
        remove_placement_group(taken)
    # the CPU is free again: a call starts with as many workers as the cluster places now
    assert call() == (2, False)
    assert len(pool.idle_group_names()) == 1
