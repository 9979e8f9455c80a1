"""Real hangs, explained: every rank's stack on demand, after a while without progress, and in
the progress timeout's error; each with the user's own function in the right rank's stack."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ray_lightning_sgd import RaySGDStrategy, WorkerTimeoutError
from ray_lightning_sgd._driver.arguments import distributed_debug_level
from tests.conftest import leftovers
from tests.helpers import TinyModel, hang_reports, make_data, quiet_trainer_kwargs


class GatherOnRankZero(TinyModel):
    """Rank 0 alone calls ``all_gather`` at its third step: a collective on some ranks only."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 0:
            self.gather_on_rank_zero_only()
        return super().training_step(batch, batch_idx)

    def gather_on_rank_zero_only(self):
        return self.all_gather(torch.ones(1))


def test_a_collective_on_one_rank_only_is_reported_with_every_ranks_stack(ray_cluster, caplog):
    # windows longer than the start (a quiet start counts too), shorter than the test
    strategy = RaySGDStrategy(num_workers=2, hang_report_after_s=4, progress_timeout_s=9)
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=1,
        accelerator="cpu",
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"),
        pytest.raises(WorkerTimeoutError) as caught,
    ):
        trainer.fit(GatherOnRankZero(), DataLoader(make_data(), batch_size=8))
    assert time.monotonic() - started < 60
    # the report came within the window, before the timeout, and named the collective
    assert hang_reports(caplog.text, "waiting in all_gather") == 1, caplog.text
    zero = caught.value.stacks[0]
    assert zero.stack.collective == "all_gather", str(zero)
    assert "gather_on_rank_zero_only" in zero.stack.text
    assert zero.stack.hook == "training_step"
    one = caught.value.stacks[1]  # in the step's own collective (its sync_dist log)
    assert one.stack.collective is not None and one.stack.collective != "all_gather", str(one)
    assert "the ranks wait in different collectives (all_gather on ranks 0" in str(caught.value)
    assert leftovers() == ([], [])


class ShowsItsSettings(TinyModel):
    """Prints, on each rank, what the debug switch sets."""

    def on_train_start(self):
        level = logging.getLogger(self.trainer.strategy.flavour.namespace).level
        detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
        print(
            f"rank {self.global_rank}: TORCH_DISTRIBUTED_DEBUG={detail}, Lightning's level {level}"
        )


def test_the_debug_switch_sets_every_rank_and_keeps_each_ranks_output_in_a_file(
    ray_cluster, tmp_path
):
    strategy = RaySGDStrategy(
        num_workers=2, debug=True, worker_env={"TORCH_CPP_LOG_LEVEL": "WARNING"}
    )
    assert strategy.worker_env["TORCH_CPP_LOG_LEVEL"] == "WARNING"  # worker_env wins
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=1, accelerator="cpu", default_root_dir=str(tmp_path),
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(ShowsItsSettings(), DataLoader(make_data(), batch_size=8))
    files = sorted((tmp_path / "rank_logs").glob("*/rank-*.log"))
    assert [f.name for f in files] == ["rank-0.log", "rank-1.log"]
    for rank, file in enumerate(files):
        text = file.read_text()
        assert text.startswith("=== call ") and f"rank {rank} of 2 (node" in text.splitlines()[0]
        # every line of the rank, also those the driver prints once for all ranks
        level = distributed_debug_level()  # DETAIL, but INFO on torch 2.15 (DETAIL crashes DDP)
        assert f"rank {rank}: TORCH_DISTRIBUTED_DEBUG={level}, Lightning's level 10" in text


class SlowOnRankOne(Dataset):
    """make_data's samples; on rank 1, the 24th sample read (in its third batch) takes long."""

    def __init__(self, folder: str, seconds: float) -> None:
        self.data, self.folder, self.seconds, self.read = make_data(), folder, seconds, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        self.read += 1
        if dist.get_rank() == 1 and self.read == 24:
            self.slow_item()
        return self.data[index]

    def slow_item(self) -> None:
        Path(self.folder, "slow").touch()
        time.sleep(self.seconds)


def test_stacks_on_demand_and_the_hang_report_name_a_rank_stuck_in_its_dataloader(
    ray_cluster, tmp_path, caplog, capfd
):
    strategy = RaySGDStrategy(num_workers=2, hang_report_after_s=4)
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=1,
        accelerator="cpu",
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    asked: list = []

    def ask_while_stuck() -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / "slow").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(5)  # after the hang report
        asked.extend(strategy.worker_stacks())
        os.kill(os.getpid(), signal.SIGUSR1)  # as a person would: kill -USR1 <driver pid>

    asker = threading.Thread(target=ask_while_stuck, daemon=True)
    # a SIGUSR1 that came after the fit must not end pytest (its default action)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        asker.start()
        with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
            trainer.fit(TinyModel(), DataLoader(SlowOnRankOne(str(tmp_path), 9), batch_size=8))
        asker.join(10)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert trainer.global_step == 6  # the run went on once rank 1's sample came
    # on demand: rank 1 reads its sample in its DataLoader, outside any collective
    one, zero = asked[1], asked[0]
    assert "slow_item" in one.stack.text and one.stack.collective is None, str(one)
    assert "in __getitem__" in one.stack.text
    assert zero.stack.collective is not None, str(zero)  # rank 0 waits for it
    assert asked[1].where.startswith("rank 1 (node ")
    # the hang report, once, and the SIGUSR1 report on stderr
    assert hang_reports(caplog.text, "slow_item") == 1, caplog.text
    assert "ranks in no collective: 1" in caplog.text
    err = capfd.readouterr().err
    assert "Every rank's stack (SIGUSR1):" in err and "slow_item" in err
    assert strategy.worker_stacks() == []  # no call runs now


class SlowRankOne(TinyModel):
    """Rank 1's training_step takes 40 ms longer than rank 0's (a slow node, say). It logs its
    loss without ``sync_dist`` (Lightning's default): a step that syncs before its backward
    makes every rank's step as long as the slowest's (see the README)."""

    def __init__(self, slow: bool = True) -> None:
        super().__init__()
        self.slow = slow

    def training_step(self, batch, batch_idx):
        if self.slow and self.global_rank == 1:
            time.sleep(0.04)
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss


def test_a_rank_slowed_on_purpose_is_named_and_a_balanced_run_gives_no_warning(ray_cluster, caplog):
    strategies: list[RaySGDStrategy] = []

    def fit(slow: bool) -> str:
        caplog.clear()
        strategies.append(strategy := RaySGDStrategy(num_workers=2))
        trainer = pl.Trainer(
            strategy=strategy,
            max_epochs=1,
            accelerator="cpu",
            enable_checkpointing=False,
            **quiet_trainer_kwargs(),
        )
        # 50 steps a rank: the first is not timed, the next 20 fill each rank's window
        with caplog.at_level(logging.INFO, logger="ray_lightning_sgd"):
            trainer.fit(SlowRankOne(slow), DataLoader(make_data(800), batch_size=8))
        return caplog.text

    slowed = fit(slow=True)
    assert slowed.count("is slower than the other ranks") == 1, slowed
    named = [line for line in slowed.splitlines() if "is slower than" in line]
    assert "rank 1 (node" in named[0], named
    assert "its extra time goes to the step itself" in slowed
    zero, one = strategies[0].rank_timings
    assert one.step_s > 0.035 > zero.step_s and zero.steps == one.steps == 49
    assert "Step times by rank:" in slowed
    balanced = fit(slow=False)  # the same workers, warm
    assert "is slower than" not in balanced, balanced
    assert "Step times by rank:" in balanced
