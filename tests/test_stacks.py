"""Reading a thread's stack from another thread, what the driver makes of every rank's, and the
straggler among the ranks' step times: pure logic on real threads and numbers, no cluster
(tests/test_hangs.py has the real hangs and the slowed rank)."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import ray

from ray_lightning_sgd._boundary.channels import PROGRESS, TIMED_STEPS
from ray_lightning_sgd._driver.inbox import RunInbox
from ray_lightning_sgd._driver.run import Run
from ray_lightning_sgd._driver.stacks import CALL_ENDED, RankStack, report
from ray_lightning_sgd._driver.stragglers import StragglerWatch
from ray_lightning_sgd._worker_group.outbox import Mail
from ray_lightning_sgd._worker_group.stacks import ThreadStack, stack_of
from ray_lightning_sgd.exceptions import WorkerGroupError


def _in_a_thread(target):
    """Starts ``target(ready, release)`` in a thread; returns the thread once it is ready."""
    ready, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=target, args=(ready, release), daemon=True)
    thread.start()
    assert ready.wait(10)
    return thread, release


def users_own_wait(ready, release):
    ready.set()
    release.wait(30)


def test_another_threads_stack_names_the_users_function_and_no_hook_or_collective():
    thread, release = _in_a_thread(users_own_wait)
    try:
        stack = stack_of(thread.ident)
    finally:
        release.set()
    assert stack is not None
    assert "users_own_wait" in stack.text and "release.wait(30)" in stack.text
    assert stack.user_frame is not None and stack.user_frame.endswith("in users_own_wait")
    assert stack.hook is None and stack.collective is None
    assert stack_of(-1) is None  # no such thread


# Lightning calls every hook through functions of its trainer/call.py that take the hook's name;
# one compiled under that file name stands for it
_CALLS = {}
exec(
    compile(
        "def _call_lightning_module_hook(trainer, hook_name, fn, *args):\n    return fn(*args)\n",
        os.path.join("site-packages", "pytorch_lightning", "trainer", "call.py"),
        "exec",
    ),
    _CALLS,
)


def test_the_hook_is_the_one_lightning_called_last():
    def target(ready, release):
        _CALLS["_call_lightning_module_hook"](None, "training_step", users_own_wait, ready, release)

    thread, release = _in_a_thread(target)
    try:
        stack = stack_of(thread.ident)
    finally:
        release.set()
    assert stack is not None and stack.hook == "training_step"


def _torchs(path: tuple[str, ...], name: str):
    """A function ``name`` of torch's file ``path`` that waits (as DDP's broadcast of buffers
    or a functional collective's wait do, in C++, for the other ranks)."""
    code = f"def {name}(ready, release):\n    ready.set()\n    release.wait(30)\n"
    space: dict = {}
    exec(compile(code, os.path.join("site-packages", "torch", *path), "exec"), space)
    return space[name]


@pytest.mark.parametrize(
    ("path", "name", "collective"),
    [
        (("nn", "parallel", "distributed.py"), "_distributed_broadcast_coalesced", "DDP's"),
        (("distributed", "_functional_collectives.py"), "wait_tensor", "functional"),
        (("distributed", "fsdp", "_fully_shard", "_fsdp_param_group.py"), "wait_for_unshard",
         "FSDP2's"),
        # torch's own work that waits on no other rank: not a collective
        (("distributed", "checkpoint", "filesystem.py"), "write_data", None),
        (("distributed", "tensor", "_dispatch.py"), "dispatch", None),
        (("nn", "parallel", "distributed.py"), "forward", None),
    ],
)  # fmt: skip
def test_a_rank_waiting_in_torchs_collectives_outside_c10d_is_in_a_collective(
    path, name, collective
):
    thread, release = _in_a_thread(_torchs(path, name))
    try:
        stack = stack_of(thread.ident)
    finally:
        release.set()
    assert stack is not None
    if collective is None:
        assert stack.collective is None, stack.collective
    else:
        assert stack.collective is not None and collective in stack.collective


def test_the_report_says_which_ranks_wait_in_a_collective_and_which_do_not():
    waiting = ThreadStack("  File ...\n", "training_step", "all_gather", "model.py:3 in step")
    elsewhere = ThreadStack("  File ...\n", "on_train_batch_end", None, "loader.py:9 in fetch")
    stacks = [
        RankStack(0, "rank 0 of 3 (node a)", ("training", 41), waiting),
        RankStack(1, "rank 1 of 3 (node b)", ("training", 40), elsewhere),
        RankStack(2, "rank 2 of 3 (node c)", None, None, "no answer within 10 s"),
    ]
    text = report(stacks, "No rank has made progress.")
    assert "ranks waiting in a collective: 0" in text
    assert "ranks in no collective: 1 (the others wait for these" in text
    assert "ranks that gave no stack: 2" in text
    assert "rank 0 of 3 (node a); last progress: training 41; in hook training_step; " in text
    assert "waiting in all_gather; your code: model.py:3 in step" in text
    assert "(no stack: no answer within 10 s)" in text
    # a rank that returned from its call while rank 0 waits in a collective it never called
    ended = [stacks[0], RankStack(1, "rank 1 of 2 (node b)", ("training", 40), None, CALL_ENDED)]
    text = report(ended, "No rank has made progress.")
    assert "ranks whose call has ended: 1 (the others may wait for these" in text
    assert "gave no stack" not in text
    # one whose call has not reached its worker yet: no "ended" for it
    from ray_lightning_sgd._driver.inbox import _no_call

    starting = [stacks[0], RankStack(1, "rank 1 of 2", None, None, _no_call(ended=False))]
    text = report(starting, "No rank has made progress.")
    assert "ranks that gave no stack: 1" in text and "ended" not in text
    assert "no call runs there yet" in text


def _watch(*ranks: tuple[int, float, float]) -> StragglerWatch:
    watch = StragglerWatch()
    for rank, data_s, step_s in ranks:
        watch.update(rank, f"rank {rank} (node n{rank})", steps, data_s, step_s)
    return watch


steps = TIMED_STEPS


def test_a_rank_slower_than_the_others_is_named_once_with_where_its_time_goes():
    watch = _watch((0, 0.001, 0.010), (1, 0.001, 0.060), (2, 0.001, 0.011))
    warning = watch.straggler()
    assert warning is not None and warning.startswith("rank 1 (node n1) is slower")
    assert "goes to the step itself" in warning
    assert watch.straggler() is None  # once
    loader = _watch((0, 0.030, 0.010), (1, 0.001, 0.010))
    assert "goes to data loading" in str(loader.straggler())


def test_balanced_ranks_tiny_differences_and_too_few_steps_give_no_warning():
    assert _watch((0, 0.001, 0.010), (1, 0.001, 0.012), (2, 0.002, 0.009)).straggler() is None
    assert _watch((0, 0.0001, 0.001), (1, 0.0001, 0.003)).straggler() is None  # 2 ms: noise
    early = StragglerWatch()
    early.update(0, "rank 0", TIMED_STEPS - 1, 0.001, 0.010)
    early.update(1, "rank 1", TIMED_STEPS - 1, 0.001, 0.100)
    assert early.straggler() is None  # not every rank timed its window yet
    assert [t.rank for t in _watch((1, 0, 0), (0, 0, 0)).summary()] == [0, 1]


def test_a_poll_answer_without_new_progress_leaves_the_ranks_progress_where_it_was():
    """Every answer carries the age of the rank's latest progress report; taken late (the driver
    was busy), that age would move the rank's progress later than it was."""
    inbox = RunInbox(None, None, Run())
    inbox._progress_at, inbox._last_at = {0: 100.0}, {0: ("training", 3)}
    inbox._deliver(0, Mail("", {}, {}, {PROGRESS: 0.5}, {}), run_calls=False)
    assert inbox._progress_at[0] == 100.0
    new = Mail("", {}, {PROGRESS: ("training", 4)}, {PROGRESS: 0.5}, {PROGRESS: 2})
    inbox._deliver(0, new, run_calls=False)
    assert inbox._progress_at[0] > 100.0 and inbox._last_at[0] == ("training", 4)


class _EndedGroup(list):
    """A worker group that the main thread shut down: it refuses every call."""

    def stack_async(self, rank: int):
        raise WorkerGroupError("cannot stack on a worker group that is shut down")

    def news_async(self, rank: int, call_id: str, items_after_s: float):
        from concurrent.futures import Future

        return type("Ref", (), {"future": lambda self: Future()})()  # never answered


def test_stacks_asked_from_another_thread_as_the_attempt_ends_are_none():
    # strategy.worker_stacks() promises [] when no attempt runs, from any thread
    inbox = RunInbox(None, None, Run())
    inbox.attach(_EndedGroup([0]), "call")  # type: ignore[arg-type]
    assert inbox.stacks(0.1) == []


def test_sigusr1_handled_outside_python_is_left_alone(monkeypatch):
    import signal

    from ray_lightning_sgd._driver import signals

    before = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(signal, "getsignal", lambda number: None)  # a handler set in C
    called = []
    with signals.sigusr1_calls(lambda: called.append(1)):
        pass
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGUSR1) is before and called == []


def test_a_handler_installed_in_c_still_runs_after_a_launch():
    """faulthandler.register's handler (C) reads as SIG_DFL from Python; replaced by ours and
    then by SIG_DFL, the user's next SIGUSR1 (or SIGTERM) would have ended the process."""
    script = (
        "import faulthandler, os, signal, time\n"
        "from ray_lightning_sgd._driver import signals\n"
        "for number in (signal.SIGUSR1, signal.SIGTERM):\n"
        "    faulthandler.register(number)\n"
        "with signals.sigusr1_calls(lambda: print('ours')):\n"
        "    with signals.sigterm_raises(SystemExit):\n"
        "        pass\n"
        "for number in (signal.SIGUSR1, signal.SIGTERM):\n"
        "    os.kill(os.getpid(), number)\n"
        "time.sleep(0.2)\n"
        "print('alive')\n"
    )
    done = _run_script(script)
    assert done.stdout.strip() == "alive" and done.stderr.count("most recent call first") == 2


def _run_script(script: str):
    """Runs ``script`` in a Python process of its own (its signals are its own); asserts that
    it ended well and returns what it printed."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_a_second_sigterm_does_not_cut_the_clean_up_the_first_started():
    """The first SIGTERM raises (the launch stops its workers on the way out); a second one
    during that clean-up is noted, not the default action that ends the process halfway; the
    handler before the launch is back after it."""
    script = (
        "import os, signal, time\n"
        "from ray_lightning_sgd._driver import signals\n"
        "try:\n"
        "    with signals.sigterm_raises(SystemExit):\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "            time.sleep(5)\n"
        "        finally:\n"
        "            os.kill(os.getpid(), signal.SIGTERM)  # during the clean-up\n"
        "            time.sleep(0.2)\n"
        "            print('cleaned up', flush=True)\n"
        "except SystemExit as ended:\n"
        "    print('exit', ended.code, flush=True)\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n"
    )
    assert _run_script(script).stdout.split() == ["cleaned", "up", "exit", "143", "True"]


def _scheduled_inbox(monkeypatch, workers: int) -> tuple[RunInbox, list[int], list[float]]:
    """A RunInbox over ``workers`` ranks on a fake clock, whose polls are answered at once; the
    ranks it puts the news question to are in ``inbox.news_asked``."""
    clock, asked = [1000.0], []
    inbox = RunInbox(None, None, Run())
    inbox.news_asked = []  # type: ignore[attr-defined]
    monkeypatch.setattr(inbox, "_wall", lambda: clock[0])
    monkeypatch.setattr(inbox, "_ask", lambda rank: asked.append(rank) or f"poll {rank}")
    monkeypatch.setattr(inbox, "_ask_news", inbox.news_asked.append)  # type: ignore[attr-defined]
    monkeypatch.setattr(inbox, "_take_answers", lambda timeout_s, run_calls: inbox._asked.clear())
    monkeypatch.setattr(inbox, "_check", lambda now: None)
    inbox.attach(list(range(workers)), "call")  # type: ignore[arg-type]  (only its length)
    return inbox, asked, clock


def _checking_inbox(monkeypatch, workers: int) -> tuple[RunInbox, list[int]]:
    """A :func:`_scheduled_inbox` whose check is the real one, with progress_timeout_s=30; the
    ranks it asks are in the list it returns with it."""
    inbox, asked, clock = _scheduled_inbox(monkeypatch, workers)
    monkeypatch.undo()  # the real check, the fake clock's polls
    monkeypatch.setattr(inbox, "_wall", lambda: clock[0])
    monkeypatch.setattr(inbox, "_ask", lambda rank: asked.append(rank) or f"poll {rank}")
    monkeypatch.setattr(inbox, "stacks", lambda: [])
    inbox.progress_timeout_s = 30.0
    inbox._run.metadata = []
    inbox.test_clock = clock  # type: ignore[attr-defined]
    return inbox, asked


def _pump_for(inbox: RunInbox, clock: list[float], seconds: float) -> None:
    for _ in range(round(seconds / 0.1)):
        inbox.pump()
        clock[0] += 0.1


def test_the_polls_of_the_other_ranks_are_bounded_and_each_rank_has_the_news_question(
    monkeypatch,
):
    rates = {}
    for workers in (3, 11, 21, 101, 1001):
        inbox, asked, clock = _scheduled_inbox(monkeypatch, workers)
        _pump_for(inbox, clock, 20.0)
        rates[workers] = sum(1 for rank in asked if rank > 0) / 20.0
        # rank 0 every 0.5 s: nothing on the driver shows its events live
        assert 38 <= asked.count(0) <= 42, asked.count(0)
        # each rank holds the standing question once (rank 0's brings its resume points at
        # once), and the others are polled in their turn
        assert inbox.news_asked == list(range(workers)), workers  # type: ignore[attr-defined]
        if workers <= 101:  # every 10 s at most
            assert min(asked.count(rank) for rank in range(workers)) >= 2, workers
    assert 3.5 <= rates[3] <= 4.5  # 2 ranks every 0.5 s
    # from 10 other ranks on: 10 polls a second together, however many
    assert all(9 <= rates[n] <= 11 for n in (11, 21, 101, 1001)), rates


def test_a_rank_with_news_is_asked_at_once_and_a_sigterm_notice_is_acknowledged_at_once(
    monkeypatch,
):
    from ray_lightning_sgd._boundary.channels import SIGTERM_NOTICE

    inbox, asked, clock = _scheduled_inbox(monkeypatch, 1001)
    _pump_for(inbox, clock, 0.3)
    assert 57 not in asked and 900 not in asked  # not due for a minute and more
    asked.clear()
    inbox.news_asked.clear()  # type: ignore[attr-defined]
    monkeypatch.setattr(inbox, "_take_answers", lambda timeout_s, run_calls: None)
    attempt = inbox._attempt
    # what Ray's thread appends when a news question is answered: 57 and 900 of this attempt,
    # 58 of an earlier one
    inbox._news_came.extend([(attempt, 57, False), (attempt - 1, 58, False), (attempt, 900, False)])
    inbox.pump()
    assert asked[:2] == [57, 900] and 58 not in asked
    assert inbox.news_asked == []  # type: ignore[attr-defined]  (not before their answers)
    del inbox._asked[57]  # 57's answer came: its notice
    inbox._deliver(57, Mail("call", {}, {SIGTERM_NOTICE: 4321}, {}, {SIGTERM_NOTICE: 7}), False)
    # asked again at once: that poll tells the worker the driver holds its notice
    assert asked.count(57) == 2 and inbox._acknowledged[57][SIGTERM_NOTICE] == 7
    inbox._asked.pop(57)  # that answer came too: 57 gets the news question again
    inbox.pump()
    assert inbox.news_asked == [57]  # type: ignore[attr-defined]  (900's poll is on its way)


def test_a_rank_that_only_looks_silent_is_asked_before_the_timeout_fails_the_call(monkeypatch):
    from ray_lightning_sgd.exceptions import WorkerTimeoutError

    inbox, asked = _checking_inbox(monkeypatch, 1001)
    now = inbox._now()
    inbox._progress_at = {0: now, 900: now - 40.0}  # 900's last progress was 40 s ago...
    inbox._answered_at = {0: now, 900: now - 35.0}  # ...as an answer 35 s ago said
    asked.clear()
    inbox._check(now)  # no answer showed 900 silent past 30 s: asked now, no failure
    assert asked == [900]
    inbox._asked.pop(900)
    inbox._deliver(900, Mail("call", {}, {}, {PROGRESS: 41.0}, {}), run_calls=False)
    # the fresh answer shows it: the call fails; 900 never reported progress, and says so
    with pytest.raises(WorkerTimeoutError, match=r"rank 900.*, no progress reported since its"):
        inbox._check(inbox._now())
    # a poll that gets no answer within 5 s counts as silence too
    inbox._progress_at, inbox._answered_at = {0: now, 7: now - 40.0}, {0: now}
    inbox._asked = {7: "poll 7"}
    inbox._asked_at = {7: now - 4.0}
    inbox._check(now)  # 4 s: not yet
    inbox._asked_at = {7: now - 6.0}
    inbox._last_at[7] = ("training", 12)  # where its last report left it
    with pytest.raises(WorkerTimeoutError, match=r"rank 7.*, last at training step 12"):
        inbox._check(now)
    # and so does a poll that failed (a worker that cannot be reached)
    inbox._progress_at, inbox._answered_at = {0: now, 8: now - 40.0}, {0: now}
    inbox._asked, inbox._asked_at = {8: "poll 8"}, {8: now - 0.1}

    def unreachable(ref):
        raise ray.exceptions.RayError("unreachable")

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", unreachable)
    inbox._take_answers(timeout_s=0.0, run_calls=False)
    inbox._check(inbox._now())  # one failed poll (a worker briefly unavailable): asked again
    assert 8 in inbox._asked
    inbox._failing_since[8] -= 6.0  # its polls failed for 6 s
    with pytest.raises(WorkerTimeoutError, match="rank 8"):
        inbox._check(inbox._now())


def test_the_drivers_busy_time_within_a_ranks_reported_age_is_no_silence(monkeypatch):
    """A driver callback (or a sent function) blocks the driver for 40 s; rank 1 meanwhile
    waits for it (rank 0 waits for the driver to take its resume checkpoint). Its next answer
    says its last progress is 40.5 s old: 0.5 s of it silence, the rest the driver's. A rank
    that really went silent before the driver's busy spell is still caught in time."""
    from ray_lightning_sgd.exceptions import WorkerTimeoutError

    inbox, _asked = _checking_inbox(monkeypatch, 3)
    clock = inbox.test_clock  # type: ignore[attr-defined]
    progress = ("training", 3, 0.05)

    def answer(rank: int, age: float) -> None:
        inbox._asked.pop(rank, None)
        mail = Mail("call", {}, {PROGRESS: progress}, {PROGRESS: age}, {})
        inbox._deliver(rank, mail, run_calls=False)

    def pump(*answers: tuple[int, float], blocked_s: float = 0.0) -> None:
        """One pump: the answers taken as it starts; rank 0's mail first, whose replay blocks
        the driver for ``blocked_s``, then the others'."""

        def take(timeout_s: float, run_calls: bool) -> None:
            answer(0, 0.0)
            clock[0] += blocked_s
            for rank, age in answers:
                answer(rank, age)

        monkeypatch.setattr(inbox, "_take_answers", take)
        inbox.pump()

    pump((1, 0.0), (2, 0.0))  # at 1000
    pump(blocked_s=40.0)  # the callback: the driver is busy until 1040
    clock[0] += 0.5
    pump((1, 40.5), (2, 40.5))  # both waited for the driver: 0.5 s of silence each
    assert inbox._now() - inbox._progress_at[1] == pytest.approx(0.5)
    assert inbox._now() - inbox._progress_at[2] == pytest.approx(0.5)
    # rank 2 hangs now; 25 s later its answer comes in a pump whose callback blocks 25 s
    clock[0] += 25.0
    pump((1, 0.0), (2, 25.0), blocked_s=25.0)
    assert inbox._now() - inbox._progress_at[2] == pytest.approx(25.0)  # not hidden by it
    clock[0] += 10.0  # 35 s of silence outside the driver's busy spells: past the timeout
    with pytest.raises(WorkerTimeoutError, match="rank 2"):
        pump((1, 0.0), (2, 60.0))


def test_sigusr1_reports_at_once_while_the_driver_is_blocked_in_a_driver_callback(
    monkeypatch, capsys
):
    """The report comes from a thread of its own, with the driver's own stack: no pump runs
    while a driver callback blocks the main thread."""
    from ray_lightning_sgd._driver import launcher

    inbox = RunInbox(None, None, Run())
    monkeypatch.setattr(inbox, "stacks", lambda: [])
    printed = threading.Event()
    real_print = inbox.print_stacks

    def print_then_tell() -> None:
        real_print()
        printed.set()

    monkeypatch.setattr(inbox, "print_stacks", print_then_tell)

    def a_blocking_driver_callback() -> None:
        inbox._pump_started = inbox._wall() - 3.0  # the pump that called it, 3 s ago
        launcher._want_stacks(inbox)  # what the SIGUSR1 handler does
        assert printed.wait(10), "no report while the main thread is blocked"

    a_blocking_driver_callback()
    err = capsys.readouterr().err
    assert "Every rank's stack (SIGUSR1):" in err
    assert "The driver itself has been busy for 3 s" in err
    assert "in a_blocking_driver_callback" in err
    inbox._group = None  # between attempts (or while the workers start): said so
    inbox._pump_started = None
    real_print()
    assert "no attempt runs now" in capsys.readouterr().err


def test_the_automatic_hang_window_follows_the_steps_not_how_seldom_a_rank_is_asked():
    """In a group of 1001 a rank but rank 0 is asked every 100 s: the waits it reports are its
    steps' (50 ms), and the window stays at its floor, not 20 x 100 s (past the process group's
    30-minute timeout, when the report would never come)."""
    from ray_lightning_sgd._driver.inbox import HANG_REPORT_FLOOR_S

    inbox = RunInbox(None, None, Run())
    inbox._progress_at, inbox._last_at = {900: 0.0}, {900: ("start", 0)}
    for poll in range(1, 6):
        inbox._wall = lambda poll=poll: 100.0 * poll  # type: ignore[method-assign]
        latest = {PROGRESS: ("training", 2000 * poll, 0.05)}
        inbox._deliver(900, Mail("", {}, latest, {PROGRESS: 0.05}, {PROGRESS: poll}), False)
    assert inbox._last_at[900] == ("training", 10000)
    assert inbox.hang_window_s() == HANG_REPORT_FLOOR_S
    slow = {PROGRESS: ("training", 10001, 40.0)}  # a 40 s step: 20 x 40 s
    inbox._deliver(900, Mail("", {}, slow, {PROGRESS: 0.0}, {PROGRESS: 6}), False)
    assert inbox.hang_window_s() == 800.0


def test_a_rank_reports_its_own_longest_wait_between_two_reports(monkeypatch):
    from ray_lightning_sgd._worker import progress

    put: list = []
    clock = [10.0]
    monkeypatch.setattr(progress, "get_outbox", lambda: SimpleNamespace(
        put_latest=lambda channel, value: put.append(value)))  # fmt: skip
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    reporter = progress.ProgressReporterBase()
    for step, after in enumerate((0.0, 0.05, 2.5, 0.05)):
        clock[0] += after
        reporter._report("training", step)
    assert [value[:2] for value in put] == [("training", step) for step in range(4)]
    assert [value[2] for value in put] == pytest.approx([0.0, 0.05, 2.5, 2.5])


def test_a_rank_whose_call_ended_is_not_silent_while_the_others_still_run(monkeypatch):
    """predict with Ray Data: ranks read different numbers of rows, and Lightning's predict has
    no barrier at its end; a rank that returned long before the others is not a stall."""
    from ray_lightning_sgd.exceptions import WorkerTimeoutError

    inbox, _asked = _checking_inbox(monkeypatch, 3)
    now = inbox._now()
    inbox._progress_at = {0: now, 1: now - 40.0, 2: now - 40.0}
    inbox._answered_at = dict.fromkeys((0, 1, 2), now)
    inbox._deliver(1, Mail("call", {}, {}, {PROGRESS: 40.0}, {}, running=False), False)
    inbox._deliver(2, Mail("call", {}, {}, {PROGRESS: 40.0}, {}, running=True), False)
    with pytest.raises(WorkerTimeoutError, match="rank 2") as info:
        inbox._check(inbox._now())
    assert "rank 1" not in str(info.value).split("Every rank")[0]
    inbox._deliver(2, Mail("call", {}, {}, {PROGRESS: 40.0}, {}, running=False), False)
    inbox._check(inbox._now())  # both ended: nothing silent


def test_news_answers_of_this_attempt_poll_their_rank_and_a_failed_question_is_put_again(
    monkeypatch,
):
    """The real callback: Ray's thread notes the answer; the pump acts on this attempt's."""
    from concurrent.futures import Future

    class Ref:
        def __init__(self) -> None:
            self.fut: Future = Future()

        def future(self) -> Future:
            return self.fut

    questions: dict[int, list[Ref]] = {}

    class Group(list):
        def news_async(self, rank: int, call_id: str, items_after_s: float) -> Ref:
            ref = Ref()
            questions.setdefault(rank, []).append(ref)
            return ref

    clock, asked = [1000.0], []
    inbox = RunInbox(None, None, Run())
    monkeypatch.setattr(inbox, "_wall", lambda: clock[0])
    monkeypatch.setattr(inbox, "_ask", lambda rank: asked.append(rank) or f"poll {rank}")
    monkeypatch.setattr(inbox, "_take_answers", lambda timeout_s, run_calls: None)
    monkeypatch.setattr(inbox, "_check", lambda now: None)
    inbox.attach(Group(range(1001)), "call")  # type: ignore[arg-type]
    assert sorted(questions) == list(range(1001))  # one each, rank 0's too
    inbox.pump()
    asked.clear()
    questions[5][0].fut.set_result(True)  # news
    questions[6][0].fut.set_result(False)  # its call ended: nothing to do
    questions[7][0].fut.set_exception(ray.exceptions.RayError("unreachable"))
    inbox.pump()
    assert asked == [5] and len(questions[7]) == 1
    clock[0] += 1.1
    inbox.pump()
    assert len(questions[7]) == 2 and len(questions[6]) == 1  # 7's question put again
    old = questions[8][0]
    inbox._end_attempt()
    inbox.attach(Group(range(1001)), "call-2")  # type: ignore[arg-type]  (the next attempt)
    asked.clear()
    old.fut.set_result(True)  # an answer of the attempt that ended
    inbox.pump()
    assert 8 not in asked


def test_the_news_question_waits_for_its_call_and_answers_what_cannot_wait():
    from ray_lightning_sgd._worker_group.outbox import Outbox

    def answer(outbox: Outbox, call_id: str, items_after_s: float = 0.2) -> list[bool]:
        got: list[bool] = []
        thread = threading.Thread(
            target=lambda: got.append(outbox.wait_news(call_id, ("sigterm",), items_after_s)),
            daemon=True,  # a failed assertion leaves no thread that pytest's exit waits for
        )
        waiting = len(outbox._news._waiters)  # type: ignore[attr-defined]  (CPython's Condition)
        thread.start()
        deadline = time.monotonic() + 2.0  # until the question waits, or answered at once
        while not got and len(outbox._news._waiters) == waiting:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the question neither waited nor answered"
            time.sleep(0.005)
        return got

    def settle(got: list[bool], seconds: float = 2.0) -> list[bool]:
        deadline = time.monotonic() + seconds
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        return got

    outbox = Outbox()
    got = answer(outbox, "b")  # asked before call b opens: waits for it
    outbox.open("b")
    outbox.put_latest("progress", 3)  # no news
    time.sleep(0.1)
    assert got == []
    outbox.put_latest("sigterm", 123)
    assert settle(got) == [True]
    outbox.take()  # the driver took the notice: a new question waits again
    started = time.monotonic()
    got = answer(outbox, "b")
    outbox.append("output", ["a line"])
    assert settle(got) == [True] and time.monotonic() - started >= 0.2  # not before 0.2 s
    outbox.take()
    got = answer(outbox, "b")
    outbox.close()  # the call ended
    assert settle(got) == [False]
    outbox.open("e")
    assert settle(answer(outbox, "b")) == [False]  # a question that came after b ended
    got = answer(outbox, "c")  # a question for a call that never opens here...
    outbox.open("d")  # ...ends when another call opens
    assert settle(got) == [False]


def test_a_sigterm_notice_put_while_the_worker_imports_is_the_calls_own(monkeypatch):
    """The worker half opens its outbox under the attempt's id before it imports Lightning and
    unpickles the Trainer (seconds on a new worker): a notice put meanwhile is this call's."""
    from ray_lightning_sgd._boundary.channels import SIGTERM_NOTICE
    from ray_lightning_sgd._worker import entry
    from ray_lightning_sgd._worker_group.outbox import get_outbox

    class Imported(Exception):
        pass

    def importing(imports) -> None:  # SIGTERM's handler puts the notice while imports run
        get_outbox().put_latest(SIGTERM_NOTICE, 4321)
        raise Imported

    get_outbox().open("an earlier call")
    monkeypatch.setattr(entry, "_freeze_what_imports_built", importing)
    with pytest.raises(Imported):
        entry.run_on_worker(None, ("lightning",), (), "call-7")  # type: ignore[arg-type]
    mail = get_outbox().take()
    assert mail.call_id == "call-7" and mail.latest[SIGTERM_NOTICE] == 4321
