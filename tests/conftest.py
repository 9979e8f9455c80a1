"""Shared fixtures: one local Ray cluster per test session (with fake GPUs), clean state per test."""

from __future__ import annotations

import contextlib
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile

import pytest
import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group_table

import ray_lightning_sgd
from ray_lightning_sgd import _compat
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd.worker_group import NAME_PREFIX

# two CPUs for two workers, and GPUs that this machine does not have: Ray lets a node declare
# them, which is enough to test how GPUs are assigned without running CUDA; on a machine with
# CUDA, its real GPUs (tests/test_gpu.py trains on them)
CLUSTER_CPUS = 2
CLUSTER_FAKE_GPUS = torch.cuda.device_count() or 2


def our_deprecations_as_errors() -> str:
    """A PYTHONWARNINGS value that turns deprecations raised by our modules into errors.

    pyproject.toml does the same for the test process; this is for Ray's worker processes, where
    the launcher's worker half runs. PYTHONWARNINGS names modules exactly, so each one is listed.
    """
    modules = [ray_lightning_sgd.__name__] + [
        info.name
        for info in pkgutil.walk_packages(
            ray_lightning_sgd.__path__, f"{ray_lightning_sgd.__name__}."
        )
    ]
    categories = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning")
    return ",".join(f"error::{c}:{m}" for c in categories for m in modules)


def start_local_ray() -> None:
    if not ray.is_initialized():
        _compat.bind_local_ray_to_loopback()
        # Ray's processes, its workers among them, inherit the environment of the process that
        # starts the local cluster (a job's runtime_env would do the same, at a cost per worker)
        os.environ["PYTHONWARNINGS"] = our_deprecations_as_errors()
        ray.init(
            address="local",
            num_cpus=CLUSTER_CPUS,
            num_gpus=CLUSTER_FAKE_GPUS,
            include_dashboard=False,
            log_to_driver=False,
        )


#: Fixtures that end the shared cluster and start clusters of their own.
_OWN_CLUSTER_FIXTURES = ("two_nodes", "head_and_worker_node", "no_ray")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the suite in the order that starts the fewest workers: tests without Ray first, then
    those that share warm workers, then those that need the cluster free of them, then those that
    replace the shared cluster with one of their own. Within each part, the usual order."""

    def part(item: pytest.Item) -> int:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & set(_OWN_CLUSTER_FIXTURES):
            return 3
        if "free_cluster" in fixtures:
            return 2
        return 1 if "ray_cluster" in fixtures else 0

    items.sort(key=part)  # stable: each part keeps the files' order


#: Modules a second pytest process runs beside the rest, in a temporary folder of its own (its
#: Ray, its scratch files), while the two cores would otherwise idle: those whose every test runs
#: on a multi-node cluster of its own (``ray.cluster_utils``), mostly waiting for a node to join
#: or to be found lost, and modules that mostly wait for other processes (drivers and a Ray
#: Client server in subprocesses, groups that wait for room) and assert no timing. Tests that
#: time a hang report or a failure's detection stay in the session: run beside a loaded session,
#: their workers' start ran past the windows they time (2026-12-06).
#: Run serially with RAY_LIGHTNING_SGD_TESTS_SERIAL=1.
BESIDE = (
    "tests/test_node_loss.py", "tests/test_multinode.py", "tests/test_named_runs.py",
    "tests/test_client.py", "tests/test_cli.py", "tests/test_elastic.py",
    "tests/test_interrupt.py", "tests/test_sharded.py", "tests/test_checkpoint_lifecycle.py",
    "tests/test_trackers.py",
)  # fmt: skip
_BESIDE_ENV = "RAY_LIGHTNING_SGD_TESTS_BESIDE"
#: Seconds the session waits at its end (or before a test that needs the machine free of
#: other Ray clusters) for the tests run beside it.
_BESIDE_WAIT_S = 900
_beside: dict[str, object] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    # after every filter (-k, -m, --lf, --deselect): only the tests selected run beside
    _run_beside(session.config, session.items)


def _run_beside(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Starts the second pytest process for :data:`BESIDE`'s selected tests and takes them out
    of this session; the session's end waits for it and fails if it failed."""
    if os.environ.get(_BESIDE_ENV) or os.environ.get("RAY_LIGHTNING_SGD_TESTS_SERIAL"):
        return
    if config.option.collectonly or hasattr(config, "workerinput"):  # xdist's workers
        return
    if config.pluginmanager.has_plugin("suite_census"):  # it counts one process's tests
        return
    beside = [item for item in items if item.nodeid.split("::")[0] in BESIDE]
    if not beside or len(beside) == len(items):
        return
    folder = tempfile.mkdtemp(prefix="rls-beside-")
    log = open(os.path.join(folder, "output.txt"), "w+")
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        f"--basetemp={folder}/pt", *[item.nodeid for item in beside],
    ]  # fmt: skip
    # its own temporary folder: its Ray sessions, its scratch files
    environment = {**os.environ, _BESIDE_ENV: "1", "TMPDIR": folder, "RAY_TMPDIR": folder}
    _beside.update(
        process=subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=environment,
            cwd=str(config.rootpath), start_new_session=True, preexec_fn=_end_with_parent,
        ),
        log=log, folder=folder, count=len(beside),
    )  # fmt: skip
    beside_ids = {id(item) for item in beside}
    items[:] = [item for item in items if id(item) not in beside_ids]
    config.hook.pytest_deselected(items=beside)


def _end_with_parent() -> None:
    """In the process beside, before it runs: the kernel ends it when this session's process
    ends, however that ends (its Ray clusters go with it: they share its fate)."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stop_beside() -> None:
    process = _beside.get("process")
    if isinstance(process, subprocess.Popen) and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        _beside["status"] = process.wait()


def _wait_beside() -> int | None:
    """Waits for the tests run beside this session; their exit status (None: none ran)."""
    process = _beside.get("process")
    if not isinstance(process, subprocess.Popen):
        return None
    if "status" not in _beside:
        if process.poll() is None:
            sys.stderr.write("\n(waiting for the tests run beside this session)\n")
        try:
            _beside["status"] = process.wait(timeout=_BESIDE_WAIT_S)
        except subprocess.TimeoutExpired:
            _stop_beside()  # its time is up: a failure (a signal's status)
        except BaseException:  # Ctrl-C while waiting: it must not run on alone
            _stop_beside()
            raise
    return int(_beside["status"])  # type: ignore[call-overload]


def pytest_runtest_setup(item: pytest.Item) -> None:
    # a test that ends the shared cluster for one of its own needs no other Ray beside it
    if set(getattr(item, "fixturenames", ())) & set(_OWN_CLUSTER_FIXTURES):
        _wait_beside()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop or session.shouldfail:
        _stop_beside()  # interrupted, or -x / --maxfail stopped the session
    status = _wait_beside()
    if status not in (None, 0) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    status = _wait_beside()
    if status is None:
        return
    log = _beside["log"]
    log.seek(0)  # type: ignore[attr-defined]
    output = log.read()  # type: ignore[attr-defined]
    terminalreporter.section(
        f"the {_beside['count']} tests of {', '.join(BESIDE)}, run beside this session "
        f"(exit status {status})"
    )
    lines = output.strip().splitlines()
    if status or not lines:
        terminalreporter.write(output + f"(kept: {_beside['folder']})\n")
    else:
        terminalreporter.write(lines[-1] + "\n")
        shutil.rmtree(str(_beside["folder"]), ignore_errors=True)


@pytest.fixture(scope="session")
def s3():
    """A real S3 server (moto's) on 127.0.0.1 for the session's process: see tests/s3.py."""
    from tests.s3 import s3_server

    with s3_server() as server:
        yield server


@pytest.fixture
def ray_cluster():
    """A running local Ray cluster, shared by every test that asks for it.

    Idle warm workers stay up from one test to the next, as they would between a user's calls:
    starting workers is most of a small test's time on two cores. Anything else a test leaves
    running fails it.
    """
    start_local_ray()
    yield
    assert_only_idle_workers_left(release=False)


@pytest.fixture
def free_cluster(ray_cluster):
    """The shared cluster without idle workers holding its CPUs: for tests that start workers
    outside this process's pool (a WorkerGroup of their own, a Tune trial, another driver)."""
    pool.shutdown()
    yield


def assert_only_idle_workers_left(release: bool = True) -> int:
    """Checks that every live actor and placement group of ours is an idle warm group, then stops
    those unless ``release`` is False; returns how many idle groups there were."""
    # warm workers may stay up, but only as idle groups the pool knows; anything else is a leak
    idle = pool.idle_group_names()
    actors, groups = leftovers()
    unknown = [name for name in actors + groups if not any(name.startswith(g) for g in idle)]
    assert unknown == [], "a test left actors or placement groups of ours running"
    if not release:
        return len(idle)
    pool.shutdown()
    assert leftovers() == ([], []), "shutting the idle workers down left some running"
    return len(idle)


def leftovers() -> tuple[list[str], list[str]]:
    """Names of our live actors and placement groups in the connected cluster."""
    actors = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(NAME_PREFIX)
    ]
    groups = [
        g["name"]
        for g in placement_group_table().values()
        if g["name"].startswith(NAME_PREFIX) and g["state"] != "REMOVED"
    ]
    return actors, groups


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(saved):
        # Ray exports its own settings (auth mode, addresses) when a test first starts it; the
        # clusters of later tests and their subprocesses need them
        if not key.startswith("RAY_"):
            del os.environ[key]
    os.environ.update(saved)
