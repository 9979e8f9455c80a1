"""Ctrl-C or SIGTERM on the driver stops the workers: a real driver subprocess gets the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from tests.conftest import leftovers
from tests.trackers import mlflow_runs, remove_store_lock

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
import faulthandler, signal, sys, time
import pytorch_lightning as pl
from ray_lightning_sgd import RaySGDStrategy
from tests.helpers import TinyModel, loader

class Slow(TinyModel):
    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def training_step(self, batch, batch_idx):
        open(self.marker, "w").close()  # tell the test that training has started
        time.sleep(0.5)
        return super().training_step(batch, batch_idx)

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks if it hangs
# a process started in the background inherits SIGINT ignored; a terminal's Ctrl-C is not
signal.signal(signal.SIGINT, signal.default_int_handler)
# the run an MLflow logger made on rank 0 ends FAILED, as ddp's handler leaves it on Ctrl-C
logger = pl.loggers.MLFlowLogger("interrupted", tracking_uri=sys.argv[2])
trainer = pl.Trainer(strategy=RaySGDStrategy(num_workers=2), max_epochs=100,
                     enable_progress_bar=False, logger=logger, enable_checkpointing=False)
try:
    trainer.fit(Slow(sys.argv[1]), loader())
except SystemExit:
    # still connected: Ray has not reaped anything for a dead driver yet
    from tests.conftest import leftovers
    print("leftovers before exit", leftovers())
    print("trainer status", trainer.state.status.value)
    raise
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_driver_stops_every_worker(free_cluster, tmp_path, signum):
    started = tmp_path / "started"
    mlflow = f"sqlite:///{tmp_path}/mlflow.db"
    env = dict(os.environ)
    env.update(
        RAY_ADDRESS=ray.get_runtime_context().gcs_address,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # the test cluster lives on 127.0.0.1
        PYTHONPATH=str(ROOT),
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DRIVER), str(started), mlflow],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        assert leftovers()[0], "the workers run while the driver trains"
        driver.send_signal(signum)
        start = time.monotonic()
        try:
            output, _ = driver.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGUSR1)  # every thread's stack, into the output
            time.sleep(2)
            driver.kill()
            output, _ = driver.communicate()
            raise AssertionError(f"the driver hung after {signum!r}:\n{output[-6000:]}") from None
        stopped = time.monotonic() - start
        if signum == signal.SIGINT:
            # Lightning's Ctrl-C handling: a message, then sys.exit(1)
            assert driver.returncode == 1, output[-3000:]
            assert "Detected KeyboardInterrupt" in output
        else:
            # not ended by the signal itself (a negative code): Lightning's SIGTERMException, a
            # SystemExit(143), unwound the launch; Ray turns it into SystemExit(1) when it lands
            # in one of Ray's own waits
            assert driver.returncode in (1, 128 + signal.SIGTERM), (
                driver.returncode,
                output[-3000:],
            )
        assert "trainer status interrupted" in output, output[-3000:]
        assert "leftovers before exit ([], [])" in output, output[-3000:]
        # the workers are gone before the driver exits (above); on its way out the driver's
        # MLflow logger marks the run FAILED, as ddp's process does (5.2-5.5 s in all in CI's
        # slow hour, against 5 s without a logger)
        assert stopped < 8, f"the driver took {stopped:.1f}s to stop after {signum!r}"
        while leftovers() != ([], []) and time.monotonic() - start < 10:
            time.sleep(0.2)
        assert leftovers() == ([], []), "the interrupted driver left workers running"
        assert [run["status"] for run in mlflow_runs(mlflow, "interrupted")] == ["FAILED"]
        remove_store_lock(mlflow)
    finally:
        if driver.poll() is None:
            driver.kill()
