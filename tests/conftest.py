"""Shared fixtures: one local Ray cluster per test session (with fake GPUs), clean state per test."""

from __future__ import annotations

import os
import pkgutil

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
