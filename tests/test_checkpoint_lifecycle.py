"""Nothing lost, whatever fails: a resume checkpoint's life (write, rename, deliver, delete the
older ones, copy on a worker's node) and a named run's run.json, each cut at its step by a
kill or a full disk; what is left always resumes, and no temporary file stays.

Most steps are tested as logic over a real file system (a small tmpfs for a full disk) with a
fake Trainer and outbox; two fits check the same on real workers."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import _atomic_save

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy, WorkerDiedError, _files
from ray_lightning_sgd import _scratch as scratch
from ray_lightning_sgd._boundary import resume_points
from ray_lightning_sgd._boundary.resume_points import (
    ResumePoint,
    checkpoint_name,
    newest_complete_point,
)
from ray_lightning_sgd._driver import runs
from ray_lightning_sgd._worker import resume, resume_from, resumed_fit
from ray_lightning_sgd._worker.resume import BatchStartBase, ResumeCheckpointBase
from ray_lightning_sgd.exceptions import RaySGDError
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]


def _temp_files() -> set[str]:
    """The temporary files of ours (other processes share the folder)."""
    return {
        name
        for name in os.listdir(tempfile.gettempdir())
        if name.startswith(scratch.PREFIX) or name.endswith(_files.TEMP_SUFFIX)
    }


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB file system of its own: a disk that fills."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class _Killed(BaseException):
    """Stands for the process's end at that step (nothing after it runs)."""


class _Outbox:
    """The worker's outbox as rank 0 sees it: the driver takes each point, or does not in time,
    or rank 0 dies while it waits."""

    def __init__(self, delivered: bool | None = True) -> None:
        self.delivered = delivered  # None: killed while waiting
        self.points: list[ResumePoint] = []

    def put_latest(self, channel: str, point: ResumePoint) -> int:
        self.points.append(point)
        return len(self.points)

    def wait_delivered(self, channel: str, sequence: int, timeout_s: float) -> bool:
        if self.delivered is None:
            raise _Killed
        return self.delivered


def _trainer(epoch: int, size: int = 1000) -> SimpleNamespace:
    """What ResumeCheckpointBase reads of a Trainer; saves through its strategy's checkpoint
    writer, Lightning's own, as Trainer.save_checkpoint does."""
    step = 6 * (epoch + 1)
    writer = TorchCheckpointIO()

    def save_checkpoint(path: str) -> None:
        writer.save_checkpoint({"epoch": epoch, "w": torch.full((size,), float(epoch))}, path)

    return SimpleNamespace(
        current_epoch=epoch, global_step=step, global_rank=0, loggers=[],
        should_stop=False, max_epochs=None, max_steps=-1,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step)),
        strategy=SimpleNamespace(resume_checkpoints=contextlib.nullcontext, checkpoint_io=writer),
        save_checkpoint=save_checkpoint,
    )  # fmt: skip


def _save(storage: Path, epoch: int, outbox: _Outbox, keep_last: int = 1, size: int = 1000):
    """Saves as rank 0 does, and waits for the checkpoint's upload: raises what failed there."""
    callback = ResumeCheckpointBase(1, str(storage), keep_last=keep_last)
    return _save_with(callback, _trainer(epoch, size))


def _save_with(callback: ResumeCheckpointBase, trainer: Any, outbox: _Outbox | None = None):
    """Saves as rank 0 does, and waits for the checkpoint's send: raises what failed there.
    With ``outbox``: the point as the driver receives it (with the bytes, for the driver)."""
    point = callback._save(trainer)
    callback.uploads.wait()
    failure = callback.uploads.failure()
    if failure is not None:
        raise failure[1]
    return point if outbox is None else outbox.points[-1]


def _names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_a_full_disk_while_writing_keeps_the_last_whole_checkpoint(tmpfs, monkeypatch):
    before = _temp_files()
    outbox = _Outbox()
    monkeypatch.setattr(resume, "get_outbox", lambda: outbox)
    storage = tmpfs / "run"
    _save(storage, 0, outbox, size=200_000)  # 0.8 MB
    _files.write_atomically(str(storage / "run.json"), json.dumps({"model": "m"}))
    # epoch 1's checkpoint does not fit: the write fails, leaving no part of it
    with pytest.raises(OSError, match="No space left"):
        _save(storage, 1, outbox, size=400_000)
    assert _names(storage) == ["resume-epoch=0-step=6.ckpt", "run.json"]
    # nor does a new run.json: the old one stays whole
    with pytest.raises(OSError, match="No space left"):
        _files.write_atomically(str(storage / "run.json"), "x" * 3_000_000)
    assert _names(storage) == ["resume-epoch=0-step=6.ckpt", "run.json"]
    assert json.loads((storage / "run.json").read_text()) == {"model": "m"}
    point = runs.resume_named_run(str(storage), "run", {"model": "m"})
    assert point is not None and point.epoch == 0
    assert torch.load(str(point.uri))["epoch"] == 0
    # a local copy of a checkpoint too big for the node's temporary folder leaves no part
    monkeypatch.setattr(tempfile, "tempdir", str(tmpfs))
    with pytest.raises(OSError, match="No space left"):
        resume_from.materialise(ResumePoint(1, 12, data=b"x" * 3_000_000))
    assert [n for n in os.listdir(tmpfs) if n.startswith(scratch.PREFIX)] == []
    monkeypatch.undo()
    assert _temp_files() - before == set()  # nothing new stays (older leftovers may go)


def test_copies_of_rank_0s_files_on_a_full_disk_leave_the_old_ones_whole(tmpfs):
    """The driver writes the files rank 0 wrote on another node (its best checkpoint, which a
    later ``test(ckpt_path="best")`` loads) whole or not at all."""
    from ray_lightning_sgd._driver import artifacts

    best = tmpfs / "checkpoints" / "best.ckpt"
    artifacts.write({str(best): b"epoch 0" * 1000})
    with pytest.raises(OSError, match="No space left"):
        artifacts.write({str(best): b"x" * 3_000_000})
    assert best.read_bytes() == b"epoch 0" * 1000
    assert os.listdir(best.parent) == ["best.ckpt"]


def test_a_checkpoint_cut_short_is_passed_over_with_a_warning(tmp_path, caplog):
    storage = tmp_path / "run"
    storage.mkdir()
    whole = storage / checkpoint_name(0, 6)
    torch.save({"w": torch.ones(1000)}, whole)
    cut = storage / checkpoint_name(1, 12)
    cut.write_bytes(whole.read_bytes()[:2000])  # a copy that stopped early (a full disk)
    (storage / checkpoint_name(2, 18)).write_bytes(b"")  # a file made, never written
    leftover = storage / _files.temp_name(checkpoint_name(3, 24), unique=False)
    leftover.write_bytes(b"PK")  # what a writer killed before its rename left
    assert [p.epoch for p in resume_points.stored_points(str(storage))] == [0, 1, 2]
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        point = runs.resume_named_run(str(storage), "run", {"model": "m"})
    assert point is not None and point.uri == str(whole)
    assert f"{cut} is damaged" in caplog.text and "is empty" in caplog.text
    assert not leftover.exists(), "the killed writer's temporary file stayed"
    # a restart whose point's file is damaged or gone resumes from the newest whole one
    held = ResumePoint(2, 18, uri=str(storage / checkpoint_name(2, 18)), logged_step=18)
    fallback = resume_points.resolve(held)
    assert (fallback.epoch, fallback.uri, fallback.logged_step) == (0, str(whole), 6)
    gone = ResumePoint(5, 36, uri=str(storage / checkpoint_name(5, 36)))
    assert resume_points.resolve(gone).uri == str(whole)
    # none whole: the error says which files to delete
    whole.unlink()
    with pytest.raises(ConfigurationError, match=r"every resume checkpoint .* is damaged .*Delete"):
        runs.resume_named_run(str(storage), "run", {"model": "m"})
    with pytest.raises(RaySGDError, match="holds no other whole resume checkpoint"):
        resume_points.resolve(held)
    # a zip's first bytes only, and a file of zeros (written, never flushed before a crash), are
    # damaged; a file of another format is taken as it is
    for content, problem in [
        (b"PK\x03", "is damaged (truncated)"),
        (bytes(4096), "is damaged (zeros where it starts"),
        (bytes(10), "is damaged (zeros where it starts"),
    ]:
        (tmp_path / "odd.ckpt").write_bytes(content)
        assert str(resume_points.checkpoint_problem(str(tmp_path / "odd.ckpt"))).startswith(problem)
    (tmp_path / "odd.ckpt").write_bytes(b"\x80\x02}q\x00." + bytes(4096))  # a legacy pickle
    assert resume_points.checkpoint_problem(str(tmp_path / "odd.ckpt")) is None
    # the check reads the archive's directory only: a 40 MB checkpoint's as fast as a tiny one's
    big = tmp_path / "big.ckpt"
    torch.save({"w": torch.zeros(10_000_000)}, big)
    started = time.perf_counter()
    assert resume_points.checkpoint_problem(str(big)) is None
    assert time.perf_counter() - started < 0.5  # reading it whole takes seconds on a loaded disk


@pytest.mark.parametrize("delivered", [True, False, None])
def test_older_checkpoints_go_only_once_the_driver_holds_the_new_one(
    tmp_path, monkeypatch, delivered
):
    """keep_last=1. Delivered: the older one goes. Not delivered in time: it stays until the next
    checkpoint is delivered. Rank 0 killed while it waits: both stay; the restart from what the
    driver holds (the older one) finds it, and a new driver resumes from the newer one."""
    storage = tmp_path / "run"
    outbox = _Outbox()
    monkeypatch.setattr(resume, "get_outbox", lambda: outbox)
    held = _save(storage, 0, outbox)
    outbox.delivered = delivered
    with contextlib.nullcontext() if delivered is not None else pytest.raises(_Killed):
        _save(storage, 1, outbox)
    newest = ["resume-epoch=1-step=12.ckpt"]
    assert _names(storage) == (newest if delivered else ["resume-epoch=0-step=6.ckpt", *newest])
    if not delivered:
        assert resume_points.resolve(held) == held
    point, damaged = newest_complete_point(str(storage))
    assert point is not None and (point.epoch, damaged) == (1, [])
    # a later attempt's older checkpoint never deletes the newer one a dead attempt left
    outbox.delivered = True
    _save(storage, 0, outbox)
    assert "resume-epoch=1-step=12.ckpt" in _names(storage)


def test_a_store_that_refuses_deletes_or_listings_keeps_the_checkpoint_and_training(
    monkeypatch, caplog
):
    """On an object store a checkpoint is uploaded straight under its name (an object appears
    whole or not at all: no temporary name, no copy, no delete); a delete refused (a bucket
    without delete permission) or a listing that fails once the driver holds the checkpoint (a
    throttled store) is a warning: the checkpoint is whole, and its writer trains on (an error
    there would end the fit as one of user code, unretried)."""
    from fsspec.implementations.memory import MemoryFileSystem

    storage = f"memory://runs/{os.getpid()}-{time.monotonic_ns()}"
    outbox = _Outbox()
    monkeypatch.setattr(resume, "get_outbox", lambda: outbox)

    def refused(self, path, *args, **kwargs):
        raise PermissionError(f"AccessDenied: DeleteObject {path}")

    def unlisted_fs(self, path, *args, **kwargs):
        raise OSError(f"SlowDown: listing {path}")

    try:
        with monkeypatch.context() as patched, caplog.at_level(logging.WARNING):
            patched.setattr(MemoryFileSystem, "rm", refused)
            first = _save(storage, 0, outbox)
            assert resume_points.checkpoint_problem(str(first.uri)) is None
            _save(storage, 1, outbox)  # epoch 0's may not be deleted
            assert "Could not delete the old resume checkpoint" in caplog.text
            assert "AccessDenied" in caplog.text
            filesystem, path = _files.filesystem(storage)
            names = [str(name).rsplit("/", 1)[-1] for name in filesystem.ls(path, detail=False)]
            assert sorted(names) == ["resume-epoch=0-step=6.ckpt", "resume-epoch=1-step=12.ckpt"]

            def unlisted(folder):
                raise OSError(f"SlowDown: listing {folder}")

            patched.setattr(resume, "stored_points", unlisted)
            second = _save(storage, 2, outbox)
            assert "Could not list" in caplog.text and "SlowDown" in caplog.text
        assert [p.uri for p in outbox.points][::2] == [first.uri, second.uri]
        assert second.uri == f"{storage}/resume-epoch=2-step=18.ckpt"
        point, damaged = newest_complete_point(storage)
        assert point is not None and (point.epoch, damaged) == (2, [])
        # the leftovers' listing before a write, refused alike: a warning, nothing removed
        caplog.clear()
        with monkeypatch.context() as patched, caplog.at_level(logging.WARNING):
            patched.setattr(MemoryFileSystem, "ls", unlisted_fs)
            assert _files.remove_leftovers(storage) == []
        assert "Could not list" in caplog.text and "for unfinished files" in caplog.text
    finally:
        resume_points.remove_storage_folder(storage)


class _StopAfter(pl.Callback):
    """Stops the fit at the end of epoch ``epoch`` in the monitoring turn, where Lightning's
    EarlyStopping decides (after this package's epoch-end hook)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True

    @property
    def state_key(self) -> str:
        return "stop-after"


class _SlowSteps(TinyModel):
    """Steps of 20 ms: a fit of 12 a epoch lasts about a quarter of a second an epoch."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("every", [{"every_n_steps": 5}, {"every_s": 0.1}], ids=["steps", "time"])
def test_checkpoints_by_steps_or_time_come_inside_epochs(tmp_path, monkeypatch, every):
    """checkpoint_every_n_steps / checkpoint_every_s: resume checkpoints at step boundaries
    inside the epochs too (one process: rank 0 alone decides the timed ones), named after the
    batches they follow, besides the epochs' ends; none at an epoch's first batch."""
    outbox = _Outbox()
    monkeypatch.setattr(resume, "get_outbox", lambda: outbox)
    writer = type("ResumeCheckpoint", (ResumeCheckpointBase, pl.Callback), {})
    callback = writer(1, str(tmp_path / "run"), keep_last=100, **every)
    first = type("BatchStart", (BatchStartBase, pl.Callback), {})(callback)  # as the entry adds it
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", enable_checkpointing=False, callbacks=[first, callback],
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    monkeypatch.setattr(
        trainer.strategy, "resume_checkpoints", contextlib.nullcontext, raising=False
    )
    trainer.fit(_SlowSteps(), loader())  # 12 steps an epoch
    callback.finish(trainer)
    stored = resume_points.stored_points(str(tmp_path / "run"))
    inside = [(p.epoch, p.global_step, p.batches) for p in stored if p.batches is not None]
    ends = [(p.epoch, p.global_step) for p in stored if p.batches is None]
    assert ends == [(0, 12), (1, 24)]
    if "every_n_steps" in every:
        assert inside == [(0, 5, 5), (0, 10, 10), (1, 17, 5), (1, 22, 10)], inside
    else:  # about every 5 steps of 20 ms (and the exchange's boundaries): some in each epoch
        assert {epoch for epoch, _, _ in inside} == {0, 1}, inside
        assert all(0 < batches < 12 and step == 12 * epoch + batches
                   for epoch, step, batches in inside), inside  # fmt: skip
    for point in stored:  # each a whole checkpoint of its step
        assert torch.load(str(point.uri), weights_only=False)["global_step"] == point.global_step


@pytest.mark.parametrize("named", [True, False], ids=["named-run", "launch-folder"])
def test_a_named_runs_fit_ends_with_the_checkpoint_its_next_driver_resumes_from(
    tmp_path, monkeypatch, named
):
    """checkpoint_every_n_epochs=2 with max_epochs=3, or stopped early by a callback: a named
    run's fit writes a resume checkpoint as it ends, so that running the script again trains
    nothing again (before, it resumed after epoch 1 and trained epoch 2 again); one that ends
    on a checkpointed epoch writes none more. A launch's own folder goes when the fit succeeds:
    no extra checkpoint there. Real Trainers (the hooks' order decides), one process."""
    outbox = _Outbox()
    monkeypatch.setattr(resume, "get_outbox", lambda: outbox)
    writer = type("ResumeCheckpoint", (ResumeCheckpointBase, pl.Callback), {})

    def fit(storage: Path, max_epochs: int, *callbacks, every: int = 2, **kwargs) -> list[str]:
        outbox.points.clear()
        resume_callback = writer(every, str(storage), at_fit_end=named)
        trainer = pl.Trainer(
            max_epochs=max_epochs, accelerator="cpu", enable_checkpointing=False,
            callbacks=[resume_callback, *callbacks],
            **quiet_trainer_kwargs(),
        )  # fmt: skip
        monkeypatch.setattr(
            trainer.strategy, "resume_checkpoints", contextlib.nullcontext, raising=False
        )
        trainer.fit(TinyModel(), loader(), **kwargs)
        resume_callback.finish(trainer)  # as the worker's call ends: the uploads are done
        return [Path(str(point.uri)).name for point in outbox.points]

    # 12 batches of 8 samples a process: 12 steps an epoch
    assert fit(tmp_path / "a", 3) == [
        "resume-epoch=1-step=24.ckpt",
        *(["resume-epoch=2-step=36.ckpt"] if named else []),
    ]
    assert fit(tmp_path / "b", 2) == ["resume-epoch=1-step=24.ckpt"]  # no second one
    assert fit(tmp_path / "c", 5, _StopAfter(0)) == (
        ["resume-epoch=0-step=12.ckpt"] if named else []
    )
    if named:  # the next driver's fit: Lightning stops at once, nothing trained again
        point, _ = newest_complete_point(str(tmp_path / "a"))
        assert point is not None and (point.epoch, point.global_step) == (2, 36)
        again = pl.Trainer(max_epochs=3, accelerator="cpu", **quiet_trainer_kwargs())
        model = TinyModel()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        again.fit(model, loader(), ckpt_path=str(point.uri))
        assert again.global_step == 36
        assert not any(torch.equal(before[k], v) for k, v in model.state_dict().items()), (
            "the trained weights were loaded"
        )


KEEPS_A_COPY = textwrap.dedent(
    """
    import sys, time
    from ray_lightning_sgd import _scratch as scratch
    scratch.hold_copy(sys.argv[1], b"checkpoint")
    print("held", flush=True)
    time.sleep(300)
    """
)


def test_a_copy_goes_once_no_process_holds_it_even_after_sigkill(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = str(tmp_path / f"{scratch.PREFIX}abc.ckpt")
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", KEEPS_A_COPY, path],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        )
        for _ in range(2)
    ]
    try:
        for holder in holders:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert scratch.sweep() == [] and Path(path).read_bytes() == b"checkpoint"
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait()
        assert scratch.sweep() == [], "a copy another process holds was removed"
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert scratch.sweep() == [path]
    assert os.listdir(tmp_path) == []


def test_a_folder_swept_before_its_lock_is_made_again(tmp_path, monkeypatch):
    """Another rank's sweep may remove a new folder between its creation and its lock."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = []
    real = tempfile.mkdtemp

    def swept_at_once(**kwargs):
        path = real(**kwargs)
        made.append(path)
        if len(made) == 1:
            os.rmdir(path)  # what the other rank's sweep did
        return path

    monkeypatch.setattr(scratch.tempfile, "mkdtemp", swept_at_once)
    held = scratch.create_folder()
    assert held == made[1] and os.path.isdir(held)
    scratch.release(held)
    assert os.listdir(tmp_path) == []


def test_a_saving_folder_is_held_while_lightning_replaces_the_file_in_it(tmp_path, monkeypatch):
    """Rank 0 saves a resume checkpoint for the driver in a held folder: Lightning's save
    renames its own file into place (a new file, which a lock on the old one would not hold),
    and another worker's sweep of the node ran meanwhile (it removed the file: seen in CI)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    held = scratch.create_folder()
    checkpoint = os.path.join(held, "resume.ckpt")
    _atomic_save({"w": torch.ones(3)}, checkpoint)
    _atomic_save({"w": torch.ones(3)}, checkpoint)  # replaced by name
    assert scratch.remove_unheld(held) is False, "a sweep took a folder a process holds"
    assert os.path.exists(checkpoint)
    scratch.release(held)
    assert os.listdir(tmp_path) == []


def test_without_file_locks_a_copy_goes_when_released_and_nothing_is_swept(
    tmp_path, monkeypatch, caplog
):
    """Some NFS, Lustre and FUSE mounts refuse flock: copies then go as before locks, when
    their process releases them, and a sweep removes none (it cannot tell a live one)."""
    import errno

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(scratch.fcntl, "flock", no_locks)
    monkeypatch.setattr(scratch, "_unlocked", False)
    monkeypatch.setattr(scratch, "_held", {})
    other = tmp_path / f"{scratch.PREFIX}other.ckpt"  # another process's copy
    other.write_bytes(b"theirs")
    path = str(tmp_path / f"{scratch.PREFIX}mine.ckpt")
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        scratch.hold_copy(path, b"checkpoint")
    assert "has no file locks" in caplog.text
    assert Path(path).read_bytes() == b"checkpoint"
    assert scratch.sweep() == [] and other.exists()
    scratch.release(path)
    assert sorted(os.listdir(tmp_path)) == [other.name]
    # a named run's lock: the run trains unlocked, with a warning
    monkeypatch.setattr(runs.fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        with runs.run_lock(str(tmp_path / "run"), "r"):
            pass
    assert "the run trains unlocked" in caplog.text
    with pytest.raises(KeyError) as raised:  # the fit's own error, not chained to the lock's
        with runs.run_lock(str(tmp_path / "run"), "r"):
            raise KeyError("the fit's")
    assert raised.value.__context__ is None


def test_run_json_damaged_is_named_with_the_fix(tmp_path):
    storage = tmp_path / "run"
    storage.mkdir()
    (storage / "run.json").write_text("")  # a driver killed in the old in-place write
    with pytest.raises(ConfigurationError, match=r"run.json is damaged .*Delete it"):
        runs.resume_named_run(str(storage), "run", {"model": "m"})
    (storage / "run.json").write_text("[1]")
    with pytest.raises(ConfigurationError, match="holds list, not an object"):
        runs.resume_named_run(str(storage), "run", {"model": "m"})


HOLDS_THE_RUN = textwrap.dedent(
    """
    import sys, time
    from ray_lightning_sgd._driver import runs
    with runs.run_lock(sys.argv[1], "run"):
        print("held", flush=True)
        time.sleep(300)
    """
)


def test_one_driver_at_a_time_trains_a_named_run(tmp_path):
    folder = str(tmp_path / "run")
    other = subprocess.Popen(
        [sys.executable, "-c", HOLDS_THE_RUN, folder], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        with (
            pytest.raises(ConfigurationError, match=rf"trained by process {other.pid} on "),
            runs.run_lock(folder, "run"),
        ):
            pass
    finally:
        other.send_signal(signal.SIGKILL)  # a driver that dies holds nothing
        other.wait()
    with runs.run_lock(folder, "run"):
        pass


def test_continue_logger_on_a_full_disk_keeps_the_rows(tmpfs):
    from pytorch_lightning.loggers import CSVLogger

    from ray_lightning_sgd import _compat

    logger = CSVLogger(tmpfs, name="logs", version=0)
    os.makedirs(logger.log_dir)
    metrics = Path(logger.log_dir) / "metrics.csv"
    rows = "".join(f"{step},0.5\n" for step in range(40_000))
    metrics.write_text("step,loss\n" + rows)
    filler = tmpfs / "filler"
    with contextlib.suppress(OSError), open(filler, "wb") as file:
        while True:
            file.write(b"x" * 4096)
    kept = metrics.read_text()
    with pytest.raises(OSError, match="No space left"):
        _compat.continue_logger(logger, 0, before_step=30_000)
    # the rows wait under another name, which the next attempt's logger takes them from
    assert sorted(os.listdir(logger.log_dir)) == [_compat.METRICS_KEPT]
    assert (Path(logger.log_dir) / _compat.METRICS_KEPT).read_text() == kept
    filler.unlink()
    again = CSVLogger(tmpfs, name="logs", version=0)
    _compat.continue_logger(again, 0, before_step=30_000)
    assert sorted(os.listdir(logger.log_dir)) == ["metrics.csv"]
    assert metrics.read_text().splitlines() == kept.splitlines()[:30_001]


def test_the_artifacts_probe_goes_when_the_launch_fails_before_it_runs(
    ray_cluster, tmp_path, monkeypatch
):
    from ray_lightning_sgd._driver import launcher

    def refuse(*args, **kwargs):
        raise RuntimeError("refused")

    monkeypatch.setattr(launcher, "RunController", refuse)
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=1), default_root_dir=tmp_path, max_epochs=1,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="refused"):
        trainer.fit(TinyModel(), loader())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ray")] == []


def test_a_killed_drivers_probe_goes_at_the_next_call_and_a_live_ones_stays(tmp_path):
    """A driver killed during a call (SIGKILL; a Tune trial's actor ended while the call cleaned
    up) leaves its probe file; the next call in that folder removes it, not a running call's."""
    from ray_lightning_sgd._driver import artifacts

    script = (
        "import sys, time, types\n"
        "from ray_lightning_sgd._driver import artifacts\n"
        "print(artifacts.prepare(types.SimpleNamespace(default_root_dir=sys.argv[1])).probe)\n"
        "sys.stdout.flush(); time.sleep(60)\n"
    )
    killed = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    left = killed.stdout.readline().strip()  # type: ignore[union-attr]
    live = artifacts.prepare(SimpleNamespace(default_root_dir=str(tmp_path)))  # type: ignore[arg-type]
    assert live is not None and os.path.exists(left), "a running driver's probe stays"
    killed.kill()
    killed.wait()
    again = artifacts.prepare(SimpleNamespace(default_root_dir=str(tmp_path)))  # type: ignore[arg-type]
    assert again is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        os.path.basename(a.probe) for a in (live, again)
    ), "the killed driver's probe was not removed, or a live one was"
    artifacts.finish(live)
    artifacts.finish(again)
    assert list(tmp_path.iterdir()) == []


class _Dies(TinyModel):
    """Rank 1 exits at each global step of ``steps`` once (a marker file per step)."""

    def __init__(self, steps: tuple[int, ...], folder: str) -> None:
        super().__init__()
        self.steps, self.folder = steps, folder

    def training_step(self, batch, batch_idx):
        marker = os.path.join(self.folder, f"died-at-{self.global_step}")
        if self.global_rank == 1 and self.global_step in self.steps and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        return super().training_step(batch, batch_idx)


def _fit(model, strategy, max_epochs=2):
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=max_epochs, enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(model, loader(shuffle=True))
    return trainer


def test_a_restarted_attempt_killed_leaves_no_copy_of_its_checkpoint(ray_cluster, tmp_path):
    """The restarted attempt's workers are killed (rank 1 exits, rank 0 is killed by the
    driver): their local copies of the resume checkpoint go all the same."""
    before = _temp_files()
    model = _Dies((8, 10), str(tmp_path))  # in epoch 1 of the first attempt, then the second's
    with pytest.raises(WorkerDiedError):
        _fit(model, RaySGDStrategy(num_workers=2, max_failures=1))
    assert (tmp_path / "died-at-10").exists(), "the restarted attempt did not run"
    assert _temp_files() - before == set()  # nothing new stays (older leftovers may go)


def test_a_named_run_resumes_past_a_damaged_checkpoint_as_if_never_stopped(
    ray_cluster, tmp_path, caplog
):
    before = _temp_files()
    pl.seed_everything(0)
    reference = TinyModel()
    _fit(reference, RaySGDStrategy(num_workers=2), max_epochs=2)

    storage = tmp_path / "runs"

    def strategy() -> RaySGDStrategy:
        return RaySGDStrategy(num_workers=2, checkpoint_storage=str(storage), run_name="r")

    pl.seed_everything(0)
    _fit(TinyModel(), strategy(), max_epochs=1)  # leaves epoch 0's checkpoint
    folder = storage / "r"
    epoch_0 = folder / checkpoint_name(0, 6)
    damaged = folder / checkpoint_name(1, 12)
    damaged.write_bytes(epoch_0.read_bytes()[:-100])  # epoch 1's, cut short by a full disk
    shutil.copy(epoch_0, folder / _files.temp_name(checkpoint_name(1, 12), unique=False))
    pl.seed_everything(0)
    model = TinyModel()
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        trainer = _fit(model, strategy(), max_epochs=2)
    assert f"{damaged} is damaged" in caplog.text
    assert trainer.global_step == 12
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-6, rtol=0)
    # the damaged file was overwritten by the resumed epoch 1's; no temporary file stays
    assert _names(folder) == [
        ".driver.lock",
        checkpoint_name(0, 6),
        checkpoint_name(1, 12),
        "run.json",
    ]
    assert resume_points.checkpoint_problem(str(damaged)) is None
    assert _temp_files() - before == set()  # nothing new stays (older leftovers may go)


def _dies_before_the_driver_holds_epoch_1s_point() -> None:
    """An init_hook (runs on every worker as it starts): rank 0 exits, once, when a resume
    checkpoint after epoch 0's (epoch 1's, or epoch 2's where it replaced epoch 1's while epoch
    0's was sent) is renamed into place and it waits for the driver to take it (the window in
    which older checkpoints were deleted before the driver held the new one)."""
    from ray_lightning_sgd._worker import resume as worker_resume

    outbox_of = worker_resume.get_outbox
    marker = os.environ["KILL_MARKER"]

    class _DiesWaiting:
        def __init__(self) -> None:
            self._outbox = outbox_of()

        def put_latest(self, channel, point):
            self._point = point
            return self._outbox.put_latest(channel, point)

        def wait_delivered(self, channel, sequence, timeout_s):
            if self._point.epoch >= 1 and not os.path.exists(marker):
                assert os.path.exists(str(self._point.uri)), "not yet renamed into place"
                open(marker, "w").close()
                os._exit(3)
            return self._outbox.wait_delivered(channel, sequence, timeout_s)

    worker_resume.get_outbox = _DiesWaiting


def test_rank_0_killed_before_the_driver_holds_a_checkpoint_resumes_from_the_one_it_holds(
    ray_cluster, tmp_path
):
    """keep_last=1 and a real kill of rank 0 between the rename and the delivery: the driver
    still holds epoch 0's point, whose file stays, and the restart ends with the weights of a
    run never stopped."""
    before = _temp_files()
    pl.seed_everything(0)
    reference = TinyModel()
    _fit(reference, RaySGDStrategy(num_workers=2), max_epochs=3)
    marker = tmp_path / "killed"
    strategy = RaySGDStrategy(
        num_workers=2, max_failures=1, checkpoint_storage=str(tmp_path / "runs"), keep_last=1,
        init_hook=_dies_before_the_driver_holds_epoch_1s_point,
        worker_env={"KILL_MARKER": str(marker)},
    )  # fmt: skip
    pl.seed_everything(0)
    model = TinyModel()
    trainer = _fit(model, strategy, max_epochs=3)
    assert marker.exists(), "rank 0 was not killed"
    assert trainer.global_step == 18
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-6, rtol=0)
    assert _temp_files() - before == set()


def test_a_resumed_one_cycle_schedule_that_ends_too_soon_is_said_at_once():
    """An elastic run resumed on fewer workers takes more steps than the OneCycleLR that came
    back from the checkpoint was sized for: it would raise at its last step."""
    import warnings

    from torch.optim.lr_scheduler import OneCycleLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = OneCycleLR(optimizer, max_lr=0.1, total_steps=36)  # sized on 2 workers

    def trainer(steps: int) -> SimpleNamespace:
        return SimpleNamespace(
            lr_scheduler_configs=[SimpleNamespace(scheduler=schedule)],
            estimated_stepping_batches=steps, global_rank=0, world_size=1,
        )  # fmt: skip

    with pytest.warns(UserWarning, match=r"OneCycleLR\(total_steps=36\) .* takes 72 optimizer"):
        resumed_fit.warn_schedulers_that_end_too_soon(trainer(72))  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed_fit.warn_schedulers_that_end_too_soon(trainer(36))  # type: ignore[arg-type]
        resumed_fit.warn_schedulers_that_end_too_soon(trainer(18))  # type: ignore[arg-type]


def test_a_resume_checkpoint_is_staged_nowhere_but_under_its_own_temporary_name(
    tmp_path, monkeypatch
):
    """Lightning's own save stages the whole file under the system's temporary folder and moves
    it into place: a kill meanwhile leaves it there for good. Ours writes the temporary name it
    gives (in the checkpoint's own folder, renamed or removed by us) and nothing else."""
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", enable_checkpointing=False, **quiet_trainer_kwargs()
    )
    trainer.fit(TinyModel(), loader())
    staged: list[str] = []
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        made = real(*args, **kwargs)
        staged.append(made[1])
        return made

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    path = tmp_path / "run" / _files.temp_name("resume-epoch=0-step=12.ckpt", unique=False)
    with resume._saved_in_place(trainer.strategy):
        trainer.save_checkpoint(path)
    assert staged == [], "a resume checkpoint was staged outside its folder"
    assert torch.load(path, weights_only=False)["global_step"] == 12  # one process: 12 batches
    assert "save_checkpoint" not in vars(trainer.strategy.checkpoint_io), "the writer stays"
    # the reason, as long as it holds: Lightning's own save stages the file elsewhere
    trainer.save_checkpoint(tmp_path / "lightnings.ckpt")
    assert staged and not staged[0].startswith(str(tmp_path)), staged


class _SlowWriter(TorchCheckpointIO):
    """Lightning's writer on a slow disk (or with a large checkpoint)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(0.5)
        super().save_checkpoint(checkpoint, path, storage_options)


class _NoThread:
    """The asynchronous writer's executor, refusing work: a resume checkpoint must not go
    through it."""

    def submit(self, *args, **kwargs):
        raise AssertionError("a resume checkpoint went through the writer's thread")

    def shutdown(self, wait: bool = True) -> None:
        pass


@pytest.mark.parametrize(
    ("wrapped", "subclassed"),
    [(None, False), (_SlowWriter, False), (_SlowWriter, True)],
    ids=["lightnings_writer", "a_slow_one", "a_users_subclass"],
)
def test_an_asynchronous_writer_has_a_resume_checkpoint_whole_before_it_is_handed_on(
    tmp_path, monkeypatch, wrapped, subclassed
):
    """Lightning's AsyncCheckpointIO returns before the file exists; rank 0 then renames, reads
    and hands on the resume checkpoint at once. It is saved whole first, in that thread; so it is
    through a user's subclass of it (which still writes in its thread)."""
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    class Counted(AsyncCheckpointIO):
        """A user's subclass that overrides save_checkpoint (one that logs, say)."""

        def save_checkpoint(self, *args, **kwargs):
            return super().save_checkpoint(*args, **kwargs)

    kind = Counted if subclassed else AsyncCheckpointIO
    writer = kind(None if wrapped is None else wrapped())
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", enable_checkpointing=False, plugins=[writer],
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(TinyModel(), loader())
    monkeypatch.setattr(
        trainer.strategy, "resume_checkpoints", contextlib.nullcontext, raising=False
    )
    outbox = _Outbox()
    monkeypatch.setattr(resume, "get_outbox", lambda: outbox)
    writer._executor = _NoThread()  # type: ignore[assignment]  (2.5 makes its own at once)
    stored = _save_with(ResumeCheckpointBase(1, str(tmp_path / "run")), trainer)
    assert torch.load(str(stored.uri), weights_only=False)["global_step"] == trainer.global_step
    held = _save_with(ResumeCheckpointBase(1, None), trainer, outbox)
    assert held.data is not None
    assert torch.load(io.BytesIO(held.data), weights_only=False)["global_step"] > 0
    assert "save_checkpoint" not in vars(writer), "the writer stays asynchronous"
