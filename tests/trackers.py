"""What experiment trackers hold, read back as plain values: MLflow's runs (a local store or a
tracking server), W&B's offline runs (from their run folders); and an MLflow tracking server on
127.0.0.1 for the tests that log over HTTP."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: How long an MLflow tracking server may take to answer its health check (about 15 s here).
MLFLOW_SERVER_START_S = 120


def mlflow_runs(uri: str, experiment: str) -> list[dict[str, Any]]:
    """Every run of ``experiment`` in the store at ``uri``, oldest first: its id, status,
    params, each metric's (step, value) history in logging order, and its artifacts' paths."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])
    return [
        {
            "id": run.info.run_id,
            "status": run.info.status,
            "params": dict(run.data.params),
            "metrics": {
                key: [
                    (m.step, m.value)
                    for m in sorted(
                        client.get_metric_history(run.info.run_id, key),
                        key=lambda m: (m.step, m.timestamp),
                    )
                ]
                for key in sorted(run.data.metrics)
            },
            "artifacts": sorted(_artifacts(client, run.info.run_id)),
        }
        for run in runs
    ]


def remove_store_lock(uri: str) -> None:
    """Removes the lock file MLflow leaves in the temporary folder for each sqlite store it
    opened (``db_init_lock-<md5 of the store's URL>``), so that a test leaves nothing behind."""
    from sqlalchemy.engine import make_url

    name = hashlib.md5(str(make_url(uri)).encode(), usedforsecurity=False).hexdigest()
    Path(tempfile.gettempdir(), f"db_init_lock-{name}").unlink(missing_ok=True)


def _artifacts(client: Any, run_id: str, path: str | None = None) -> list[str]:
    found = []
    for item in client.list_artifacts(run_id, path):
        found += _artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return found


def wandb_runs(folder: Path) -> list[dict[str, Any]]:
    """The W&B offline runs under ``folder`` (``<folder>/wandb/offline-run-*``), in the order
    they started: each one's run id, notes, config, history rows (without W&B's own ``_``
    keys) and exit code (None: the process ended without finishing it; W&B may then have
    written nothing of it)."""
    found = []
    for path in sorted((folder / "wandb").glob("offline-run-*/run-*.wandb")):
        # the folder is named by the run's id: a process killed before W&B wrote its records
        # leaves the folder with a file of no records
        run_id = path.parent.name.rsplit("-", 1)[-1]
        run: dict[str, Any] = {"id": run_id, "notes": None, "config": {}, "rows": [], "exit": None}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["notes"] = record.run.run_id, record.run.notes
            elif kind == "config":
                run["config"].update({i.key: i.value_json for i in record.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                run["rows"].append({k: float(v) for k, v in row.items() if not k.startswith("_")})
            elif kind == "exit":
                run["exit"] = record.exit.exit_code
        found.append(run)
    return found


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file: a 7-byte header, then blocks of 32 KiB that hold records
    in LevelDB's log format (a 7-byte header each: checksum, length, type; a record larger than
    its block's room goes on in the next blocks), each record a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    position, pending = 7, b""
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # a block's tail too short for a header is padding
            position += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            position += room
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """An MLflow tracking server on 127.0.0.1 (a sqlite store and artifacts under ``folder``),
    its URI while it runs; stopped, with its processes, at the end."""
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    store = f"sqlite:///{folder}/store.db"
    mlflow = Path(sys.executable).with_name("mlflow")
    command = [
        str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", store,
        "--default-artifact-root", str(folder / "artifacts"),
    ]  # fmt: skip
    log = (folder / "server.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + MLFLOW_SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(
                    f"the MLflow server did not start:\n{(folder / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 15)  # its workers are in its session
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
        log.close()
        remove_store_lock(store)


def offline_comet_logger(loggers: Any, folder: Path, project: str) -> Any:
    """A ``CometLogger`` of the ``loggers`` module that needs no network, built as its release
    takes it: Lightning 2.6's ``online=False`` (an experiment it disables), 2.5's ``save_dir``
    (an offline experiment that writes an archive)."""
    import inspect

    cls = loggers.CometLogger
    if "online" in inspect.signature(cls).parameters:
        return cls(project=project, online=False, offline_directory=str(folder))
    return cls(project_name=project, save_dir=str(folder))
