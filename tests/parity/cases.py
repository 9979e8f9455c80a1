"""The parity cases: small Lightning programs, each run under Lightning's own ``ddp`` and under
``RaySGDStrategy(num_workers=2)`` with the same seed, and what the driver sees after every call.

A case is a function of a :class:`Run`, which builds the mode's Trainers (``run.trainer(...)``) and
records a :func:`snapshot` after each call (``run.record(...)``). :mod:`tests.parity.reference` runs
every case under ``ddp`` in one script (Lightning's ``ddp`` re-runs the script for rank 1, so the
cases run there in the same order); :mod:`tests.parity.test_parity` runs each under Ray in the test
session and compares the records (:func:`assert_same`).
"""

from __future__ import annotations

import csv
import functools
import itertools
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torchmetrics
import yaml
from pytorch_lightning.callbacks import (
    BasePredictionWriter,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

#: How close numbers must be (weights, metrics, optimizer states), relative to max(1, |value|).
TOLERANCE = 1e-6

CASES: dict[str, Callable[[Run], None]] = {}


def case(fn: Callable[[Run], None]) -> Callable[[Run], None]:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


# ------------------------------------------------------------------------------------------------
# the harness


class Run:
    """One case in one mode: builds its Trainers and keeps its records.

    Args:
        mode: ``"ddp"`` (Lightning's own, 2 processes) or ``"ray"`` (``RaySGDStrategy``, 2 workers).
        root: The case's folder: every Trainer's ``default_root_dir`` and loggers write under it.
    """

    def __init__(self, mode: str, root: Path) -> None:
        self.mode = mode
        self.root = root
        self.records: list[tuple[str, dict[str, Any]]] = []
        #: How DataLoader worker processes start (None: the platform's default, fork on Linux).
        self.worker_start_method = "forkserver" if mode == "ddp" else None

    def strategy(self, namespace: Any = pl) -> dict[str, Any]:
        if self.mode == "ddp":
            return {"strategy": "ddp", "devices": 2}
        if namespace is pl:
            from ray_lightning_sgd import RaySGDStrategy
        else:
            from ray_lightning_sgd.lightning import RaySGDStrategy  # type: ignore[assignment]
        return {"strategy": RaySGDStrategy(num_workers=2)}

    def trainer(self, namespace: Any = pl, **kwargs: Any) -> Any:
        settings = {
            "accelerator": "cpu",
            "max_epochs": 2,
            "default_root_dir": str(self.root),
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "enable_checkpointing": False,
            **self.strategy(namespace),
            **kwargs,
        }
        settings["callbacks"] = [HookRecorder(namespace.Callback), *settings.get("callbacks", [])]
        return namespace.Trainer(**settings)

    def record_value(self, label: str, value: Any) -> None:
        """Records one value alone (what a single process returns, where ``ddp`` cannot show
        it)."""
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            self.records.append((label, {"value": normalise(value, self.root)}))

    def record(self, label: str, trainer: Any, model: Any, result: Any = None) -> None:
        """After a call: what the driver sees (on rank 0 only; ddp's rank 1 records nothing)."""
        if trainer.global_rank == 0:
            self.records.append((label, snapshot(trainer, model, result, self.root)))


def HookRecorder(base: type) -> Any:
    return _recorder_class(base)()


@functools.cache
def _recorder_class(base: type) -> type:
    """A callback that records, on rank 0, every Callback hook called; its state is the list."""
    hooks = [
        name
        for name in dir(base)
        if (name.startswith("on_") or name in ("setup", "teardown"))
        and callable(getattr(base, name))
        and name not in ("on_save_checkpoint", "on_load_checkpoint")
    ]

    def make(name: str) -> Callable[..., None]:
        def hook(self: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if trainer.global_rank == 0:
                self.hooks.append(name)

        return hook

    def init(self: Any) -> None:
        base.__init__(self)
        self.hooks: list[str] = []

    namespace: dict[str, Any] = {name: make(name) for name in hooks}
    namespace["__init__"] = init
    namespace["state_dict"] = lambda self: {"hooks": list(self.hooks)}
    namespace["load_state_dict"] = lambda self, state: setattr(self, "hooks", list(state["hooks"]))
    return type("HookRecorder", (base,), namespace)


def snapshot(trainer: Any, model: Any, result: Any, root: Path) -> dict[str, Any]:
    """What the driver holds after a call, in plain values (paths relative to the case's root)."""
    state = {
        "result": result,
        "status": (str(trainer.state.fn), str(trainer.state.status), str(trainer.state.stage)),
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        # rank 0's batch counts, and no loop left restarting (a next fit would start inside
        # an epoch)
        "batch_counts": [
            trainer.num_training_batches,
            *(list(counts) for counts in (trainer.num_val_batches, trainer.num_test_batches)),
            list(trainer.num_predict_batches),
        ],
        "loops_restarting": [
            loop.restarting
            for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop, trainer.validate_loop)
        ],
        "weights": _weights(model.state_dict()),
        "model_attributes": {
            k: v
            for k, v in vars(model).items()
            # (DDP's forward redirection leaves the model's own forward in its __dict__)
            if not k.startswith("_") and getattr(v, "__self__", None) is not model
        }
        | {"hparams": dict(model.hparams)},
        "callback_metrics": dict(trainer.callback_metrics),
        "logged_metrics": dict(trainer.logged_metrics),
        "progress_bar_metrics": dict(trainer.progress_bar_metrics),
        "callbacks": {
            cb.state_key: cb.state_dict() for cb in trainer.callbacks if _not_a_bar(cb, trainer)
        },
        "optimizers": [opt.state_dict() for opt in trainer.optimizers],
        # the driver's own objects, not copies: what its optimizers train, what it attached
        "optimizers_train_the_model": all(
            any(p is q for q in model.parameters())
            for opt in trainer.optimizers
            for group in opt.param_groups
            for p in group["params"]
        ),
        "schedulers_step_the_optimizers": all(
            any(config.scheduler.optimizer is opt for opt in trainer.optimizers)
            for config in trainer.lr_scheduler_configs
        ),
        "datamodule": None
        if getattr(trainer, "datamodule", None) is None
        else {k: v for k, v in vars(trainer.datamodule).items() if not k.startswith("_")},
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "files": files_under(root),
        # the tuners restore a checkpoint of their own, named by a new UUID each time
        "ckpt_path": None
        if trainer.ckpt_path is None
        else re.sub(r"\.lr_find_[0-9a-f-]+\.ckpt$", ".lr_find_<id>.ckpt", str(trainer.ckpt_path)),
        "profiler": _profiler(trainer.profiler),
    }
    state["model_attributes"].pop("training", None)
    return normalise(state, root)


def _profiler(profiler: Any) -> dict[str, Any]:
    """What a profiler holds after a call: where it writes, and how often it recorded each
    action (durations differ run to run; callbacks' hooks include each mode's own callbacks)."""
    durations = getattr(profiler, "recorded_durations", {})
    return {
        "type": type(profiler).__qualname__,
        "dirpath": profiler.dirpath,
        "filename": profiler.filename,
        "recorded": {
            action.replace("RaySGDStrategy", "DDPStrategy"): len(times)
            for action, times in durations.items()
            if not action.startswith("[Callback]")
        },
    }


def _not_a_bar(callback: Any, trainer: Any) -> bool:
    return callback is not trainer.progress_bar_callback


def _weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    # a submodule compiled on rank 0 names its weights <name>._orig_mod.<...>
    return {k.replace("._orig_mod", ""): v for k, v in state_dict.items()}


def files_under(root: Path) -> dict[str, Any]:
    """The files a case wrote, read into comparable values."""
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        name = str(path.relative_to(root))
        if ".tfevents." in name:  # named by the time and host that wrote them
            found[name.split(".tfevents.")[0] + ".tfevents.<time>"] = "<events>"
        elif path.suffix == ".csv":
            with path.open(newline="") as file:
                found[name] = [
                    {k: _number(v) for k, v in row.items()} for row in csv.DictReader(file)
                ]
        elif path.suffix == ".ckpt":
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
            found[name] = {
                "state_dict": _weights(checkpoint["state_dict"]),
                "epoch": checkpoint["epoch"],
                "global_step": checkpoint["global_step"],
                "optimizer_states": checkpoint.get("optimizer_states"),
                "lr_schedulers": checkpoint.get("lr_schedulers"),
                "callbacks": sorted(checkpoint.get("callbacks", {})),
                "loops": checkpoint.get("loops"),
            }
        elif path.suffix == ".yaml":
            found[name] = yaml.safe_load(path.read_text())
            if name.endswith("config.yaml"):  # a CLI's: the strategy is what differs by design
                found[name]["trainer"].pop("strategy", None)
                found[name]["trainer"].pop("devices", None)
        elif path.suffix in (".pt", ".pth"):
            found[name] = torch.load(path, map_location="cpu", weights_only=False)
        else:
            found[name] = path.read_text(errors="replace")
    return found


def _number(value: str) -> Any:
    try:
        return float(value)
    except ValueError:
        return value


def normalise(value: Any, root: Path) -> Any:
    """Tensors to CPU, the case's root in strings to ``<root>``, recursively."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, str):
        return value.replace(str(root), "<root>")
    if isinstance(value, Path):
        return normalise(str(value), root)
    if isinstance(value, dict):
        return {normalise(k, root): normalise(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [normalise(v, root) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, torch.dtype, torch.device)):
        return value
    if isinstance(value, type):
        return f"<class {value.__qualname__}>"
    return f"<{type(value).__qualname__}>"  # other objects compare by their type only


def assert_same(expected: Any, got: Any, where: str = "") -> None:
    """Fails, naming the first place where ``got`` differs from ``expected``."""
    if isinstance(expected, dict) and isinstance(got, dict):
        missing, extra = (
            sorted(set(map(str, expected)) - set(map(str, got))),
            sorted(set(map(str, got)) - set(map(str, expected))),
        )
        assert not missing and not extra, f"{where}: keys missing {missing}, extra {extra}"
        for key in expected:
            assert_same(expected[key], got[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        assert len(expected) == len(got), f"{where}: length {len(got)} != {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert_same(e, g, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        numbers = (torch.Tensor, int, float)
        assert isinstance(got, numbers) and isinstance(expected, numbers), (
            f"{where}: {got!r} != {expected!r}"
        )
        e, g = torch.as_tensor(expected), torch.as_tensor(got)
        assert e.shape == g.shape, f"{where}: shape {tuple(g.shape)} != {tuple(e.shape)}"
        if e.numel():
            e64, g64 = e.double(), g.double()
            assert torch.equal(e64.isnan(), g64.isnan()), f"{where}: NaN in other places"
            unequal = (e64 != g64) & ~e64.isnan()  # equal infinities are equal
            diff = (e64[unequal] - g64[unequal]).abs().max().item() if unequal.any() else 0.0
            scale = max(1.0, e64[unequal].abs().max().item() if unequal.any() else 0.0)
            assert diff <= TOLERANCE * scale, f"{where}: differs by {diff}"
    elif isinstance(expected, float) or isinstance(got, float):
        assert isinstance(got, (int, float)), f"{where}: {got!r} != {expected!r}"
        same = expected == got or (math.isnan(expected) and math.isnan(got))
        assert same or abs(expected - got) <= TOLERANCE * max(1.0, abs(expected)), (
            f"{where}: {got!r} != {expected!r}"
        )
    else:
        assert type(expected) is type(got) and expected == got, f"{where}: {got!r} != {expected!r}"


# ------------------------------------------------------------------------------------------------
# models and data


def data(n: int = 64, features: int = 8, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


def loader(n: int = 64, batch_size: int = 8, **kwargs: Any) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size, **kwargs)


class Classifier(pl.LightningModule):
    """A small classifier that logs what most projects log."""

    def __init__(self, lr: float = 0.1, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


# ------------------------------------------------------------------------------------------------
# the cases


@case
def case_fit_validate_test_with_checkpoints_and_csv(run: Run) -> None:
    """Callbacks with state, a CSV logger over four calls, return values of every call."""
    pl.seed_everything(1)
    model = Classifier()
    trainer = run.trainer(
        max_epochs=3,
        logger=CSVLogger(str(run.root), name="logs"),
        enable_checkpointing=True,
        callbacks=[
            ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True),
            EarlyStopping(monitor="val_loss", patience=5),
        ],
    )
    trainer.fit(model, loader(shuffle=True), loader(32))
    run.record("fit", trainer, model)
    run.record("validate", trainer, model, trainer.validate(model, loader(32)))
    run.record("test", trainer, model, trainer.test(model, loader(32)))


@case
def case_test_from_best_checkpoint_and_save_on_the_driver(run: Run) -> None:
    """``test(ckpt_path="best")`` tests the best weights; the driver's ``save_checkpoint`` holds
    the optimizer's state."""
    pl.seed_everything(2)
    model = Classifier(lr=0.5)
    trainer = run.trainer(
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(monitor="val_acc", mode="max", filename="best")],
    )
    trainer.fit(model, loader(shuffle=True), loader(32))
    run.record("fit", trainer, model)
    trainer.save_checkpoint(run.root / "driver.ckpt")
    run.record("save_checkpoint", trainer, model)
    run.record("test best", trainer, model, trainer.test(model, loader(32), ckpt_path="best"))


@case
def case_profiler_and_ckpt_path(run: Run) -> None:
    """The driver's profiler holds rank 0's (set up: its ``dirpath``, what it recorded);
    ``trainer.ckpt_path`` names the checkpoint that ``validate(ckpt_path="best")`` restored."""
    pl.seed_everything(17)
    model = Classifier()
    trainer = run.trainer(
        max_epochs=1,
        enable_checkpointing=True,
        profiler="simple",
        callbacks=[ModelCheckpoint(monitor="val_loss", filename="best")],
    )
    trainer.fit(model, loader(), loader(32))
    run.record("fit", trainer, model)
    result = trainer.validate(model, loader(32), ckpt_path="best")
    run.record("validate best", trainer, model, result)


@case
def case_manual_optimization(run: Run) -> None:
    class Manual(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            optimizer.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            self.log("train_loss", loss, sync_dist=True)

    pl.seed_everything(3)
    model = Manual()
    trainer = run.trainer()
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True)))


@case
def case_accumulation_clipping_and_schedulers(run: Run) -> None:
    class Scheduled(Classifier):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.05)
            step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "step"}}

    pl.seed_everything(4)
    model = Scheduled()
    trainer = run.trainer(
        max_epochs=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.3,
        logger=CSVLogger(str(run.root), name="logs"),
        callbacks=[LearningRateMonitor(logging_interval="step")],
        log_every_n_steps=1,
    )
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True)))


@case
def case_plateau_scheduler_and_torchmetrics(run: Run) -> None:
    class Metered(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            self.train_acc(logits, y)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            return nn.functional.cross_entropy(logits, y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self(x)
            self.val_acc(logits, y)
            self.log("val_acc", self.val_acc)
            self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "val_loss"}

    pl.seed_everything(5)
    model = Metered()
    trainer = run.trainer(max_epochs=3)
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True), loader(32)))
    run.record("validate", trainer, model, trainer.validate(model, loader(32)))


@case
def case_resume_from_a_checkpoint_and_fit_twice(run: Run) -> None:
    pl.seed_everything(6)
    model = Classifier()
    trainer = run.trainer(
        max_epochs=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)]
    )
    trainer.fit(model, loader(shuffle=True))
    run.record("fit 1 epoch", trainer, model)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, loader(shuffle=True))
    run.record("fit again to 2 epochs", trainer, model)
    resumed = Classifier()
    again = run.trainer(
        max_epochs=3, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)]
    )
    again.fit(resumed, loader(shuffle=True), ckpt_path=str(run.root / "checkpoints" / "last.ckpt"))
    run.record("resumed to 3 epochs", again, resumed)


@case
def case_loop_controls(run: Run) -> None:
    pl.seed_everything(7)
    model = Classifier()
    trainer = run.trainer(
        max_epochs=4,
        max_steps=9,
        limit_train_batches=4,
        limit_val_batches=2,
        val_check_interval=0.5,
        num_sanity_val_steps=1,
    )
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True), loader(32)))
    # more steps, the same Trainer: the next fit goes on from step 9 in epoch 2, as ddp's
    trainer.fit_loop.epoch_loop.max_steps = 13
    run.record("fit to more steps", trainer, model, trainer.fit(model, loader(shuffle=True)))
    validate = run.trainer(limit_val_batches=1)
    run.record("validate limited", validate, model, validate.validate(model, loader(32)))


@case
def case_bf16_mixed_on_cpu(run: Run) -> None:
    class DtypeSeen(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            self.seen_dtype = str(logits.dtype)
            return nn.functional.cross_entropy(logits, y)

    pl.seed_everything(8)
    model = DtypeSeen()
    trainer = run.trainer(precision="bf16-mixed")
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True)))


@case
def case_batchnorm_and_buffers_changed_in_evaluation(run: Run) -> None:
    class Normed(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)
            )
            self.register_buffer("evaluated", torch.zeros(()))

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.evaluated += len(batch[0])
            super().validation_step(batch, batch_idx)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.evaluated += 1000
            self.tested_batches = getattr(self, "tested_batches", 0) + 1
            super().test_step(batch, batch_idx)

    pl.seed_everything(9)
    model = Normed()
    # (SyncBatchNorm needs GPUs: DDP refuses it on CPU, in Lightning's ddp as here)
    trainer = run.trainer(num_sanity_val_steps=0)
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True), loader(32)))
    run.record("validate", trainer, model, trainer.validate(model, loader(32)))
    run.record("test", trainer, model, trainer.test(model, loader(32)))


class _Stream(IterableDataset):
    """Samples streamed, each rank its own share (as a sharded source would)."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rank = (
            int(os.environ.get("RANK", 0))
            if not torch.distributed.is_initialized()
            else (torch.distributed.get_rank())
        )
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        samples = data(64)
        return (samples[i] for i in itertools.islice(range(len(samples)), rank, None, world))


class StreamData(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.prepared = False
        self.batch_size = 8

    def prepare_data(self) -> None:
        self.prepared = True

    def setup(self, stage: str) -> None:
        self.stage = stage

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(), batch_size=self.batch_size)


@case
def case_iterable_data_in_a_datamodule(run: Run) -> None:
    pl.seed_everything(10)
    model = Classifier()
    trainer = run.trainer(limit_val_batches=2)
    run.record("fit", trainer, model, trainer.fit(model, datamodule=StreamData()))


class _Writer(BasePredictionWriter):
    def write_on_epoch_end(
        self, trainer: Any, pl_module: Any, predictions: Any, indices: Any
    ) -> None:
        folder = Path(trainer.default_root_dir) / "predictions"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"predictions": predictions, "indices": indices},
            folder / f"rank_{trainer.global_rank}.pt",
        )
        # every rank's file is written when predict returns: without it, ``ddp``'s driver (rank
        # 0) listed the folder before rank 1 had written (seen with torch 2.15)
        trainer.strategy.barrier("parity.predictions_written")


@case
def case_predict_writer_and_dataloader_workers(run: Run) -> None:
    """DataLoader worker processes. Ours fork them, as users' code does; the ``ddp`` reference
    starts them from a forkserver (:mod:`tests.parity.reference` preloads torch in it): a forked
    worker of a ``ddp`` rank deadlocked at birth, in CPython 3.11.7's ``PyOS_AfterFork_Child``
    (python/cpython#112275, fixed in later 3.11 releases), twice in CI and once in 34 runs here.
    The start method changes no number: the workers' seeds come from the loader's RNG."""
    pl.seed_everything(11)
    model = Classifier()
    trainer = run.trainer(callbacks=[_Writer(write_interval="epoch")])
    workers = {"num_workers": 1, "multiprocessing_context": run.worker_start_method}
    trainer.fit(model, loader(shuffle=True, **workers))
    run.record("fit", trainer, model)
    trainer.predict(model, loader(40, **workers), return_predictions=False)
    run.record("predict", trainer, model)


@case
def case_predict_returns_what_one_process_returns(run: Run) -> None:
    """``ddp``'s driver returns rank 0's share of the predictions; the reference is one process
    (37 samples: the sampler pads rank 1's share with a repeated sample)."""
    pl.seed_everything(17)
    model = Classifier()
    trainer = run.trainer(max_epochs=1)
    trainer.fit(model, loader(shuffle=True))
    run.record("fit", trainer, model)
    if run.mode == "ddp":
        one = run.trainer(strategy="auto", devices=1, callbacks=[])
        predictions = one.predict(model, loader(37))
    else:
        predictions = trainer.predict(model, loader(37))
    run.record_value("predict", predictions)


@case
def case_lr_finder(run: Run) -> None:
    pl.seed_everything(12)
    model = Classifier(lr=1e-3)
    trainer = run.trainer()
    finder = Tuner(trainer).lr_find(model, loader(shuffle=True), num_training=12, min_lr=1e-4)
    suggestion = None if finder is None else finder.suggestion()
    run.record("lr_find", trainer, model, suggestion)
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True)))


@case
def case_stochastic_weight_averaging(run: Run) -> None:
    pl.seed_everything(13)
    model = Classifier()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    trainer = run.trainer(max_epochs=3, callbacks=[swa])
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True)))


@case
def case_compiled_submodule(run: Run) -> None:
    class Compiled(Classifier):
        def configure_model(self) -> None:
            if not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
                self.net = torch.compile(self.net, backend="eager")

    pl.seed_everything(14)
    model = Compiled()
    trainer = run.trainer()
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True)))


@case
def case_lightning_cli(run: Run) -> None:
    from pytorch_lightning.cli import LightningCLI

    from tests.helpers import TinyData, TinyModel

    strategy = (
        ["--trainer.strategy=ddp", "--trainer.devices=2"]
        if run.mode == "ddp"
        else [
            "--trainer.strategy=ray_lightning_sgd.RaySGDStrategy",
            "--trainer.strategy.num_workers=2",
        ]
    )
    cli = LightningCLI(
        TinyModel,
        TinyData,
        args=[
            "fit",
            *strategy,
            "--trainer.accelerator=cpu",
            "--trainer.max_epochs=2",
            f"--trainer.default_root_dir={run.root}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=false",
        ],
        seed_everything_default=15,
    )
    run.record("fit", cli.trainer, cli.model)


@case
def case_lightning_namespace(run: Run) -> None:
    import lightning.pytorch as lp

    class Model(lp.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lp.seed_everything(16)
    model = Model()
    trainer = run.trainer(
        lp, callbacks=[lp.callbacks.ModelCheckpoint(save_last=True)], enable_checkpointing=True
    )
    run.record("fit", trainer, model, trainer.fit(model, loader(shuffle=True)))


class RecordingLogger(pl.loggers.Logger):
    """A user's own logger: records which of its methods Lightning calls, with what (rank 0's
    calls, as ``@rank_zero_only`` keeps them), in its state."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    @pl.utilities.rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("log_hyperparams", sorted(dict(params))))

    @pl.utilities.rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append(("log_metrics", step, sorted(metrics)))

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.calls.append(("after_save_checkpoint", Path(checkpoint_callback.best_model_path).name))

    def finalize(self, status: str) -> None:
        self.calls.append(("finalize", status))


@case
def case_experiment_trackers(run: Run) -> None:
    """Every tracker Lightning ships that runs without a network, and a user's own logger, at
    once, over ``fit`` and ``test``: the runs they hold afterwards (MLflow's, with the
    checkpoints ``log_model`` logs; W&B's offline runs), whether the driver's loggers name those
    runs, and the calls the user's logger received."""
    import fcntl

    import wandb
    from mlflow.tracking import MlflowClient
    from pytorch_lightning.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    from tests.trackers import mlflow_runs, offline_comet_logger, remove_store_lock, wandb_runs

    # beside the case's folder: the parity of the files a case wrote compares those in it
    stores = run.root.with_name(f"{run.root.name}-stores")
    uri = f"sqlite:///{stores}/mlflow.db"
    os.environ["WANDB_SILENT"] = "true"
    stores.mkdir(parents=True, exist_ok=True)
    with (stores / ".lock").open("w") as lock:
        # an MLflow client makes its sqlite store's tables when it is built: both of ddp's
        # processes build one, and made at once they fail ("table ... already exists")
        fcntl.flock(lock, fcntl.LOCK_EX)
        MlflowClient(uri)
    loggers = [
        TensorBoardLogger(str(run.root), name="tb"),
        MLFlowLogger("parity", tracking_uri=uri, log_model=True, artifact_location=str(stores)),
        WandbLogger(project="parity", save_dir=str(stores), offline=True),
        offline_comet_logger(pl.loggers, stores / "comet", "parity"),
        RecordingLogger(),
    ]
    pl.seed_everything(17)
    model = Classifier()
    trainer = run.trainer(
        logger=loggers,
        log_every_n_steps=1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(monitor="val_loss")],
    )
    trainer.fit(model, loader(shuffle=True), loader(32))
    run.record("fit", trainer, model)
    run.record_value("a custom logger's calls in the fit", trainer.loggers[-1].calls)
    run.record("test", trainer, model, trainer.test(model, loader(32)))
    run.record_value("a custom logger's calls in the test", trainer.loggers[-1].calls)
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    wandb.finish()  # ddp's run lives in this process until it exits
    mlflow = mlflow_runs(uri, "parity")
    remove_store_lock(uri)
    segments = wandb_runs(stores)  # one a call here: each resumes the run by its id
    versions = [logger.version for logger in trainer.loggers]
    run.record_value(
        "the driver's loggers name the runs",
        {
            "mlflow": [r["id"] for r in mlflow] == [versions[1]],
            "wandb": {s["id"] for s in segments} == {versions[2]},
            "comet": isinstance(versions[3], str) and len(versions[3]) == 32,
        },
    )
    for each in mlflow:
        # a run's id differs; the checkpoint's name holds the score ddp and we compute alike
        each.pop("id")
    run.record_value("mlflow", mlflow)
    run.record_value(
        "wandb",
        {
            "rows": [row for s in segments for row in s["rows"]],
            "config": {k: v for s in segments for k, v in s["config"].items()},
            "exit": [s["exit"] for s in segments][-1:],
        },
    )
