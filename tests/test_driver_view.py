"""The driver's view: one live progress bar on the driver, and driver callbacks on rank 0's events."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning.pytorch.callbacks as LRCallbacks
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, RichProgressBar, TQDMProgressBar

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy
from ray_lightning_sgd._driver.output import OutputPrinter
from ray_lightning_sgd._driver.replay import TrainerView
from ray_lightning_sgd.lightning import RaySGDStrategy as LRaySGDStrategy
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs


class BarProbe(TinyModel):
    """Notes on every rank whether the worker's Trainer runs a progress bar of its own."""

    def __init__(self, folder: str, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.folder = folder
        self.fail_at = fail_at_step

    def on_train_start(self) -> None:
        bar = self.trainer.progress_bar_callback
        Path(self.folder, f"rank-{self.global_rank}").write_text(type(bar).__name__)

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise ValueError("a failure on purpose")
        return super().training_step(batch, batch_idx)


class Recorder(Callback):
    """A driver callback that keeps what it saw."""

    def __init__(self) -> None:
        self.hooks: list[str] = []
        self.batches: list[tuple[int, int, int]] = []
        self.epoch_metrics: list[dict[str, float]] = []
        self.errors: list[BaseException] = []

    def setup(self, trainer, pl_module, stage):
        self.hooks.append(f"setup:{getattr(stage, 'value', stage)}")

    def teardown(self, trainer, pl_module, stage):
        self.hooks.append(f"teardown:{getattr(stage, 'value', stage)}")

    def on_train_start(self, trainer, pl_module):
        self.hooks.append("train_start")

    def on_validation_end(self, trainer, pl_module):
        self.hooks.append("sanity" if trainer.sanity_checking else "validation_end")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert outputs is None and batch is None  # those stay on the workers
        self.batches.append((trainer.current_epoch, batch_idx, trainer.global_step))

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_exception(self, trainer, pl_module, exception):
        self.errors.append(exception)


def _fit(tmp_path, strategy, callbacks=(), enable_progress_bar=True, model=None, epochs=2):
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=enable_progress_bar,
        callbacks=list(callbacks),
    )
    trainer.fit(model or BarProbe(str(tmp_path)), loader(), loader(48))
    return trainer


def _quiet_trainer(strategy) -> pl.Trainer:
    """One epoch, no bar, logger, checkpoints or summary: for the output tests."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=1,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )


def _worker_bars(tmp_path) -> list[str]:
    return [p.read_text() for p in sorted(tmp_path.glob("rank-*"))]


def test_the_tqdm_bar_runs_on_the_driver_only(ray_cluster, tmp_path, capfd):
    trainer = _fit(tmp_path, RaySGDStrategy(num_workers=2), [TQDMProgressBar()])
    captured = capfd.readouterr()
    err = captured.out + captured.err
    # 96 samples, batches of 8, two workers: 6 batches per epoch; 48 validation samples: 3
    assert "Epoch 1: 100%" in err and "6/6" in err, err[-2000:]
    assert "train_loss=" in err
    assert "Validation DataLoader 0" in err
    assert "Sanity Checking" in err
    assert _worker_bars(tmp_path) == ["NoneType", "NoneType"], "the workers run no bar"
    assert trainer.global_step == 12


def test_the_rich_bar_runs_on_the_driver(ray_cluster, tmp_path, capfd):
    _fit(tmp_path, RaySGDStrategy(num_workers=2), [RichProgressBar()])
    out = capfd.readouterr().out
    assert "Epoch 1/1" in out and "6/6" in out, out[-2000:]
    assert "train_loss" in out
    assert _worker_bars(tmp_path) == ["NoneType", "NoneType"]


def test_driver_callbacks_see_every_batch_and_the_metrics(ray_cluster, tmp_path, capfd):
    recorder = Recorder()
    trainer = _fit(tmp_path, RaySGDStrategy(num_workers=2, driver_callbacks=[recorder]), epochs=2)
    assert recorder.batches == [(e, i, 6 * e + i + 1) for e in range(2) for i in range(6)]
    assert recorder.hooks == [
        "setup:fit",
        "sanity",
        "train_start",
        "validation_end",
        "validation_end",
        "teardown:fit",
    ]
    # the last epoch's metrics, live on the driver, equal what fit brought back
    final = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert recorder.epoch_metrics[-1] == pytest.approx(final)
    assert set(final) >= {"train_loss", "val_loss", "val_acc"}
    assert recorder.errors == []


def test_without_a_bar_nothing_is_shown(ray_cluster, tmp_path, capfd):
    _fit(tmp_path, RaySGDStrategy(num_workers=2), enable_progress_bar=False, epochs=1)
    captured = capfd.readouterr()
    assert "Epoch 0" not in captured.err + captured.out


def test_a_failing_driver_callback_does_not_stop_training(ray_cluster, tmp_path, caplog):
    class Broken(Callback):
        def on_train_batch_end(self, *args):
            raise RuntimeError("display broke")

    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd._driver.replay"):
        trainer = _fit(tmp_path, RaySGDStrategy(num_workers=2, driver_callbacks=[Broken()]))
    assert trainer.global_step == 12
    assert "Broken failed in on_train_batch_end" in caplog.text


def test_driver_callbacks_hear_of_a_failure(ray_cluster, tmp_path):
    recorder = Recorder()
    with pytest.raises(ValueError, match="on purpose"):
        _fit(
            tmp_path,
            RaySGDStrategy(num_workers=2, driver_callbacks=[recorder]),
            model=BarProbe(str(tmp_path), fail_at_step=3),
        )
    assert len(recorder.errors) == 1 and isinstance(recorder.errors[0], ValueError)
    assert recorder.batches[-1][2] <= 3


def test_driver_callbacks_must_be_callbacks():
    with pytest.raises(ConfigurationError, match="driver_callbacks takes pytorch_lightning"):
        RaySGDStrategy(driver_callbacks=[print])


@pytest.mark.parametrize(
    "make",
    [
        lambda: pl.callbacks.ModelCheckpoint(),
        lambda: pl.callbacks.EarlyStopping(monitor="loss"),
        lambda: pl.callbacks.StochasticWeightAveraging(swa_lrs=0.1),
        lambda: LRCallbacks.ModelCheckpoint(),
    ],
)
def test_callbacks_that_act_on_the_training_are_refused_as_driver_callbacks(make):
    callback = make()
    strategy = RaySGDStrategy if isinstance(callback, pl.Callback) else LRaySGDStrategy
    with pytest.raises(ConfigurationError, match=f"cannot hold {type(callback).__name__}.*Trainer"):
        strategy(driver_callbacks=[callback])


def test_a_driver_callback_cannot_save_the_drivers_untrained_model(tmp_path):
    view = TrainerView(pl.Trainer(logger=False, default_root_dir=tmp_path))
    with pytest.raises(RuntimeError, match="callback given to the Trainer"):
        view.save_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def test_a_second_call_after_fit_ships_the_bar_without_its_view(ray_cluster, tmp_path, capfd):
    trainer = _fit(tmp_path, RaySGDStrategy(num_workers=2), [TQDMProgressBar()], epochs=1)
    # the bar kept the driver's view of the fit as its trainer; validate sends the bar along
    results = trainer.validate(trainer.lightning_module, loader(48))
    assert results and "val_loss" in results[0]
    captured = capfd.readouterr()
    assert "Validation DataLoader 0: 100%" in captured.out + captured.err


# made when a worker imports this module to unpickle Chatty: before the call, holding the
# original stderr, as the handlers of a user's logging set-up do
_USER_LOG = logging.getLogger("user.code")
_USER_LOG.addHandler(logging.StreamHandler())
_USER_LOG.propagate = False


class Chatty(TinyModel):
    """Prints, logs and warns on every rank; rank 0 warns before training, rank 1 after it, as
    a warning that each process gives once, where it first meets it."""

    def on_train_start(self) -> None:
        print(f"hello from rank {self.global_rank}")
        _USER_LOG.warning("a log record of rank %d", self.global_rank)
        if self.global_rank == 0:
            self._warn()

    def on_train_end(self) -> None:
        if self.global_rank == 1:
            self._warn()

    def _warn(self) -> None:
        import warnings

        warnings.warn("the same warning on every rank", UserWarning, stacklevel=1)


def test_worker_output_reaches_the_driver_tagged_with_the_rank(ray_cluster, capfd):
    pl.seed_everything(0)
    trainer = _quiet_trainer(RaySGDStrategy(num_workers=2))
    trainer.fit(Chatty(), loader())
    captured = capfd.readouterr()
    assert "[rank 0] hello from rank 0\n" in captured.out
    assert "[rank 1] hello from rank 1\n" in captured.out
    assert "[rank 0] a log record of rank 0" in captured.err
    assert "[rank 1] a log record of rank 1" in captured.err
    # the warning is the same text on both ranks, given at different moments: once
    assert captured.err.count("UserWarning: the same warning on every rank") == 1, captured.err


class MakesAHandler(TinyModel):
    """Sets up logging during the call (as logging.basicConfig in user code would), then logs."""

    def on_train_start(self) -> None:
        made = logging.getLogger("made.during.the.call")
        if not made.handlers:
            made.addHandler(logging.StreamHandler())
            made.propagate = False
        made.warning("call on pid %d", os.getpid())


class PrintingData(torch.utils.data.Dataset):
    """Prints from the DataLoader's forked worker processes."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        print(f"item {index}")
        return torch.zeros(8), torch.tensor(0)


def test_a_handler_made_during_a_call_works_on_the_next_warm_call(ray_cluster, capfd):
    def fit(model) -> str:
        trainer = _quiet_trainer(RaySGDStrategy(num_workers=2))
        trainer.fit(model, loader())
        return capfd.readouterr().err

    first, second = fit(MakesAHandler()), fit(MakesAHandler())
    assert first.count("] call on pid") == 2
    assert second.count("] call on pid") == 2, second[-2000:]


def test_prints_in_forked_dataloader_workers_do_not_block(ray_cluster):
    trainer = _quiet_trainer(RaySGDStrategy(num_workers=2, progress_timeout_s=60))
    data = torch.utils.data.DataLoader(PrintingData(), batch_size=8, num_workers=1)
    trainer.fit(TinyModel(), data)
    assert trainer.global_step == 2


def _note_on_the_driver(path: str) -> None:
    Path(path).write_text("ran")


def _leave_a_driver_call(call_id: str, path: str) -> None:
    """Runs on a worker: what send_to_driver leaves in the outbox (a Tune report, say)."""
    from ray import cloudpickle

    from ray_lightning_sgd._boundary.channels import CALL, EVENTS
    from ray_lightning_sgd._worker_group.outbox import get_outbox

    get_outbox().open(call_id)
    event = (CALL, (_note_on_the_driver, (path,)), {}, None)
    get_outbox().append(EVENTS, [cloudpickle.dumps([event])])


def test_after_a_failure_no_queued_driver_call_runs(free_cluster, tmp_path):
    from ray_lightning_sgd import WorkerGroup, WorkerGroupConfig
    from ray_lightning_sgd._driver.inbox import RunInbox
    from ray_lightning_sgd._driver.replay import DriverReplay
    from ray_lightning_sgd._driver.run import Run

    marker = tmp_path / "ran"
    group = WorkerGroup(WorkerGroupConfig(num_workers=1))
    group.start()
    try:
        # rank 0 sent a function to run on the driver, then the attempt failed
        group.execute(_leave_a_driver_call, "failed", str(marker))
        inbox = RunInbox(DriverReplay(pl.Trainer(logger=False), []), None, Run())
        inbox.attach(group, "failed")
        inbox.abandon()
        inbox.replay.fail(RuntimeError("a rank failed"))
        assert not marker.exists(), "a failed call ran a function its workers had sent"
        # the same mail after a success does run: the check above could fail
        group.execute(_leave_a_driver_call, "succeeded", str(marker))
        inbox.attach(group, "succeeded")
        inbox.finish()
        assert marker.read_text() == "ran"
    finally:
        group.shutdown()


class SlowSteps(TinyModel):
    """Steps slower than the forwarding interval; rank 0 notes each step's loss in ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def training_step(self, batch, batch_idx):
        import time

        time.sleep(0.3)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_rank == 0:
            loss = float(self.trainer.callback_metrics["train_loss"])  # on step: no sync
            with open(self.path, "a") as file:
                file.write(f"{self.global_step} {loss!r}\n")


class StepLosses(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((trainer.global_step, float(trainer.callback_metrics["train_loss"])))


def test_with_slow_steps_each_batch_end_shows_its_own_loss(ray_cluster, tmp_path):
    path = tmp_path / "losses"
    recorder = StepLosses()
    strategy = RaySGDStrategy(num_workers=2, driver_callbacks=[recorder])
    _fit(tmp_path, strategy, model=SlowSteps(str(path)), enable_progress_bar=False, epochs=1)
    on_rank_0 = [
        (int(step), float(loss)) for step, loss in map(str.split, path.read_text().splitlines())
    ]
    assert len(on_rank_0) == 6
    # each batch's end reaches the driver with that batch's loss, not the one before
    assert recorder.seen == on_rank_0


def _hand_over_a_resume_point(call_id: str, size: int) -> bool:
    """Runs on a worker, as rank 0's resume checkpoint callback does: puts a point of ``size``
    bytes in the outbox and waits until the driver holds it."""
    from ray_lightning_sgd._boundary.channels import RESUME
    from ray_lightning_sgd._boundary.resume_points import ResumePoint
    from ray_lightning_sgd._worker_group.outbox import get_outbox

    outbox = get_outbox()
    outbox.open(call_id)
    sequence = outbox.put_latest(RESUME, ResumePoint(3, 42, data=b"\x07" * size))
    return outbox.wait_delivered(RESUME, sequence, timeout_s=120)


def test_a_large_resume_point_ends_up_in_the_drivers_memory(free_cluster):
    """No fixed timeout on reading it back at a restart: the driver already holds its bytes,
    and they outlive every worker."""
    import ray

    from ray_lightning_sgd import WorkerGroup, WorkerGroupConfig
    from ray_lightning_sgd._driver.inbox import RunInbox
    from ray_lightning_sgd._driver.run import Run

    size = 256 * 2**20
    group = WorkerGroup(WorkerGroupConfig(num_workers=1))
    group.start()
    try:
        run = Run()
        inbox = RunInbox(None, None, run)
        inbox.attach(group, "call")
        [ref] = group.execute_async(_hand_over_a_resume_point, "call", size)
        while not ray.wait([ref], timeout=0.05)[0]:
            inbox.pump()
        assert ray.get(ref) is True, "rank 0 went on before the driver held its checkpoint"
    finally:
        group.shutdown()  # every worker is gone now
    point = run.resume
    assert point is not None and (point.epoch, point.global_step) == (3, 42)
    assert len(point.data) == size and point.data[:1] == point.data[-1:] == b"\x07"


class _SlowOnTheDriver(Callback):
    """A driver callback slower than the progress timeout (a Tune report copying a checkpoint)."""

    def on_train_start(self, trainer, pl_module):
        import time

        time.sleep(5)


def test_the_drivers_own_slow_callbacks_are_no_ranks_silence(ray_cluster, tmp_path):
    # the ranks report every 0.3 s step; the driver alone is busy for longer than the timeout,
    # and the workers are still training when it is done. Warm workers first: a cold worker's
    # imports before its first report would take a tight timeout's time by themselves
    _fit(tmp_path, RaySGDStrategy(num_workers=2), enable_progress_bar=False, epochs=1)
    strategy = RaySGDStrategy(
        num_workers=2, progress_timeout_s=3, driver_callbacks=[_SlowOnTheDriver()]
    )
    trainer = _fit(
        tmp_path, strategy, enable_progress_bar=False, model=SlowSteps(str(tmp_path / "losses")),
        epochs=3,
    )  # fmt: skip
    assert trainer.current_epoch == 3


def test_a_line_every_rank_prints_alike_is_printed_once_whenever_each_prints_it(capsys):
    printer = OutputPrinter()
    printer.write(0, [("stderr", "W: once per process"), ("stdout", "epoch 0")])
    for epoch in range(1, 50):  # much other output in between
        printer.write(0, [("stdout", f"epoch {epoch}")])
    printer.write(1, [("stdout", "epoch 0"), ("stderr", "W: once per process")])
    printer.write(0, [("stderr", "W: once per process")])  # rank 0 gives it a second time
    out, err = capsys.readouterr()
    assert err.count("W: once per process") == 2, err
    assert "[rank 0] epoch 0\n" in out and "[rank 1] epoch 0" not in out
