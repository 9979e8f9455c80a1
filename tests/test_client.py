"""A driver that reaches the cluster through Ray Client (``ray.init("ray://host:port")``).

The client server is a real one, in its own process on 127.0.0.1, joined to the session's cluster;
the driver is a subprocess that connects to it, as a laptop or notebook would. The client's server
pickles what the driver fetches once more: the workers' results must travel without Ray's
out-of-band buffers, or the fetch fails and the client retries it for ever.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

pytest.importorskip("ray.util.client")
pytest.importorskip("grpc", reason="Ray Client needs ray[client]")

ROOT = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent(
    """
    import os, sys
    import ray
    ray.init(os.environ["CLIENT_ADDRESS"])
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from ray_lightning_sgd import RaySGDStrategy
    import tests.helpers  # the driver's own code: a client driver ships it to the workers

    class Model(pl.LightningModule):
        def __init__(self, fail=False):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.fail = fail
        def training_step(self, batch, batch_idx):
            if self.fail:
                raise ValueError("a user error on a worker")
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)
        def predict_step(self, batch, batch_idx):
            return self.layer(batch[0])
        def on_fit_end(self):
            print(f"worker pid {os.getpid()} weights {self.layer.weight.sum().item():.6f}")
            import tests.helpers as helpers
            print("helpers from", helpers.__file__)
        def on_validation_end(self):
            print(f"worker pid {os.getpid()} validated")
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = DataLoader(data, batch_size=8)
    model = Model()
    trainer = pl.Trainer(strategy=RaySGDStrategy(num_workers=2), max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, loader)
    print(f"driver weights {model.layer.weight.sum().item():.6f}", flush=True)
    print("driver loss", "loss" in trainer.callback_metrics, flush=True)
    print("driver validate", trainer.validate(model, loader), flush=True)
    print("driver predictions", sum(len(p) for p in trainer.predict(model, loader)), flush=True)
    try:
        pl.Trainer(strategy=RaySGDStrategy(num_workers=2), max_epochs=1, logger=False,
                   enable_checkpointing=False).fit(Model(fail=True), loader)
    except Exception as err:
        print("driver error", type(err).__name__, str(err).splitlines()[0], flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def client_address(free_cluster):
    """A Ray Client server joined to the session's cluster, in a process of its own; the
    session's warm workers are released so that the driver's workers fit."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "ray.util.client.server", "--mode=legacy", "--host=127.0.0.1",
         f"--port={port}", f"--address={ray.get_runtime_context().gcs_address}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                assert server.poll() is None, "the client server exited"
                assert time.monotonic() < deadline, "the client server did not start"
                time.sleep(0.5)
        yield f"ray://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(60)


def test_fit_validate_predict_and_errors_through_ray_client(client_address):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CLIENT_ADDRESS": client_address}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=240,
        cwd=ROOT, check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    lines = out.splitlines()

    def value(prefix: str) -> str:
        found = [line for line in lines if prefix in line]  # a progress bar may precede it
        assert found, f"no line {prefix!r} in: {out}"
        return found[0].split(prefix, 1)[1].strip()

    # the workers' output reaches the driver, and their weights are the driver's after fit
    # (a progress bar's last line may precede a line: the rest of it is what the line says)
    worker = [line for line in lines if "[rank 0] worker pid" in line and "weights" in line]
    assert worker, out + result.stderr[-3000:]
    words = worker[0].split("[rank 0] worker pid", 1)[1].split()
    pid, weights = words[0], words[-1]
    assert value("driver weights") == weights, out
    assert value("driver loss") == "True", out
    assert "'val_loss'" in value("driver validate"), out
    assert value("driver predictions") == "32", out
    # validate ran on the warm workers of fit
    assert f"[rank 0] worker pid {pid} validated" in out, out
    # the driver's own package reached the workers through the object store (the driver is on
    # no node of the cluster), unpacked in a folder of the node's temporary directory
    # (both ranks print the same line, which the driver prints once, tagged with the rank whose
    # copy came first)
    assert "/ray_lightning_sgd-code-" in value("] helpers from"), out
    assert value("driver error") == "ValueError a user error on a worker", out
    assert "Epoch 1" in out + result.stderr  # the progress bar, on the driver
