"""Real failures: a worker's process exits or is killed, a rank stalls; restarts resume the run."""

from __future__ import annotations

import csv
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import pytorch_lightning as pl
import ray
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ray_lightning_sgd import (
    ConfigurationError,
    RaySGDStrategy,
    WorkerDiedError,
    WorkerTimeoutError,
)
from ray_lightning_sgd._driver import inbox
from ray_lightning_sgd._serialization import Packed, in_band
from ray_lightning_sgd._worker.resume import ResumeCheckpointBase
from tests.conftest import leftovers
from tests.helpers import TinyModel, hang_reports, loader, quiet_trainer_kwargs


def wait_for_file(pattern: str, timeout_s: float = 60) -> None:
    """Waits until a file matches the glob ``pattern``, then 2 s more: a resume checkpoint is
    uploaded in the background, and the driver takes its point at once after (until then a
    lost rank restarts the fit from the point before)."""
    import glob

    deadline = time.monotonic() + timeout_s
    while not glob.glob(pattern):
        assert time.monotonic() < deadline, f"nothing matched {pattern} in {timeout_s}s"
        time.sleep(0.05)
    time.sleep(2)


class Faulty(TinyModel):
    """Exits (os._exit) or stalls on one rank at one global step, once if ``marker`` is given;
    with ``after``, once a file matches that glob pattern (see :func:`wait_for_file`)."""

    def __init__(
        self, rank: int, step: int, how: str = "exit", marker: str | None = None,
        after: str | None = None,
    ):  # fmt: skip
        super().__init__()
        self.fault = (rank, step, how, marker)
        self.after = after

    def training_step(self, batch, batch_idx):
        rank, step, how, marker = self.fault
        if self.global_rank == rank and self.global_step == step:
            if marker is None or not os.path.exists(marker):
                if self.after is not None:
                    wait_for_file(self.after)
                if marker is not None:
                    open(marker, "w").close()
                if how == "exit":
                    os._exit(3)
                time.sleep(3600)  # a rank that hangs; the others wait in the next allreduce
        return super().training_step(batch, batch_idx)


def _trainer(strategy, max_epochs=3, **kwargs):
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=max_epochs,
        enable_checkpointing=False,
        **{**quiet_trainer_kwargs(), **kwargs},
    )


def _fit(model, strategy, **kwargs):
    pl.seed_everything(0)
    trainer = _trainer(strategy, **kwargs)
    trainer.fit(model, loader(shuffle=True))
    return trainer


def test_a_worker_that_exits_fails_the_fit_within_seconds_unretried(ray_cluster, tmp_path):
    # the worker exits once only: without max_failures the fit fails all the same (a restart
    # would have trained to the end)
    marker = str(tmp_path / "failed-once")
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as caught:
        _fit(Faulty(rank=1, step=3, marker=marker), RaySGDStrategy(num_workers=2))
    assert time.monotonic() - start < 30  # start-up included; detection itself is below
    assert os.path.exists(marker)
    err = caught.value
    assert err.rank == 1 and len(err.node_id) > 8
    assert "rank 1" in str(err) and "died" in str(err)
    assert leftovers() == ([], [])


def test_a_killed_actor_fails_the_fit_within_10_seconds(ray_cluster, tmp_path):
    started = tmp_path / "training"

    class Slow(TinyModel):
        def training_step(self, batch, batch_idx):
            started.touch()
            time.sleep(0.2)
            return super().training_step(batch, batch_idx)

    killed_at: list[float] = []

    def kill_rank_0() -> None:
        while True:
            names = [n for n in leftovers()[0] if n.endswith("-0")]
            if names:
                break
            time.sleep(0.2)
        while not started.exists():
            time.sleep(0.1)
        time.sleep(1)  # training is under way
        actor = ray.get_actor(names[0], namespace=ray.get_runtime_context().namespace)
        killed_at.append(time.monotonic())
        ray.kill(actor, no_restart=True)

    killer = threading.Thread(target=kill_rank_0, daemon=True)
    killer.start()
    with pytest.raises(WorkerDiedError) as caught:
        _fit(Slow(), RaySGDStrategy(num_workers=2, reuse_workers=False), max_epochs=50)
    assert time.monotonic() - killed_at[0] < 10
    assert caught.value.rank == 0
    assert leftovers() == ([], [])


def test_a_stalled_rank_is_reported_by_the_progress_timeout(ray_cluster, caplog):
    # the report's window longer than a start on a loaded machine (a quiet start is reported
    # too, and progress after it re-arms the report: 2 s once gave two reports in CI)
    strategy = RaySGDStrategy(num_workers=2, progress_timeout_s=6, hang_report_after_s=3)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"),
        pytest.raises(WorkerTimeoutError, match=r"rank 1 \(node [0-9a-f]+.*silent for") as caught,
    ):
        _fit(Faulty(rank=1, step=2, how="stall"), strategy)
    assert time.monotonic() - started < 40
    assert "progress_timeout_s=6" in str(caught.value)
    # the hang report came first, once; the error carries every rank's stack
    assert hang_reports(caplog.text, "in hook training_step") == 1, caplog.text
    stalled, waiting = caught.value.stacks[1], caught.value.stacks[0]
    assert stalled.stack.hook == "training_step" and stalled.stack.collective is None
    assert stalled.stack.user_frame.endswith("in training_step")  # Faulty's, in this file
    assert __file__ in stalled.stack.user_frame
    assert waiting.stack.collective is not None, str(waiting)  # rank 0 waits for rank 1
    assert "ranks in no collective: 1 (the others wait for these" in str(caught.value)
    assert leftovers() == ([], [])


def test_a_restart_resumes_and_ends_as_the_run_without_failure(ray_cluster, tmp_path, caplog):
    # both models start from the same weights, whatever the tests before left in the RNG
    pl.seed_everything(0)
    reference = TinyModel()
    expected = _fit(reference, RaySGDStrategy(num_workers=2))
    marker = str(tmp_path / "failed-once")
    pl.seed_everything(0)
    model = Faulty(rank=1, step=8, marker=marker)  # 6 steps an epoch: in the second epoch
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        got = _fit(model, RaySGDStrategy(num_workers=2, max_failures=1))
    assert os.path.exists(marker), "the failure was not injected"
    assert "Restart 1 (of max_failures=1)" in caplog.text
    assert "resumes after epoch 0 (global step 6)" in caplog.text
    assert (got.global_step, got.current_epoch) == (expected.global_step, expected.current_epoch)
    diff = max(
        (model.state_dict()[k] - v).abs().max().item() for k, v in reference.state_dict().items()
    )
    assert diff <= 1e-6, f"resumed weights differ by {diff}"
    # as after ddp's fit without a ckpt_path: not the path of our resume checkpoint
    assert got.ckpt_path is None


class Terminated(TinyModel):
    """Sends SIGTERM to rank 1's own process at one step, once: a spot node's notice."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def training_step(self, batch, batch_idx):
        step = 0.25  # the ranks exchange notices about every 0.5 s, here every step or two
        if self.global_rank == 1 and self.global_step == 8 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGTERM)
            # a step longer than the 3 s the worker waits for the driver to hold its notice:
            # no exchange of notices (at step boundaries) can tell the driver in time
            step = 3.5
        time.sleep(step)
        return super().training_step(batch, batch_idx)


def test_a_worker_terminated_by_sigterm_checkpoints_at_that_step(
    ray_cluster, tmp_path, caplog, monkeypatch
):
    # rank 1 polled every 2 minutes, as a rank of a group of 1,000 is every 100 s: its notice
    # reaches the driver within the 3 s its worker waits through the news question alone
    monkeypatch.setattr(inbox, "OTHER_RANKS_PER_S", 1 / 120)
    pl.seed_everything(0)
    reference = TinyModel()
    _fit(reference, RaySGDStrategy(num_workers=2), max_epochs=2)
    marker = str(tmp_path / "terminated")
    pl.seed_everything(0)
    model = Terminated(marker)
    # max_failures=0 and no resume checkpoints: a preemption restarts (no limit) from the
    # checkpoint rank 0 writes where the notice arrived; validation after every batch
    logger = CSVLogger(tmp_path / "logs")
    pl.seed_everything(0)
    got = _trainer(
        RaySGDStrategy(num_workers=2), max_epochs=2, logger=logger, log_every_n_steps=1,
        val_check_interval=1,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        got.fit(model, loader(shuffle=True), loader(n=32))
    assert os.path.exists(marker), "no SIGTERM was sent"
    assert "rank 1 (node " in caplog.text and "received SIGTERM" in caplog.text
    assert "Restart 1 (no limit) after a preemption" in caplog.text, caplog.text
    # 6 steps an epoch; the notice came in step 8: the ranks learn of it at the next exchange
    # (every step or two here) after the handler ran (in the worker's main thread)
    where = re.search(
        r"fit resumes in epoch 1 after (\d+) batches \(global step (\d+)\)", caplog.text
    )
    assert where is not None, caplog.text
    batches, step = int(where[1]), int(where[2])
    assert 8 < step <= 11 and batches == step - 6, where[0]
    assert got.global_step == 12
    # one log: every step's row once (Lightning's counts go on from the checkpoint's), and a
    # validation after every batch, once (the one before the checkpoint is not run again)
    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["step"]) for row in rows if row["train_loss"]] == list(range(12))
    validated = [int(row["step"]) for row in rows if row["val_loss"]]
    assert len(validated) == 12 and validated == sorted(set(validated)), validated
    diff = max(
        (model.state_dict()[k] - v).abs().max().item() for k, v in reference.state_dict().items()
    )
    assert diff <= 1e-6, f"the restarted run's weights differ by {diff}"


def test_a_sigterm_while_the_payload_reaches_the_worker_is_a_preemption(
    ray_cluster, tmp_path, monkeypatch
):
    # the call's payload comes into being only once the test released it, after it sent rank 1
    # SIGTERM while rank 1 waited for it: a worker in its call, not an idle one (which ends as
    # Ray's handler ends it, a loss counted against max_failures)
    released = str(tmp_path / "released")

    @ray.remote(num_cpus=0)
    def once_released(packed: Packed) -> Packed:
        """The payload, once the file exists: as slow to reach the workers as the test wants
        (a large Trainer from another node takes seconds)."""
        deadline = time.monotonic() + 120
        while not os.path.exists(released) and time.monotonic() < deadline:
            time.sleep(0.05)
        return packed

    put = ray.put

    def put_late(value, **kwargs):
        if isinstance(value, Packed):  # the launcher's payload
            return once_released.remote(in_band(value))
        return put(value, **kwargs)

    monkeypatch.setattr(ray, "put", put_late)
    # max_preemptions=0: the fit fails at the loss, which says whether it was a preemption
    trainer = _trainer(RaySGDStrategy(num_workers=2, max_preemptions=0), max_epochs=1)
    launcher = trainer.strategy._launcher
    stacks: list[str] = []

    def terminate_rank_1() -> None:
        try:  # up to 2 minutes: new workers start and import Lightning in their call first
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                attempt = launcher._attempt
                executor = None if attempt is None or not attempt.refs else attempt.executor
                if executor is not None:
                    group = executor.worker_group
                    try:  # a question put behind a call that waits for its arguments waits too
                        stack = ray.get(group.stack_async(1), timeout=2)
                    except ray.exceptions.GetTimeoutError:
                        continue
                    # rank 1 in its call, waiting for the payload
                    if stack is not None and re.search(r"payload\.py.*in fetch", stack.text):
                        stacks.append(stack.text)
                        os.kill(group.metadata[1].pid, signal.SIGTERM)
                        time.sleep(1.0)  # the worker's handler runs; the driver takes the notice
                        return
                time.sleep(0.05)
        finally:
            Path(released).touch()

    thread = threading.Thread(target=terminate_rank_1, daemon=True)
    thread.start()
    pl.seed_everything(0)
    caught: WorkerDiedError | None = None
    try:
        trainer.fit(TinyModel(), loader())
    except WorkerDiedError as err:
        caught = err
    finally:
        thread.join()
    assert stacks, "rank 1 was never seen in its call, waiting for its payload"
    assert caught is not None, "the fit ended well: rank 1's SIGTERM did not end its worker"
    assert caught.rank == 1 and caught.preempted, caught
    assert "received SIGTERM before: counted as a preemption" in str(caught.__notes__)


@pytest.mark.parametrize(
    ("trained_on", "resumed_on", "batches"), [(2, 2, 2), (2, 2, 0), (2, 1, 2), (4, 2, 2), (2, 3, 2)]
)
def test_an_epoch_resumed_inside_deals_the_samples_it_had_not_trained(
    trained_on, resumed_on, batches
):
    """What a restart from a preemption's checkpoint feeds each rank: the rest of the epoch's
    order (the shuffling sampler set to that epoch, which Lightning sets only later: also when
    nothing is skipped), on the same or another number of workers; later epochs whole."""
    dataset, epoch, batch_size = TensorDataset(torch.arange(96)), 3, 4

    def loader_of(rank: int, world: int) -> DataLoader:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=5)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    def samples(dataloader: DataLoader) -> list[int]:
        return [int(value) for (batch,) in dataloader for value in batch]

    trained: set[int] = set()
    for rank in range(trained_on):
        dataloader = loader_of(rank, trained_on)
        dataloader.sampler.set_epoch(epoch)
        trained |= set(samples(dataloader)[: batches * batch_size])
    rest: list[int] = []
    for rank in range(resumed_on):
        dataloader = loader_of(rank, resumed_on)  # its sampler at epoch 0, as Lightning has it
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
        trainer.fit_loop.epoch_progress.current.completed = epoch  # as restored
        counts = trainer.fit_loop.epoch_loop.batch_progress.current
        counts.ready = counts.started = counts.processed = counts.completed = batches
        callback = ResumeCheckpointBase(0, None)
        callback.load_state_dict({"batches": batches, "replicas": trained_on})
        callback.resume_inside_epoch(dataloader, trainer)
        got = samples(dataloader)
        rest += got
        # this rank's share of the epoch's order, from where its data resumes; Lightning
        # counts the epoch's batches from there
        share = (batches * trained_on) // resumed_on
        ordered = loader_of(rank, resumed_on)
        ordered.sampler.set_epoch(epoch)
        assert got == samples(ordered)[share * batch_size :]
        assert counts.completed == share
        assert len(samples(dataloader)) == 96 // resumed_on, "the next epoch is not whole"
    untrained = set(range(96)) - trained
    if (batches * trained_on) % resumed_on == 0:
        assert sorted(rest) == sorted(untrained)
    else:  # rounded down to whole batches: less than a batch a rank is trained twice
        assert set(rest) >= untrained
        assert 0 < len(rest) - len(untrained) < resumed_on * batch_size


def test_no_in_epoch_checkpoint_where_steps_would_not_resume_as_they_went_on():
    """A stateful DataLoader (its saved position is a batch ahead of a batch's start) and a
    GradientAccumulationScheduler (set at an epoch's start, which a resumed epoch skips)."""
    from pytorch_lightning.callbacks import GradientAccumulationScheduler
    from pytorch_lightning.utilities import CombinedLoader

    from ray_lightning_sgd._worker.resumed_fit import _steps_resume_inside

    class Stateful(DataLoader):
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def trainer_with(dataloader, **kwargs):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, **kwargs)
        trainer.fit_loop._combined_loader = CombinedLoader(dataloader)
        return trainer

    assert _steps_resume_inside(trainer_with(loader()))
    assert not _steps_resume_inside(trainer_with(Stateful(TensorDataset(torch.arange(8)))))
    scheduler = GradientAccumulationScheduler({0: 2})
    assert not _steps_resume_inside(trainer_with(loader(), callbacks=[scheduler]))


def test_a_resume_checkpoint_in_storage(ray_cluster, tmp_path, caplog):
    marker = str(tmp_path / "failed-once")
    storage = tmp_path / "resume"
    strategy = RaySGDStrategy(num_workers=2, max_failures=1, checkpoint_storage=str(storage))
    logger = CSVLogger(tmp_path / "logs")
    pl.seed_everything(0)
    trainer = _trainer(strategy, logger=logger, log_every_n_steps=1)
    model = Faulty(rank=0, step=8, marker=marker, after=str(storage / "*" / "*epoch=0*.ckpt"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        trainer.fit(model, loader(shuffle=True), loader(n=32))
    assert trainer.global_step == 18
    assert "Restart 1 (of max_failures=1) after a worker failure" in caplog.text, caplog.text
    assert "fit resumes after epoch 0 (global step 6)" in caplog.text
    # the weights the restarted attempt trained are the driver's
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the restarted attempt logs on in the first one's folder, which keeps the rows before the
    # checkpoint (Lightning's CSV writer would delete them) and not those trained again; its
    # validation rows have columns of their own, which the file keeps
    assert [p.name for p in (tmp_path / "logs" / "lightning_logs").iterdir()] == ["version_0"]
    assert logger.version == 0
    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["step"]) for row in rows if row["train_loss"]] == list(range(18))
    assert [int(row["epoch"]) for row in rows if row["val_loss"]] == [0, 1, 2]
    # the run's own folder of the storage held it; a run that succeeded leaves nothing there
    assert list(storage.rglob("*.ckpt")) == []
    assert trainer.ckpt_path is None  # not the deleted resume checkpoint's path (ddp: None)


def test_runs_sharing_a_checkpoint_storage_keep_their_own_checkpoints(
    ray_cluster, tmp_path, caplog
):
    storage = tmp_path / "resume"

    def strategy() -> RaySGDStrategy:
        return RaySGDStrategy(num_workers=2, max_failures=1, checkpoint_storage=str(storage))

    # the first run fails at step 8 on every attempt: the first restart is allowed, the second
    # failure is raised, and the run leaves its checkpoint
    with (
        caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"),
        pytest.raises(WorkerDiedError),
    ):
        _fit(Faulty(rank=0, step=8), strategy())
    assert caplog.text.count("Restart 1 (of max_failures=1)") == 1, caplog.text
    assert "Restart 2" not in caplog.text
    left = {path: path.read_bytes() for path in storage.rglob("*.ckpt")}
    assert len(left) == 1
    # a second run (another Tune trial, say) with the same storage must not overwrite it
    assert _fit(TinyModel(), strategy()).global_step == 18
    assert {path: path.read_bytes() for path in storage.rglob("*.ckpt")} == left


class LostAtTheEnd(TinyModel):
    """In the first attempt, rank 1's process exits in ``on_fit_end`` once rank 0 reached its
    own, which Lightning calls after every callback's: the fit is over, the results not back."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def on_fit_end(self) -> None:
        lost, at_end = Path(self.folder, "rank-1-lost"), Path(self.folder, "rank-0-at-the-end")
        if lost.exists():
            return
        if self.global_rank == 0:
            at_end.touch()
            return
        deadline = time.monotonic() + 60
        while not at_end.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        wait_for_file(str(Path(self.folder, "resume", "*", "*epoch=2*.ckpt")))
        lost.touch()
        os._exit(3)


def test_a_rank_lost_after_the_fit_ended_restarts_from_the_storage_then_empties_it(
    ray_cluster, tmp_path, caplog
):
    storage = tmp_path / "resume"
    strategy = RaySGDStrategy(num_workers=2, max_failures=1, checkpoint_storage=str(storage))
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        trainer = _fit(LostAtTheEnd(str(tmp_path)), strategy)
    assert (tmp_path / "rank-1-lost").exists()
    assert "Restart 1 (of max_failures=1)" in caplog.text, caplog.text
    assert "fit resumes after epoch 2 (global step 18)" in caplog.text, caplog.text
    assert trainer.global_step == 18 and trainer.current_epoch == 3
    # the launch's own folder went once the call succeeded, not before
    assert list(storage.iterdir()) == []


def test_a_checkpoint_of_two_workers_resumes_on_one(ray_cluster, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    pl.seed_everything(0)
    first = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2),
        accelerator="cpu",
        max_epochs=1,
        callbacks=[checkpoint],
        **quiet_trainer_kwargs(),
    )
    first.fit(TinyModel(), loader())
    assert first.global_step == 6
    second = _trainer(RaySGDStrategy(num_workers=1), max_epochs=2)
    second.fit(TinyModel(), loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert second.current_epoch == 2
    assert second.global_step == 6 + 12  # one worker takes every batch of the second epoch


def test_repeated_calls_leave_nothing_behind(ray_cluster):
    process = psutil.Process()
    model = TinyModel()
    trainer = _trainer(RaySGDStrategy(num_workers=2), max_epochs=1)
    trainer.fit(model, loader())
    fds, rss = process.num_fds(), process.memory_info().rss
    for _ in range(5):
        trainer = _trainer(RaySGDStrategy(num_workers=2), max_epochs=1)
        trainer.fit(model, loader())
        trainer.validate(model, loader(n=40), verbose=False)
    actors, groups = leftovers()
    assert len(actors) == 2 and len(groups) == 1, (
        "only the one warm group may stay: no helper actor"
    )
    assert process.num_fds() - fds <= 5
    assert process.memory_info().rss - rss < 100 * 2**20


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_failures": -2}, "max_failures must be an int >= 0, or -1"),
        ({"max_failures": 1.5}, "max_failures must be an int"),
        ({"progress_timeout_s": 0}, "progress_timeout_s must be a number of seconds > 0"),
        ({"checkpoint_every_n_epochs": 0}, "checkpoint_every_n_epochs must be an int >= 1"),
        ({"checkpoint_storage": ""}, "checkpoint_storage must be a path or fsspec URI"),
        ({"run_name": "digits"}, "run_name='digits' needs checkpoint_storage"),
        ({"run_name": "../up", "checkpoint_storage": "/r"}, "run_name must be a folder name"),
        ({"keep_last": 0}, "keep_last must be an int >= 1"),
        ({"max_preemptions": -2}, "max_preemptions must be an int >= 0, or -1"),
    ],
)
def test_bad_failure_settings_fail_in_the_constructor(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        RaySGDStrategy(num_workers=2, **kwargs)


def test_a_restart_before_any_checkpoint_starts_over_and_its_weights_are_the_drivers(
    ray_cluster, tmp_path, caplog
):
    # rank 1 exits at step 2, in epoch 0: no resume checkpoint yet; max_failures=-1, no limit
    marker = str(tmp_path / "failed-once")
    model = Faulty(rank=1, step=2, marker=marker)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        trainer = _fit(model, RaySGDStrategy(num_workers=2, max_failures=-1), max_epochs=1)
    assert os.path.exists(marker), "the failure was not injected"
    assert "Restart 1 (no limit) after a worker failure" in caplog.text, caplog.text
    assert "fit starts over: no resume checkpoint was written yet" in caplog.text
    assert trainer.global_step == 6
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
