"""The embedded default: with no Ray running, a launch starts a private local Ray on 127.0.0.1.

These tests run their drivers in subprocesses with no Ray running, so they first shut down the
test session's cluster (the next test that needs it starts it again).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import ray

ROOT = Path(__file__).resolve().parents[1]


def _ray_processes() -> set[int]:
    return {
        p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("gcs_server", "raylet")
    }


@pytest.fixture
def no_ray():
    ray.shutdown()
    if _ray_processes():
        pytest.skip("another Ray instance runs on this machine; the embedded default would join it")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    yield env
    # the driver's exit stops its Ray (SIGTERM to the processes it started), which then take
    # a moment to end: up to 15 s
    deadline = time.monotonic() + 15
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ray_processes(), "the embedded Ray instance outlived its driver by 15 s"


def _run(code: str, env: dict[str, str], timeout: float = 240) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_embedded_ray_listens_on_loopback_only_and_ends_with_the_driver(no_ray):
    out = _run(
        """
        import psutil, ray
        from ray_lightning_sgd._worker_group import cluster
        assert cluster.connect() is True
        assert cluster.connect() is False  # already connected: nothing new is started
        print("ip", ray.util.get_node_ip_address())
        ray_pids = {p.pid for p in psutil.Process().children(recursive=True)}
        addresses = {c.laddr.ip for c in psutil.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in ray_pids}
        print("listen", sorted(addresses))
        # Ray keeps a minimal dashboard process for its own bookkeeping; it must serve no UI
        dashboards = [p.cmdline() for p in psutil.Process().children(recursive=True)
                      if any("dashboard/dashboard.py" in part for part in p.cmdline())]
        print("dashboard UIs", sum("--disable-frontend" not in c for c in dashboards))
        """,
        no_ray,
    )
    assert "ip 127.0.0.1" in out
    listen = re.search(r"listen (.*)", out).group(1)
    assert listen != "[]"
    assert all(a in ("127.0.0.1", "::ffff:127.0.0.1") for a in eval(listen)), listen
    assert "dashboard UIs 0" in out


def test_example_reaches_95_percent_on_the_driver(no_ray):
    out = _run(
        f"import runpy, sys; sys.argv = ['digits.py']; runpy.run_path('{ROOT}/examples/digits.py', run_name='__main__')",
        no_ray,
    )
    accuracy = float(re.search(r"test accuracy on the driver: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.95, out[-2000:]
