"""Collectives stay paired: code of this package that runs on one rank never enters a collective.

Rank 0 alone feeds the driver's progress bar and driver callbacks. Reading the Trainer's metric
properties there would sync ``sync_dist=True`` metrics on rank 0 only, pairing its collective with
whatever the other ranks run next (here ``self.all_gather`` in the epoch-end hooks): a hang until
the process group's timeout. The process groups here time out after 60 s, so a regression fails
within a minute instead of half an hour.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy

from ray_lightning_sgd import RaySGDStrategy, TorchConfig
from tests.helpers import EpochEndCollectives, loader

TIMEOUT_S = 60
EPOCHS = 2

#: Every torch.distributed function that communicates.
_OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
)  # fmt: skip
_OURS = "ray_lightning_sgd"


class EpochEndReader(Callback):
    """A driver callback that reads the metrics at the epoch ends, as user callbacks do."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, dict[str, float]]] = []

    def _note(self, trainer, hook: str) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.seen.append((hook, trainer.current_epoch, metrics))

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._note(trainer, "validation_epoch_end")

    def on_train_epoch_end(self, trainer, pl_module):
        self._note(trainer, "train_epoch_end")


def _fit(strategy, enable_progress_bar: bool, callbacks=(), model=None, **trainer_kwargs):
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=enable_progress_bar,
        callbacks=list(callbacks),
        **trainer_kwargs,
    )
    model = model or EpochEndCollectives()
    trainer.fit(model, loader(), loader(48))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return trainer, weights, metrics


def _strategy(**kwargs) -> RaySGDStrategy:
    return RaySGDStrategy(num_workers=2, backend_config=TorchConfig(timeout_s=TIMEOUT_S), **kwargs)


@pytest.fixture(scope="module")
def ddp_spawn_reference():
    """Lightning's ddp_spawn on the same model, seed and data, without a progress bar.

    Without: Lightning's own TQDM bar reads the metrics on rank 0 alone at ``on_train_epoch_end``
    and so fails this model too (rank 0's barrier meets rank 1's all_gather).
    """
    strategy = DDPStrategy(start_method="spawn", timeout=timedelta(seconds=TIMEOUT_S))
    _, weights, metrics = _fit(strategy, enable_progress_bar=False, devices=2)
    return weights, metrics


def _assert_same(got, reference) -> None:
    weights, metrics = got
    ref_weights, ref_metrics = reference
    assert set(metrics) == set(ref_metrics)
    for name, value in ref_metrics.items():
        assert metrics[name] == pytest.approx(value, abs=1e-6), name
    assert set(weights) == set(ref_weights)
    for name, tensor in ref_weights.items():
        assert torch.allclose(weights[name], tensor, atol=1e-6, rtol=0), name


@pytest.mark.parametrize("bar", [True, False], ids=["default-bar", "no-bar"])
def test_epoch_end_collectives_train_as_under_ddp_spawn(ray_cluster, ddp_spawn_reference, bar):
    trainer, weights, metrics = _fit(_strategy(), enable_progress_bar=bar)
    assert trainer.global_step == EPOCHS * 6
    assert metrics["val_gathered"] == 3.0 and metrics["train_gathered"] == 5.0
    _assert_same((weights, metrics), ddp_spawn_reference)


def test_driver_callbacks_see_fresh_epoch_metrics(ray_cluster, ddp_spawn_reference):
    reader = EpochEndReader()
    _, weights, metrics = _fit(_strategy(driver_callbacks=[reader]), enable_progress_bar=True)
    _assert_same((weights, metrics), ddp_spawn_reference)
    hooks = [(hook, epoch) for hook, epoch, _ in reader.seen]
    assert hooks == [
        (h, e) for e in range(EPOCHS) for h in ("validation_epoch_end", "train_epoch_end")
    ]
    # each epoch-end hook sees what that epoch logged, as a callback on rank 0 would: the last
    # epoch's values equal what fit brought back
    last_val, last_train = reader.seen[-2][2], reader.seen[-1][2]
    for name in ("val_loss", "val_acc"):
        assert last_val[name] == pytest.approx(metrics[name], abs=1e-6), name
    for name in ("train_loss_epoch", "train_mean", "train_gathered"):
        assert last_train[name] == pytest.approx(metrics[name], abs=1e-6), name
    # and not the previous epoch's: validation metrics change from epoch to epoch
    assert reader.seen[0][2]["val_loss"] != pytest.approx(last_val["val_loss"], abs=1e-6)


class CollectiveRecorder(Callback):
    """Runs on each worker, first of its callbacks: records every ``torch.distributed`` call of
    this rank with where it came from: a hook of one of this package's callbacks, a thread other
    than the one that runs the Trainer, or anything else (Lightning's loops, the model)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._where: str | None = None
        self._local: threading.local | None = None  # made on the worker: it cannot be pickled
        self._undo: list[tuple[object, str, object]] = []

    def setup(self, trainer, pl_module, stage):
        trainer_thread = threading.current_thread()
        self._local = threading.local()
        for module in (dist, c10d):
            for op in _OPS:
                original = getattr(module, op, None)
                if original is not None:
                    setattr(module, op, self._counted(op, original, trainer_thread))
                    self._undo.append((module, op, original))
        for callback in trainer.callbacks:
            if type(callback).__module__.split(".")[0] == _OURS:
                for hook in dir(Callback):
                    if hook.startswith("on_") or hook in ("setup", "teardown"):
                        self._label(callback, hook)

    def finish(self) -> list[tuple[str, str]]:
        for module, op, original in reversed(self._undo):
            setattr(module, op, original)
        return self.calls

    def _label(self, callback: Callback, hook: str) -> None:
        method = getattr(callback, hook)
        where = f"{type(callback).__name__}.{hook}"

        def labelled(*args, **kwargs):
            self._where = where
            try:
                return method(*args, **kwargs)
            finally:
                self._where = None

        setattr(callback, hook, labelled)

    def _counted(self, op: str, original, trainer_thread: threading.Thread):
        def counted(*args, **kwargs):
            local = self._local
            depth = getattr(local, "depth", 0)
            if depth == 0:  # all_gather_object calls all_gather: count the outer call
                thread = threading.current_thread()
                if thread is not trainer_thread:
                    where = f"thread {thread.name}"
                else:
                    where = self._where or "lightning or the model"
                self.calls.append((where, op))
            local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = depth

        return counted


class RecordingModel(EpochEndCollectives):
    """Writes this rank's recorded calls to ``folder`` at the end of the call.

    Its epoch-end hooks run no collective of their own, so that a collective of ours on one rank
    fails the assertions below, naming its hook, instead of hanging: the ``sync_dist=True``
    metrics and the torchmetrics object still sync whenever they are computed.
    """

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def on_validation_epoch_end(self) -> None:
        pass

    def on_train_epoch_end(self) -> None:
        pass

    def teardown(self, stage: str) -> None:
        # the model's teardown runs after every callback's
        recorder = next(cb for cb in self.trainer.callbacks if isinstance(cb, CollectiveRecorder))
        calls = recorder.finish()
        Path(self.folder, f"rank-{self.global_rank}.json").write_text(json.dumps(calls))


@pytest.mark.parametrize("max_failures", [0, 1], ids=["no-restarts", "resume-checkpoints"])
def test_code_of_ours_on_one_rank_makes_no_collective(ray_cluster, tmp_path, max_failures):
    # every rank-0-only path on: driver view (bar, driver callbacks), output forwarding, progress
    # reports; with max_failures, resume checkpoints too (their barrier makes a regression of the
    # driver view hang until the timeout rather than fail the assertions)
    strategy = _strategy(driver_callbacks=[EpochEndReader()], max_failures=max_failures)
    model = RecordingModel(str(tmp_path))
    _fit(strategy, enable_progress_bar=True, callbacks=[CollectiveRecorder()], model=model)
    ranks = [json.loads(Path(tmp_path, f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0], "the recorder saw no collective: it did not record"
    by_source = [
        {where: [op for w, op in calls if w == where] for where, _ in calls} for calls in ranks
    ]
    ours = sorted(
        {where for calls in by_source for where in calls if where != "lightning or the model"}
    )
    # this package's callbacks may take part in collectives only as every rank does (the resume
    # checkpoint's save_checkpoint); nothing runs one on a single rank or from another thread
    for where in ours:
        assert not where.startswith("thread "), (
            f"{where} made a collective: {by_source[0].get(where)}"
        )
        assert by_source[0].get(where) == by_source[1].get(where), (
            f"{where} made collectives on one rank only: rank 0 {by_source[0].get(where)}, "
            f"rank 1 {by_source[1].get(where)}"
        )
    for where in ours:
        if where.startswith(("EventForwarder", "ProgressReporter")):
            assert by_source[0][where] == [], f"{where} made collectives: {by_source[0][where]}"
    # and so every rank runs the same collectives in the same order
    assert [op for _, op in ranks[0]] == [op for _, op in ranks[1]]
