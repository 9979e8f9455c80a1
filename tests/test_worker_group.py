"""The worker group on a real local Ray cluster (which declares fake GPUs)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch

from ray_lightning_sgd import (
    ConfigurationError,
    ResourcesUnavailableError,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerGroupConfig,
    WorkerGroupError,
    WorkerTimeoutError,
    get_worker_context,
)
from tests.conftest import leftovers


def _context():
    context = get_worker_context()
    return context.rank, context.device_index, os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()


def _env(name: str) -> str | None:
    return os.environ.get(name)


def _boom(rank_to_fail: int):
    if get_worker_context().rank.global_rank == rank_to_fail:
        raise KeyError("only on one rank")
    time.sleep(60)  # the other rank would wait here; the driver must not


class _BadBatch(Exception):
    """A user's exception as it is often written: its __init__ takes other arguments than the
    message it passes on, so it pickles but does not unpickle."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"batch {index}: {reason}")


def _bad_batch():
    raise _BadBatch(3, "empty")


def _exit_with(code):
    sys.exit(code)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 0}, "num_workers must be >= 1, got 0"),
        ({"num_workers": 2.0}, "num_workers must be an int"),
        ({"resources_per_worker": {"CPU": 0}}, "resources_per_worker['CPU'] must be a number > 0"),
        ({"resources_per_worker": {"CPU": -1}}, "got -1"),
        ({"resources_per_worker": {}}, "at least one resource"),
        ({"placement_strategy": "TIGHT"}, "placement_strategy must be one of"),
        ({"startup_timeout_s": 0}, "startup_timeout_s must be a number of seconds > 0"),
        (
            {"startup_timeout_s": float("inf")},
            "startup_timeout_s must be a number of seconds > 0 and at most 1e+09, got inf",
        ),
        ({"resources_per_worker": {"GPU": 1e-6}}, "(at least 0.0001)"),
        ({"worker_env": {"A": 1}}, "worker_env must map str to str"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigurationError) as info:
        WorkerGroupConfig(**kwargs)
    assert message in str(info.value)


def test_constructors_touch_no_ray_state():
    # a fresh process, since this one may already be connected to the test cluster
    code = (
        "import ray, pytorch_lightning as pl\n"
        "from ray_lightning_sgd import RaySGDStrategy, WorkerGroup, WorkerGroupConfig\n"
        "WorkerGroup(WorkerGroupConfig(num_workers=2))\n"
        "pl.Trainer(strategy=RaySGDStrategy(num_workers=2), logger=False)\n"
        "print('initialized', ray.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "initialized False" in out.stdout, out.stderr[-2000:]


def test_execute_runs_everywhere_in_rank_order_and_errors_name_their_rank(free_cluster):
    # Ray's errors for a lost object (its node left before the driver fetched it) name no actor;
    # the rank comes from the task that made the object
    from ray.exceptions import ObjectLostError, UnserializableException

    from ray_lightning_sgd._worker_group.errors import actor_of, translate

    group = WorkerGroup(WorkerGroupConfig(num_workers=2, worker_env={"MY_FLAG": "on"}))
    group.start()
    try:
        assert len(group) == 2
        results = group.execute(_context)
        assert [rank.global_rank for rank, *_ in results] == [0, 1]
        assert len({pid for *_, pid in results}) == 2
        assert group.execute_single(1, _context)[0].global_rank == 1
        assert group.execute(_env, "MY_FLAG") == ["on", "on"]
        # the suite's own setting (conftest): our deprecations are errors in the workers too
        assert (
            "error::DeprecationWarning:ray_lightning_sgd"
            in group.execute(_env, "PYTHONWARNINGS")[0]
        )
        assert ray.get(group.execute_single_async(0, sum, [1, 2])) == 3
        assert leftovers()[0], "the workers are named actors while they run"

        # a lost result names the rank that made it
        ref = group.execute_single_async(1, _env, "PATH")
        err = translate(ObjectLostError(ref.hex(), "", ""), group.metadata, actor_of(ref))
        assert isinstance(err, WorkerDiedError) and err.rank == 1
        assert "rank 1 " in str(err) and "was lost" in str(err)
        assert err.node_id == group.metadata[1].node_id
        plain = ray.put(1)
        assert (
            translate(ObjectLostError(plain.hex(), "", ""), group.metadata, actor_of(plain)).rank
            == -1
        )

        # an exception that cannot be unpickled on the driver is the call's error that names
        # it, not a lost worker (which a restart would retry)
        with pytest.raises(WorkerError, match=r"_BadBatch: batch 3: empty") as bad:
            group.execute_single(1, _bad_batch)
        assert "Raised on rank 1" in "\n".join(bad.value.__notes__)
        unpickled = translate(
            UnserializableException("Traceback ..."), group.metadata, group.metadata[1].actor_id
        )
        assert isinstance(unpickled, WorkerError) and "rank 1" in str(unpickled)
        # sys.exit() in user code would end the worker's process (a lost worker, retried as
        # often as max_failures allows, and every time alike): the call's error, the worker kept
        pids = [pid for *_, pid in group.execute(_context)]
        with pytest.raises(WorkerError, match=r"SystemExit\(3\): code on the worker called") as ex:
            group.execute_single(1, _exit_with, 3)
        assert "_exit_with" in "\n".join(ex.value.__notes__)
        assert [pid for *_, pid in group.execute(_context)] == pids

        # a failing rank reaches the driver at once (rank 0 still runs: last), with the
        # worker's traceback
        start = time.monotonic()
        with pytest.raises(KeyError, match="only on one rank") as info:
            group.execute(_boom, 1)
        assert time.monotonic() - start < 20
        note = "\n".join(info.value.__notes__)
        assert "Raised on rank 1" in note
        assert "_boom" in note, "the worker's traceback is attached"
    finally:
        group.shutdown()
    assert leftovers() == ([], [])
    with pytest.raises(WorkerGroupError, match="shut down"):
        group.execute(_context)


def test_an_interrupted_shutdown_still_frees_the_placement_group(free_cluster, monkeypatch):
    from ray_lightning_sgd._worker_group import group as group_module

    group = WorkerGroup(WorkerGroupConfig(num_workers=1))
    group.start()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # a second Ctrl-C while the shutdown waits for the killed actors

    with monkeypatch.context() as patch:
        patch.setattr(group_module.ray, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            group.shutdown()
    assert leftovers()[1] == [], "the placement group stayed reserved"
    group.shutdown()  # the next call returns at once: nothing was left for it
    deadline = time.monotonic() + 10
    while leftovers() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers() == ([], [])


def test_gpus_are_shared_per_node_and_picked_by_position(free_cluster):
    group = WorkerGroup(WorkerGroupConfig(num_workers=2, resources_per_worker={"CPU": 1, "GPU": 1}))
    group.start()
    try:
        results = group.execute(_context)
    finally:
        group.shutdown()
    assert [visible for _, _, visible, _ in results] == ["0,1", "0,1"]
    assert [index for _, index, _, _ in results] == [0, 1]


def test_fractional_gpus_share_a_device(free_cluster):
    group = WorkerGroup(
        WorkerGroupConfig(
            num_workers=2,
            resources_per_worker={"CPU": 1, "GPU": 0.5},
            placement_strategy="STRICT_PACK",
        )
    )
    group.start()
    try:
        results = group.execute(_context)
    finally:
        group.shutdown()
    visible = {v for _, _, v, _ in results}
    assert len(visible) == 1 and len(visible.pop().split(",")) == 1
    assert [index for _, index, _, _ in results] == [0, 0]


@pytest.mark.parametrize(
    ("resources", "strategy", "expected"),
    [
        ({"CPU": 64}, "PACK", "no node has 64 CPU; the largest node has 2"),
        ({"CPU": 1, "GPU": 8}, "PACK", "no node has 8 GPU"),
        ({"CPU": 1, "tpu_pod": 1}, "PACK", "no node has the resource 'tpu_pod'"),
        ({"CPU": 1}, "STRICT_SPREAD", "STRICT_SPREAD needs 2 nodes, and only 1"),
    ],
)
def test_impossible_requests_fail_fast_and_name_the_cluster(
    free_cluster, resources, strategy, expected
):
    group = WorkerGroup(
        WorkerGroupConfig(
            num_workers=2, resources_per_worker=resources, placement_strategy=strategy
        )
    )
    start = time.monotonic()
    with pytest.raises(ResourcesUnavailableError) as info:
        group.start()
    assert time.monotonic() - start < 5
    assert expected in str(info.value)
    assert "the cluster has {'CPU': 2.0, 'GPU': 2.0} in total" in str(info.value)


def test_busy_cluster_times_out_within_startup_timeout(free_cluster):
    hog = WorkerGroup(WorkerGroupConfig(num_workers=2))
    hog.start()
    try:
        group = WorkerGroup(WorkerGroupConfig(num_workers=1, startup_timeout_s=1.5))
        start = time.monotonic()
        with pytest.raises(ResourcesUnavailableError, match=r"within startup_timeout_s=1\.5s"):
            group.start()
        assert time.monotonic() - start < 5
    finally:
        hog.shutdown()


def test_a_group_placed_late_names_its_startup_timeout_and_the_placements_share(
    free_cluster, monkeypatch
):
    """The cluster took part of startup_timeout_s to place the group, and what was left ran out
    (an init_hook that outlasts any start here): the error names the setting and what placing
    took of it (before: "did not start the workers within 2.8s", or "run init_hook within
    startup_timeout_s within 1.1s")."""
    reserve = WorkerGroup._reserve

    def placed_late(self, deadline):
        time.sleep(1.2)
        return reserve(self, deadline)

    monkeypatch.setattr(WorkerGroup, "_reserve", placed_late)
    group = WorkerGroup(
        WorkerGroupConfig(
            num_workers=1, startup_timeout_s=4, init_hook=functools.partial(time.sleep, 30)
        )
    )
    with pytest.raises(
        WorkerTimeoutError,
        match=r"within startup_timeout_s=4s, of which the cluster took \d\.\ds to place them$",
    ):
        group.start()
    assert leftovers() == ([], [])


def _user_broken_pipe_then_exit():
    if get_worker_context().rank.global_rank == 0:
        raise RuntimeError("Broken pipe while writing my own file")  # user code, no collective
    time.sleep(4.0)
    os._exit(1)


def _raise_inside_torch():
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))  # no process group here: torch.distributed raises


def _exit_soon():
    time.sleep(0.5)
    os._exit(1)


def test_lost_peers_are_blamed_for_collective_errors_only(free_cluster):
    from ray_lightning_sgd._worker_group.errors import blame_a_lost_peer
    from ray_lightning_sgd._worker_group.worker import IN_COLLECTIVE

    group = WorkerGroup(WorkerGroupConfig(num_workers=2))
    group.start()
    try:
        # an error raised inside torch reaches the driver marked as such
        with pytest.raises((RuntimeError, ValueError)) as info:
            group.execute_single(0, _raise_inside_torch)
        assert getattr(info.value, IN_COLLECTIVE, False), "a torch error was not marked"
        # a user's RuntimeError that reads like a lost peer is raised as it is, at once, even
        # when another rank dies just after
        group.execute(_env, "PATH")  # the workers import this module first
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Broken pipe while writing") as info:
            group.execute(_user_broken_pipe_then_exit)
        assert not isinstance(info.value, WorkerDiedError)
        assert time.monotonic() - start < 3.0, "the driver waited for another rank's death"
        assert not getattr(info.value, IN_COLLECTIVE, False)
    finally:
        group.shutdown()

    group = WorkerGroup(WorkerGroupConfig(num_workers=2))
    group.start()
    try:
        # a collective's error of rank 0 becomes rank 1's death; rank 0's traceback stays
        survivor = RuntimeError("Connection closed by peer [127.0.0.1]:4515")
        survivor.add_note("Raised on rank 0 of 2. Worker traceback:\n  in all_reduce\n")
        pending = [group.execute_single_async(1, _exit_soon)]
        died, _ = blame_a_lost_peer(pending, group.metadata, survivor, None)
        assert isinstance(died, WorkerDiedError) and died.rank == 1
        notes = "\n".join(died.__notes__)
        assert "lost its peer" in notes
        assert "Worker traceback:" in notes and "in all_reduce" in notes
    finally:
        group.shutdown()


def test_the_preemption_watch_ends_with_each_call():
    """A call that left the watch set (its fit ended without the callback that clears it) does
    not leave it to the next call of a warm worker. The worker class runs in this process, made
    outside the main thread so that it installs no SIGTERM handler here."""
    from ray_lightning_sgd._worker_group.worker import _Worker, preemption

    made: list[_Worker] = []
    thread = threading.Thread(target=lambda: made.append(_Worker()))
    thread.start()
    thread.join()
    worker = made[0]

    def watch_and_fail() -> None:
        preemption.grace_s = 20.0
        raise RuntimeError("the fit ended abnormally")

    try:
        with pytest.raises(RuntimeError):
            worker.execute(watch_and_fail)
        assert preemption.grace_s == 0.0
        preemption.grace_s = 20.0  # as a call that ended before the wrapper's clean-up
        assert worker.execute(lambda: preemption.grace_s) == 0.0
    finally:
        preemption.grace_s = 0.0


def test_workers_import_with_the_collector_paused_and_restored(tmp_path, monkeypatch):
    """What a new worker imports (torch, Lightning) runs with the cyclic collector paused, which
    runs again afterwards as it did before: paused only if it was."""
    import gc

    from ray_lightning_sgd._worker_group.imports import import_modules

    module = tmp_path / "records_the_collector.py"
    module.write_text("import gc\nCOLLECTING = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gc.isenabled()
    import_modules(["records_the_collector"])
    assert sys.modules["records_the_collector"].COLLECTING is False
    assert gc.isenabled()
    gc.disable()
    try:
        del sys.modules["records_the_collector"]
        import_modules(["records_the_collector"])
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()
        sys.modules.pop("records_the_collector", None)
    with pytest.raises(ModuleNotFoundError):
        import_modules(["no_such_module_here"])
    assert gc.isenabled()  # also after a failed import
    # the package itself, which a new worker imports first (torch with it), does the same
    probe = (
        "import gc, builtins\n"
        "real = builtins.__import__\n"
        "seen = []\n"
        "def spy(name, *a, **k):\n"
        "    if name == 'torch' and not seen: seen.append(gc.isenabled())\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = spy\n"
        "import ray_lightning_sgd\n"
        "print(seen, gc.isenabled())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == ["[False]", "True"], done.stdout + done.stderr
