"""Lightning parity: each case of :mod:`tests.parity.cases` under ``RaySGDStrategy(num_workers=2)``
leaves the driver with what Lightning's own ``ddp`` leaves on its driver (rank 0), call by call.

The ``ddp`` reference runs once per test session, in a subprocess started with the first parity
test, while the Ray side of the cases runs here (:mod:`tests.parity.reference`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from tests.parity.cases import CASES, Classifier, Run, assert_same, loader

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ray_lightning_sgd"
#: How long the whole reference may take (it takes about a minute on 2 cores).
REFERENCE_TIMEOUT_S = 420


class Reference:
    """The ``ddp`` reference process and the records it saves."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.log = out / "reference.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            env.pop(key, None)
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.parity.reference", str(out)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.deadline = time.monotonic() + REFERENCE_TIMEOUT_S

    def records(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        done, failed = self.out / f"{name}.pt", self.out / f"{name}.error"
        while not done.exists():
            if failed.exists():
                pytest.fail(f"the ddp reference of {name} failed:\n{failed.read_text()[-3000:]}")
            if self.process.poll() is not None or time.monotonic() > self.deadline:
                pytest.fail(f"the ddp reference ended without {name}:\n{self._log_tail()}")
            time.sleep(0.2)
        return torch.load(done, weights_only=False)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # rank 1 is its child: it ends when its parent's pipe closes
        self.process.wait()

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    ref = Reference(tmp_path_factory.mktemp("ddp-reference"))
    yield ref
    ref.stop()


#: Differences that remain, each named in the README's limitations: (case, label, key) -> why.
KNOWN: dict[tuple[str, str, str], str] = {}


@pytest.mark.parametrize("name", list(CASES))
def test_driver_holds_what_ddp_leaves(name: str, reference: Reference, ray_cluster, tmp_path):
    run = Run("ray", tmp_path / name)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", RuntimeWarning)
        CASES[name](run)
    ours = [str(w.message) for w in warned if w.filename.startswith(str(PACKAGE))]
    assert not ours, f"the driver could not take everything back: {ours}"
    expected = reference.records(name)
    assert [label for label, _ in run.records] == [label for label, _ in expected]
    for (label, want), (_, got) in zip(expected, run.records, strict=True):
        for key in want:
            if (name, label, key) in KNOWN:
                continue
            assert_same(want[key], got[key], f"{name} after {label}: {key}")


class _GrowsOnTheWorkers(Classifier):
    """A model whose ``configure_model`` adds a layer: the driver's copy never gets it."""

    def configure_model(self) -> None:
        if not hasattr(self, "head"):
            self.head = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


def test_weights_that_do_not_fit_the_driver_model_are_never_silent(ray_cluster, tmp_path):
    model = _GrowsOnTheWorkers()
    initial = model.net[0].weight.detach().clone()
    run = Run("ray", tmp_path)
    trainer = run.trainer(max_epochs=1)
    with pytest.warns(RuntimeWarning) as warned:
        trainer.fit(model, loader())
    messages = [str(w.message) for w in warned]
    assert any("unexpected head.bias, head.weight" in m for m in messages), messages
    assert any("optimizers stays empty" in m and "head.weight" in m for m in messages), messages
    assert trainer.optimizers == []
    assert not torch.equal(model.net[0].weight, initial), "the matching weights were loaded"


class _HoldsALock(pl.Callback):
    """A callback that makes an attribute that cannot be pickled on the workers (it could not
    travel there otherwise), with a count in its state_dict."""

    def __init__(self) -> None:
        self.batches = 0
        self.note = "driver"

    def setup(self, trainer, pl_module, stage) -> None:
        self.lock = threading.Lock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        self.note = "worker"

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


def test_what_cannot_come_back_is_named_and_state_dicts_still_do(ray_cluster, tmp_path):
    callback = _HoldsALock()
    trainer = Run("ray", tmp_path).trainer(max_epochs=1, callbacks=[callback])
    with pytest.warns(RuntimeWarning, match=r"callback _HoldsALock \(TypeError: cannot pickle"):
        trainer.fit(Classifier(), loader())
    assert callback.batches == 4, "its state_dict() came back"  # 64 samples, 8 a batch, 2 ranks
    assert callback.note == "driver" and not hasattr(callback, "lock"), "it stayed as it was"
