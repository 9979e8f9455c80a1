"""The run controller against fake executors: no Ray, no Lightning."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest

from ray_lightning_sgd._executor.controller import Attempts, Resize, RunController, RunState
from ray_lightning_sgd.exceptions import RaySGDError, WorkerDiedError


class FakeExecutor:
    """Stands for a started executor: records how it was stopped."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.stopped: bool | None = None  # True: kept warm, False: killed
        self.stopped_by: BaseException | None = None  # the error that ended its attempt


#: A script's entry for a wait that ends with the workers still running.
RUNNING = object()


class Script:
    """Attempts that follow a script: each entry is what one wait for an attempt gives."""

    def __init__(
        self, *outcomes, resume_points=(), stop_error: BaseException | None = None
    ) -> None:
        self.outcomes = list(outcomes)
        self.resume_points = list(resume_points)
        self.stop_error = stop_error
        self.executors: list[FakeExecutor] = []
        self.resumed_from: list[object] = []
        self.waits: list[float | None] = []

    def start(self, resume) -> FakeExecutor:
        self.resumed_from.append(resume)
        executor = FakeExecutor(len(self.executors))
        self.executors.append(executor)
        return executor

    def wait(self, executor: FakeExecutor, wait_s: float | None):
        self.waits.append(wait_s)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return None if outcome is RUNNING else outcome

    def stop(
        self, executor: FakeExecutor, succeeded: bool, error: BaseException | None = None
    ) -> None:
        executor.stopped = succeeded
        executor.stopped_by = error
        if self.stop_error is not None:
            raise self.stop_error

    def resume_point(self):
        return self.resume_points.pop(0) if self.resume_points else None

    def controller(
        self, max_failures: int = 0, on_restart=None, max_preemptions: int = -1, scaling=None
    ) -> RunController:
        attempts = Attempts(self.start, self.wait, self.stop, self.resume_point)
        return RunController(
            attempts,
            max_failures=max_failures,
            on_restart=on_restart,
            max_preemptions=max_preemptions,
            scaling=scaling,
            decide_every_s=0.5,
        )


class Policy:
    """A scaling policy that follows a script: each entry is one answer to ``decide``."""

    def __init__(self, *decisions: Resize | None) -> None:
        self.decisions = list(decisions)
        self.asked = 0
        self.closed = 0

    def decide(self) -> Resize | None:
        self.asked += 1
        return self.decisions.pop(0) if self.decisions else None

    def close(self) -> None:
        self.closed += 1


def died(rank: int = 1, preempted: bool = False) -> WorkerDiedError:
    return WorkerDiedError(
        f"the worker of rank {rank} died", rank=rank, node_id="n", preempted=preempted
    )


def test_a_successful_attempt_keeps_its_workers():
    script = Script("result")
    controller = script.controller()
    assert controller.run() == "result"
    assert controller.state is RunState.SUCCEEDED
    assert [e.stopped for e in script.executors] == [True]


def test_a_lost_worker_restarts_and_the_next_attempt_resumes():
    restarts = []
    script = Script(died(), died(0), "done", resume_points=["epoch 1", "epoch 3"])
    controller = script.controller(max_failures=2, on_restart=lambda *a: restarts.append(a))
    assert controller.run() == "done"
    assert script.resumed_from == [None, "epoch 1", "epoch 3"]
    # a failed attempt's workers are killed, never kept; each attempt has new ones
    assert [e.stopped for e in script.executors] == [False, False, True]
    # each stop is told what ended the attempt (the launcher lets a rank 0 whose collective
    # broke with a lost worker end its trackers' runs)
    assert [type(e.stopped_by).__name__ for e in script.executors] == [
        "WorkerDiedError", "WorkerDiedError", "NoneType",
    ]  # fmt: skip
    assert [(failures, point) for _, failures, point in restarts] == [
        (1, "epoch 1"),
        (2, "epoch 3"),
    ]
    assert controller.failures == 2 and controller.state is RunState.SUCCEEDED


def test_the_run_gives_up_after_max_failures():
    last = died(0)
    script = Script(died(), last, "never reached")
    controller = script.controller(max_failures=1)
    with pytest.raises(WorkerDiedError) as raised:
        controller.run()
    assert raised.value is last
    assert controller.state is RunState.FAILED and len(script.executors) == 2


def test_no_limit_restarts_until_success():
    script = Script(*[died() for _ in range(5)], "done")
    assert script.controller(max_failures=-1).run() == "done"
    assert len(script.executors) == 6


def test_without_restarts_a_lost_worker_is_raised():
    script = Script(died(), "never reached")
    with pytest.raises(WorkerDiedError):
        script.controller(max_failures=0).run()
    assert len(script.executors) == 1


@pytest.mark.parametrize("error", [ValueError("in user code"), KeyboardInterrupt()])
def test_a_user_exception_or_an_interrupt_is_never_retried(error):
    script = Script(error, "never reached")
    controller = script.controller(max_failures=3)
    with pytest.raises(type(error)):
        controller.run()
    assert len(script.executors) == 1 and script.executors[0].stopped is False
    assert controller.state is RunState.FAILED


def test_a_cleanup_error_never_replaces_the_error_that_caused_it():
    original = ValueError("the real problem")
    script = Script(original, stop_error=RuntimeError("could not kill"))
    with pytest.raises(ValueError) as raised:
        script.controller().run()
    assert raised.value is original
    assert any("could not kill" in note for note in raised.value.__notes__)


def test_a_cleanup_error_after_success_keeps_the_result(caplog):
    script = Script("result", stop_error=RuntimeError("could not keep"))
    assert script.controller().run() == "result"
    assert "could not keep" in caplog.text


def test_a_failing_resume_point_fails_the_run():
    class Broken(Script):
        def resume_point(self):
            raise OSError("storage gone")

    script = Broken(died(), "never reached")
    controller = script.controller(max_failures=1)
    with pytest.raises(OSError, match="storage gone"):
        controller.run()
    assert controller.state is RunState.FAILED


def test_a_controller_runs_once():
    controller = Script("result").controller()
    controller.run()
    with pytest.raises(RaySGDError, match="runs once; this one is succeeded"):
        controller.run()


def test_a_failing_start_stops_nothing_and_is_not_retried_unless_a_worker_died():
    class NoStart(Script):
        def start(self, resume):
            raise OSError("cluster gone")

    script = NoStart("never reached")
    with pytest.raises(OSError):
        script.controller(max_failures=2).run()
    assert script.executors == []


def test_preemptions_restart_without_counting_against_max_failures():
    restarts = []
    script = Script(died(preempted=True), died(preempted=True), died(), "done")
    controller = script.controller(max_failures=1, on_restart=lambda *a: restarts.append(a))
    assert controller.run() == "done"
    assert (controller.preemptions, controller.failures) == (2, 1)
    # each restart is told its own count: preemptions 1 and 2, then failure 1
    assert [(err.preempted, count) for err, count, _ in restarts] == [
        (True, 1),
        (True, 2),
        (False, 1),
    ]


def test_a_resize_restarts_from_its_resume_point_without_counting_a_failure():
    restarts = []
    script = Script(RUNNING, died(), RUNNING, RUNNING, "done",
                    resume_points=["epoch 3", "epoch 4", "epoch 6"])  # fmt: skip
    policy = Policy(Resize("room for more"), None, Resize("again"))
    controller = script.controller(
        max_failures=1, on_restart=lambda *a: restarts.append(a), scaling=policy
    )
    assert controller.run() == "done"
    assert (controller.resizes, controller.failures, controller.preemptions) == (2, 1, 0)
    assert script.resumed_from == [None, "epoch 3", "epoch 4", "epoch 6"]
    # a resized attempt's workers are stopped, not kept: the next one starts other workers
    assert [e.stopped for e in script.executors] == [False, False, False, True]
    assert [e.stopped_by is None for e in script.executors] == [True, False, True, True]
    assert [(type(cause).__name__, count) for cause, count, _ in restarts] == [
        ("Resize", 1),
        ("WorkerDiedError", 1),
        ("Resize", 2),
    ]
    # asked between waits of its interval, never after the results are in; closed each attempt
    assert policy.asked == 3 and policy.closed == 4
    assert set(script.waits) == {0.5}


def test_without_a_scaling_policy_the_controller_waits_for_the_results_at_once():
    script = Script("result")
    assert script.controller().run() == "result"
    assert script.waits == [None]


def test_the_run_gives_up_after_max_preemptions():
    last = died(preempted=True)
    script = Script(died(preempted=True), last, "never reached")
    with pytest.raises(WorkerDiedError) as raised:
        script.controller(max_failures=5, max_preemptions=1).run()
    assert raised.value is last and raised.value.preempted


def test_a_preempted_worker_error_survives_pickling():
    import pickle

    again = pickle.loads(pickle.dumps(died(rank=3, preempted=True)))
    assert (again.rank, again.node_id, again.preempted) == (3, "n", True)


def test_a_scaling_policy_that_cannot_close_neither_hides_the_error_nor_keeps_the_workers(caplog):
    class Unclosable(Policy):
        def close(self) -> None:
            super().close()
            raise RuntimeError("the probe's reservation is gone")

    lost = died()
    script = Script(lost, "done", resume_points=["epoch 1"])
    controller = script.controller(max_failures=1, scaling=Unclosable())
    assert controller.run() == "done"  # the lost worker still restarts the run
    assert any("the probe's reservation is gone" in note for note in lost.__notes__)
    # each attempt's workers were stopped (the last one kept warm) before the policy closed
    assert [e.stopped for e in script.executors] == [False, True]
    assert "Could not close the scaling policy" in caplog.text


def test_an_attempt_that_fails_once_its_workers_started_gives_them_back(monkeypatch):
    """The launcher's start of an attempt: workers taken from the pool, then sending the call
    fails (a Ctrl-C during the payload's put, a lost connection): they go back, killed, and the
    error is raised; the controller never sees the attempt."""
    from ray_lightning_sgd._driver import launcher as launcher_module
    from ray_lightning_sgd._driver.run import Run
    from ray_lightning_sgd._serialization import Packed
    from ray_lightning_sgd.pytorch_lightning import RayLauncher, RaySGDStrategy

    released: list[tuple[object, bool]] = []

    class Executor:
        worker_group = SimpleNamespace(metadata=[])

        def run_async(self, *args, **kwargs):
            raise KeyboardInterrupt

    executor = Executor()
    monkeypatch.setattr(launcher_module, "pack_payload", lambda payload: Packed(b"packed", [], []))
    monkeypatch.setattr(launcher_module.ray, "put", lambda packed: "ref")
    monkeypatch.setattr(
        launcher_module.pool, "release", lambda e, keep, graceful: released.append((e, keep))
    )
    monkeypatch.setattr(launcher_module._scratch, "sweep", lambda wait_s=0.0: [])
    launcher = RayLauncher(RaySGDStrategy(num_workers=1))
    monkeypatch.setattr(launcher, "_start_executor", lambda streams: executor)
    payload = SimpleNamespace(call_id="call-0", trainer=None)
    with pytest.raises(KeyboardInterrupt):
        launcher._start_attempt(payload, Run(), None, None)  # type: ignore[arg-type]
    assert released == [(executor, False)], "workers of an attempt that never ran were kept"
    assert launcher._attempt is None


def test_an_interrupt_while_an_attempts_datasets_close_still_gives_its_workers_back(monkeypatch):
    """The launcher's stop of an attempt: a Ctrl-C while it ends the attempt's Ray Data splits
    still sends its workers back to the pool, killed."""
    from ray_lightning_sgd._driver import launcher as launcher_module
    from ray_lightning_sgd._driver.run import Run
    from ray_lightning_sgd.pytorch_lightning import RayLauncher, RaySGDStrategy

    released: list[tuple[object, bool]] = []
    monkeypatch.setattr(
        launcher_module.pool, "release", lambda e, keep, graceful: released.append((e, keep))
    )
    monkeypatch.setattr(launcher_module._scratch, "sweep", lambda wait_s=0.0: [])

    def close(splits) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher_module.datasets, "close", close)
    launcher = RayLauncher(RaySGDStrategy(num_workers=1))
    executor = object()
    attempt = launcher_module._Attempt(executor, None, "call-0", splits=["split"])  # type: ignore[arg-type, list-item]
    launcher._attempt = attempt
    with pytest.raises(KeyboardInterrupt):
        launcher._stop_attempt(attempt, succeeded=False, run=Run(), inbox=None)
    assert released == [(executor, False)], "the workers of a stopped attempt stayed leased"
    assert launcher._attempt is None and attempt.executor is None


def test_an_interrupt_while_rank_0_removes_the_storage_folder_keeps_no_worker_warm(monkeypatch):
    """A succeeded fit's own storage folder is removed by rank 0 (up to a minute): a Ctrl-C
    then leaves that rank 0 at it, so its workers are not handed on (before, kept warm)."""
    from ray_lightning_sgd._driver import launcher as launcher_module
    from ray_lightning_sgd._driver.run import Run
    from ray_lightning_sgd.pytorch_lightning import RayLauncher, RaySGDStrategy

    released: list[tuple[object, bool]] = []
    monkeypatch.setattr(
        launcher_module.pool, "release", lambda e, keep, graceful: released.append((e, keep))
    )
    monkeypatch.setattr(launcher_module._scratch, "sweep", lambda wait_s=0.0: [])
    removing: list[str] = []

    def interrupted(executor, uri) -> bool:
        removing.append(uri)
        raise KeyboardInterrupt

    launcher = RayLauncher(RaySGDStrategy(num_workers=1))
    for remove, kept in ((lambda executor, uri: True, True), (interrupted, False)):
        monkeypatch.setattr(launcher_module, "_remove_storage_folder", remove)
        executor = object()
        attempt = launcher_module._Attempt(executor, None, "call-0")  # type: ignore[arg-type]
        with contextlib.nullcontext() if kept else pytest.raises(KeyboardInterrupt):
            launcher._stop_attempt(
                attempt, succeeded=True, run=Run(), inbox=None, storage_to_remove="/s/run-1"
            )
        assert released[-1] == (executor, kept)
    assert removing == ["/s/run-1"]


@pytest.mark.parametrize("outcome", ["result", RaySGDError("the call failed")])
def test_an_interrupt_while_the_workers_stop_still_closes_the_scaling_policy(outcome):
    # what the policy holds (a probe's reservation) must go even when Ctrl-C lands in the stop
    script = Script(outcome, stop_error=KeyboardInterrupt())
    policy = Policy()
    with pytest.raises(KeyboardInterrupt):
        script.controller(scaling=policy).run()
    assert policy.closed == 1
    assert script.executors[0].stopped is (outcome == "result")


@pytest.mark.parametrize("starts", [True, False], ids=["started", "start-failed"])
def test_an_executor_is_listed_as_lent_before_the_pool_hands_it_over(monkeypatch, starts):
    """A Ctrl-C right after the pool found or started an executor, before its caller holds it,
    must leave it where the exit clean-up finds it; one whose start failed is not listed."""
    from ray_lightning_sgd._executor import pool as pool_module

    listed_at_start: list[bool] = []

    class Executor:
        def __init__(self, backend_config, worker_group_config) -> None:
            pass

        def start(self) -> None:
            listed_at_start.append(self in pool_module._leased)
            if not starts:
                raise KeyboardInterrupt

    monkeypatch.setattr(pool_module, "BackendExecutor", Executor)
    monkeypatch.setattr(pool_module, "_session", lambda: ("job", "node"))
    monkeypatch.setattr(pool_module, "_leased", [])
    monkeypatch.setattr(pool_module, "_idle", [])
    with contextlib.nullcontext() if starts else pytest.raises(KeyboardInterrupt):
        executor, warm = pool_module._find_or_start(None, None, reuse=True)  # type: ignore[arg-type]
        assert not warm and pool_module._leased == [executor]
    assert listed_at_start == [True]
    if not starts:
        assert pool_module._leased == []


def test_a_warm_executor_interrupted_as_it_is_lent_is_stopped_and_not_listed(monkeypatch):
    """A Ctrl-C right after a warm executor was listed as lent: the pool stops it (no caller
    holds it) and takes it off the list (the exit clean-up would stop it a second time)."""
    from ray_lightning_sgd._executor import pool as pool_module
    from ray_lightning_sgd._worker_group.config import WorkerGroupConfig

    stopped: list[bool] = []
    warm = SimpleNamespace(
        is_alive=lambda timeout_s: True,
        shutdown=lambda graceful: stopped.append(graceful),
        worker_group=SimpleNamespace(name="warm", config=SimpleNamespace(elastic=False)),
    )
    lease = pool_module._lease

    def lease_then_interrupt(executor) -> None:
        lease(executor)
        raise KeyboardInterrupt

    monkeypatch.setattr(pool_module, "_session", lambda: ("job", "node"))
    monkeypatch.setattr(pool_module, "_code_fits", lambda idle, wanted: True)
    monkeypatch.setattr(pool_module, "_lease", lease_then_interrupt)
    monkeypatch.setattr(pool_module, "_leased", [])
    monkeypatch.setattr(
        pool_module,
        "_idle",
        [pool_module._Idle(None, WorkerGroupConfig(), ("job", "node"), warm)],  # type: ignore[arg-type]
    )
    with pytest.raises(KeyboardInterrupt):
        pool_module._find_or_start(None, WorkerGroupConfig(), reuse=True)  # type: ignore[arg-type]
    assert pool_module._leased == [] and pool_module._idle == []
    assert stopped == [False]


def test_a_strategys_release_stops_its_idle_group_whatever_a_call_kept_free(monkeypatch):
    """An elastic call over Ray Data runs its group with a CPU kept free for Ray Data's tasks;
    strategy.shutdown_workers() (and leaving its with-block) must still find that group."""
    from ray_lightning_sgd._executor import pool as pool_module
    from ray_lightning_sgd._worker_group.config import WorkerGroupConfig

    stopped: list[str] = []

    def idle(name: str, config: WorkerGroupConfig) -> object:
        executor = SimpleNamespace(
            shutdown=lambda graceful: stopped.append(name),
            worker_group=SimpleNamespace(name=name),
        )
        return pool_module._Idle(None, config, ("job", "node"), executor)  # type: ignore[arg-type]

    settings = WorkerGroupConfig(num_workers=2, sizes=(2, 1))
    streamed = dataclasses.replace(settings, keep_free={"CPU": 1.0})
    other = WorkerGroupConfig(num_workers=3, sizes=(3, 1), keep_free={"CPU": 1.0})
    monkeypatch.setattr(pool_module, "_session", lambda: ("job", "node"))
    monkeypatch.setattr(pool_module.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(pool_module, "_idle", [idle("streamed", streamed), idle("other", other)])
    assert pool_module.shutdown(settings) == 1
    assert stopped == ["streamed"]
    assert [i.executor.worker_group.name for i in pool_module._idle] == ["other"]


class _WarmGroup:
    """A warm elastic group of ``size`` workers, its room to grow given."""

    def __init__(self, size: int, config: object, room: bool = False) -> None:
        self.size, self.config, self.room, self.name = size, config, room, f"warm-{size}"
        self.asked: list[object] = []

    def __len__(self) -> int:
        return self.size

    def has_room_to_grow(self, config=None) -> bool:
        self.asked.append(config)
        return self.room


@pytest.mark.parametrize(
    "kept_free_before", [True, False], ids=["data-then-loader", "loader-then-data"]
)
def test_warm_elastic_workers_serve_calls_with_and_without_ray_data_at_a_size_that_fits(
    monkeypatch, kept_free_before
):
    """An elastic fit over Ray Data, then a predict with a DataLoader (or the reverse), reuses
    the warm group when its size is one a new group would take; a group that would leave Ray
    Data's tasks less than a CPU is replaced (2 CPUs, 0.5 a worker: 3 workers leave 0.5)."""
    from ray_lightning_sgd._executor import pool as pool_module
    from ray_lightning_sgd._worker_group.config import WorkerGroupConfig

    plain = WorkerGroupConfig(num_workers=3, sizes=(3, 2, 1), resources_per_worker={"CPU": 0.5})
    streams = dataclasses.replace(plain, keep_free={"CPU": 1.0})
    before, wanted = (streams, plain) if kept_free_before else (plain, streams)
    monkeypatch.setattr(pool_module.ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(pool_module, "_session", lambda: ("job", "node"))
    for size, reused in ((2, True), (3, not wanted.keep_free)):
        group = _WarmGroup(size, before)
        stopped: list[bool] = []
        warm = SimpleNamespace(
            worker_group=group,
            is_alive=lambda timeout_s: True,
            shutdown=lambda graceful, stopped=stopped: stopped.append(graceful),
        )
        monkeypatch.setattr(pool_module, "_leased", [])
        monkeypatch.setattr(
            pool_module, "_idle", [pool_module._Idle(None, before, ("job", "node"), warm)]
        )  # type: ignore[arg-type]
        monkeypatch.setattr(
            pool_module, "BackendExecutor", lambda *args: SimpleNamespace(start=lambda: None)
        )
        executor, was_warm = pool_module._find_or_start(None, wanted, reuse=True)  # type: ignore[arg-type]
        assert was_warm is reused and (executor is warm) is reused, (size, reused)
        assert len(stopped) == (0 if reused else 1), "a group of the wrong size was kept"
        if reused:  # asked about room with the call's own settings
            assert group.asked == [wanted]
