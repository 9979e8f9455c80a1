"""Joining a cluster by address: a dead address fails within seconds, a cluster that wants a token
says so, a stopped `ray start` cluster's leftover address does not hold up the embedded start, and
RAY_ADDRESS=auto with no cluster to find is an error.

Each test runs its driver in a subprocess; the `ray start` head is a child process of the test
(never `ray stop`, which would end every Ray process on the machine).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import ray

from ray_lightning_sgd import _compat

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")
RECORDED = Path("/tmp/ray/ray_current_cluster")  # where `ray start` records its address

CONNECT = textwrap.dedent(
    """
    import time
    from ray_lightning_sgd import ClusterConnectionError
    from ray_lightning_sgd._worker_group import cluster
    started = time.monotonic()
    try:
        print("embedded" if cluster.connect() else "joined", flush=True)
    except ClusterConnectionError as err:
        print("error", err, flush=True)
    print(f"seconds {time.monotonic() - started:.1f}")
    """
)


def _ray_processes() -> set[int]:
    return {
        p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("gcs_server", "raylet")
    }


@pytest.fixture
def no_ray():
    """No Ray on the machine (the session's cluster is shut down), and the environment of a
    driver that joins a cluster on 127.0.0.1; Ray's record of its last cluster is put back."""
    ray.shutdown()
    if _ray_processes():
        pytest.skip("another Ray instance runs on this machine; auto-detection would find it")
    recorded = RECORDED.read_text() if RECORDED.exists() else None
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    yield env
    if recorded is None:
        RECORDED.unlink(missing_ok=True)
    else:
        RECORDED.write_text(recorded)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _driver(code: str, env: dict[str, str], timeout: float = 180) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _seconds(out: str) -> float:
    return float(out.split("seconds ", 1)[1].split()[0])


def test_a_named_address_where_nothing_answers_fails_within_seconds(no_ray):
    port = _free_port()
    out = _driver(CONNECT, {**no_ray, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert out.startswith("error"), out
    assert f"RAY_ADDRESS='127.0.0.1:{port}'" in out and "ray start --head" in out
    assert _seconds(out) < 15, out  # Ray alone retries for minutes


def test_a_token_cluster_says_how_to_join_and_a_stopped_one_is_skipped(no_ray):
    port = _free_port()  # an ephemeral port: outside the range Ray gives its workers
    head = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
         "--include-dashboard=false"],
        # a token cluster, as Ray 2.60's `ray start` makes when a token exists (older Ray: asked)
        env={**no_ray, "RAY_AUTH_MODE": "token"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _answers(port):
            assert head.poll() is None and time.monotonic() < deadline, "the head did not start"
            time.sleep(0.5)
        address = {**no_ray, "RAY_ADDRESS": f"127.0.0.1:{port}"}
        # the token stays with the driver unless it is asked to send it
        out = _driver(CONNECT, address)
        assert out.startswith("error"), out
        assert "RAY_AUTH_MODE=token" in out and "ray get-auth-token" in out, out
        assert _seconds(out) < 10, out  # Ray alone tries 20 times, a second apart
        joined = _driver(
            CONNECT + "\nimport ray; print('cpus', ray.cluster_resources()['CPU'])",
            {**address, "RAY_AUTH_MODE": "token"},
        )
        assert joined.startswith("joined") and "cpus 1.0" in joined, joined
    finally:
        head.terminate()
        head.wait(60)
    deadline = time.monotonic() + 60
    while _ray_processes():
        assert time.monotonic() < deadline, "the head's processes outlived it"
        time.sleep(0.5)
    # the stopped head's address is still recorded, where Ray's discovery reads it (what a
    # driver then does: the next test)
    assert RECORDED.exists() and RECORDED.read_text().strip().endswith(f":{port}")
    assert str(_compat.ray.address_to_join()).endswith(f":{port}")


def test_a_stopped_clusters_recorded_address_is_skipped_for_an_embedded_ray(monkeypatch, caplog):
    """Ray's discovery finds the address a stopped `ray start` head recorded (faked here: the
    test above shows where Ray reads it); nothing answers there, and the driver starts an
    embedded Ray at once, with a warning, instead of Ray's minutes of retries."""
    from ray_lightning_sgd._worker_group import cluster

    port = _free_port()  # nothing listens there
    started: list[dict] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: started.append(kwargs))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    monkeypatch.setattr(_compat.ray, "address_to_join", lambda: f"127.0.0.1:{port}")
    monkeypatch.setattr(_compat, "bind_local_ray_to_loopback", lambda: None)
    begun = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        assert cluster.connect() is True  # embedded
    assert time.monotonic() - begun < 5
    assert started == [{"address": "local", "include_dashboard": False, "log_to_driver": True}]
    assert f"last started on this machine (127.0.0.1:{port}) no longer runs" in caplog.text


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 1):
            return True
    except OSError:
        return False


def test_ray_address_auto_without_a_cluster_is_an_error_not_an_embedded_ray(monkeypatch):
    """Ray's own search for a cluster ("auto") finds nothing here (its process scan and its
    record of the last `ray start` are faked empty: this machine may run other Ray instances),
    so no Ray may start."""
    from ray._private import services

    from ray_lightning_sgd import ClusterConnectionError
    from ray_lightning_sgd._worker_group import cluster

    started = []
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: started.append(kwargs))
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    with pytest.raises(ClusterConnectionError) as info:
        cluster.connect()
    message = str(info.value)
    assert "RAY_ADDRESS='auto'" in message and "ray start --head" in message
    assert "unset RAY_ADDRESS" in message
    assert started == []


def test_a_ray_client_address_where_nothing_answers_fails_within_seconds(monkeypatch):
    """RAY_ADDRESS=ray://host:port with no Ray Client server there: Ray Client tries for 30 s,
    then raises a bare ConnectionError; the driver says so within the probe's 3 s, naming
    RAY_ADDRESS, and starts no Ray."""
    from ray_lightning_sgd import ClusterConnectionError
    from ray_lightning_sgd._worker_group import cluster

    started = []
    port = _free_port()
    for name in ("grpc_proxy", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}?tls=0")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: started.append(kwargs))
    began = time.monotonic()
    with pytest.raises(ClusterConnectionError) as info:
        cluster.connect()
    assert time.monotonic() - began < 5
    message = str(info.value)
    assert f"RAY_ADDRESS='ray://127.0.0.1:{port}?tls=0'" in message
    assert f"no Ray Client server answers at 127.0.0.1:{port}" in message
    assert started == []
    # left to Ray Client: no port (gRPC picks its own), or a proxy that gRPC goes through
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1")
    assert cluster.connect() is False and len(started) == 1
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")
    monkeypatch.setenv("https_proxy", "http://proxy.invalid:3128")
    assert cluster.connect() is False and len(started) == 2
