"""Benchmark: one LightningModule under a single process, Lightning's ddp and ddp_spawn, Ray Train's
TorchTrainer with RayDDPStrategy, and RaySGDStrategy with new (cold) and reused (warm) workers.

Every run is a fresh Python process; runs are interleaved (mode after mode, repetition after
repetition) so that a noisy machine hurts every mode alike; the table shows medians and each figure's
ratio to Lightning's ddp.

    python benchmarks/bench.py                 # the table (5 repetitions)
    python benchmarks/bench.py --repeats 5 --transfer-params 100_000_000

Figures per run, all from the same callback on every rank:

- start: from the driver's call (``trainer.fit`` or ``TorchTrainer.fit``) to rank 0's first batch;
- step: median time between rank 0's batch ends after the first 5;
- call: the driver's whole call;
- back: from rank 0's ``on_fit_end`` until the call returns (results back to the driver);
- driver / worker MB: peak resident memory of the driver and of the largest rank.

Two more measurements, in their own fresh processes: bringing a large model's weights back
(RaySGDStrategy against a plain ``ray.get`` of the same tensors from an actor), and shipping a Trainer
with a large in-memory dataset to 1 and to 4 warm workers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Lightning's namespace for a run: ``pytorch_lightning``, or ``lightning.pytorch`` for
#: ``ray_train``, whose RayDDPStrategy is built on ``lightning`` where that is installed.
LIGHTNING = os.environ.get("BENCH_LIGHTNING", "pytorch_lightning")
pl = importlib.import_module(LIGHTNING)

MODES = (
    "single",
    "ddp",
    "ddp_spawn",
    "ray_train",
    "ray_sgd_cold",
    "ray_sgd_warm",
    "ddp_bar",
    "ray_sgd_bar",
)
#: Modes run only when asked for: warm workers without the SIGTERM notice exchange
#: (``max_preemptions=0``), to show what that exchange costs; and ``ray_actors``, Lightning's own
#: ``ddp`` in plain Ray actors (one a rank, started by the call, training in the actor's main
#: thread, nothing of this package): what any launcher on Ray actors pays, against which
#: ``ray_sgd_cold`` shows what this package adds.
EXTRA_MODES = ("ray_sgd_no_preemption", "ray_actors")
#: Modes that run another with Lightning's TQDM progress bar on (on the driver for ray_sgd).
WITH_BAR = {"ddp_bar": "ddp", "ray_sgd_bar": "ray_sgd_warm"}
#: ``--gpu``: every mode on the GPUs of this machine (one worker per GPU), in bf16-mixed.
GPU = os.environ.get("BENCH_GPU") == "1"
WORKERS = max(1, torch.cuda.device_count()) if GPU else 2
#: ``--small``: a 64-wide MLP whose steps take a few milliseconds (3.6 on 2 CPU workers here),
#: where a cost paid once a step shows (the default's take tens of milliseconds on CPU).
SMALL = os.environ.get("BENCH_SMALL") == "1"
BATCH = 128
FEATURES = 64 if SMALL else 1024
HIDDEN = 64 if SMALL else 1024
#: ``--layers``: hidden layers of the MLP (2: 2.1M parameters; 3: 3.2M, whose steps take about
#: 50 ms on 2 CPU workers here, where whatever else runs on the machine shows in the step).
LAYERS = int(os.environ.get("BENCH_LAYERS", "2"))
#: ``--steps``: training steps per rank.
STEPS_PER_RANK = int(os.environ.get("BENCH_STEPS", "100"))
WARMUP_STEPS = 5
SHIP_WORKERS = (1, 2, 4)


class MLP(pl.LightningModule):
    """About 2.1 million parameters (9,000 with ``--small``)."""

    def __init__(
        self, features: int = FEATURES, hidden: int = HIDDEN, layers: int = LAYERS
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.net = nn.Sequential(*blocks, nn.Linear(width, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Timer(pl.Callback):
    """Records, on every rank, the times and memory the table reports; rank r writes out.rank<r>."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.batch_ends: list[float] = []
        self.first_batch = 0.0

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)  # one thread per worker in every mode

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.first_batch:
            self.first_batch = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if GPU:
            torch.cuda.synchronize()  # the step's kernels, not only their launch
        self.batch_ends.append(time.time())

    def on_fit_end(self, trainer, pl_module):
        steps = [b - a for a, b in zip(self.batch_ends[:-1], self.batch_ends[1:], strict=True)][
            WARMUP_STEPS:
        ]
        record = {
            "first_batch": self.first_batch,
            "step": _median_or_nan(steps),
            # the raw lines only: a transient in the first steps shows as the halves differ
            "step_first_half": _median_or_nan(steps[: len(steps) // 2]),
            "step_second_half": _median_or_nan(steps[len(steps) // 2 :]),
            "fit_end": time.time(),
            "maxrss_mb": _maxrss_mb(),
        }
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(record))


def _median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _data(n: int, features: int = FEATURES) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=generator))


def _loader(ranks: int) -> DataLoader:
    return DataLoader(_data(BATCH * STEPS_PER_RANK * ranks), batch_size=BATCH)


def _trainer_kwargs(out: str) -> dict:
    return {
        "max_epochs": 1,
        "accelerator": "gpu" if GPU else "cpu",
        "precision": "bf16-mixed" if GPU else "32-true",
        "callbacks": [Timer(out)],
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
    }


def _init_ray() -> float:
    import ray

    from ray_lightning_sgd import _compat

    start = time.time()
    _compat.bind_local_ray_to_loopback()
    ray.init(
        address="local",
        num_cpus=WORKERS,
        num_gpus=WORKERS if GPU else 0,
        include_dashboard=False,
        log_to_driver=False,
    )
    return time.time() - start


def _ray_train_loop(config: dict) -> None:
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        devices="auto",
        **_trainer_kwargs(config["out"]),
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(MLP(), _loader(WORKERS))


def _ddp_in_plain_actors(out: str) -> None:
    """``ray_actors``: Lightning's ``ddp`` in one plain Ray actor a rank, which the call starts,
    given its rank as torchrun gives it (environment variables); the actors train in their main
    thread (no concurrency groups) and Lightning's own strategy runs there unchanged."""
    import socket

    import ray

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]

    class Rank:
        def fit(self, rank: int) -> None:
            os.environ.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORKERS),
                NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank),
            )  # fmt: skip
            torch.set_num_threads(1)
            pl.seed_everything(0)
            trainer = pl.Trainer(strategy="ddp", devices=WORKERS, **_trainer_kwargs(out))
            trainer.fit(MLP(), _loader(WORKERS))

    actor = ray.remote(num_cpus=1, num_gpus=1 if GPU else 0)(Rank)
    ranks = [actor.remote() for _ in range(WORKERS)]
    ray.get([each.fit.remote(rank) for rank, each in enumerate(ranks)])
    for each in ranks:
        ray.kill(each)


def run_mode(mode: str, out: str) -> None:
    """Runs one mode once in this process and writes out.driver (rank 0 writes out.rank0)."""
    torch.set_num_threads(1)
    bar = mode in WITH_BAR
    mode = WITH_BAR.get(mode, mode)
    ray_init = 0.0
    if mode == "ray_train":
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        ray_init = _init_ray()
        trainer = TorchTrainer(
            _ray_train_loop,
            train_loop_config={"out": out},
            scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
            run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="bench-ray-train-")),
        )
        call = time.time()
        trainer.fit()
    elif mode == "ray_actors":
        ray_init = _init_ray()
        call = time.time()
        _ddp_in_plain_actors(out)
    else:
        if mode.startswith("ray_sgd"):
            RaySGDStrategy = _ray_sgd_strategy()

            ray_init = _init_ray()
            # max_preemptions=0: no resume checkpoint at a SIGTERM, so no notice exchange
            options = {"max_preemptions": 0} if mode == "ray_sgd_no_preemption" else {}
            strategy: object = RaySGDStrategy(num_workers=WORKERS, use_gpu=GPU, **options)
            if mode != "ray_sgd_cold":  # a first call starts the workers; the timed one reuses them
                pl.seed_everything(0)
                pl.Trainer(strategy=strategy, **_trainer_kwargs(out + ".untimed")).fit(
                    MLP(), _loader(WORKERS)
                )
                strategy = RaySGDStrategy(num_workers=WORKERS, use_gpu=GPU, **options)
            ranks = WORKERS
        elif mode == "single":
            strategy, ranks = "auto", 1
        else:
            strategy, ranks = mode, WORKERS
        kwargs = _trainer_kwargs(out)
        if bar:
            kwargs["enable_progress_bar"] = True
            kwargs["callbacks"] = [*kwargs["callbacks"], pl.callbacks.TQDMProgressBar()]
        if mode in ("ddp", "ddp_spawn"):
            kwargs["devices"] = WORKERS
        pl.seed_everything(0)
        trainer = pl.Trainer(strategy=strategy, **kwargs)
        model, data = MLP(), _loader(ranks)
        call = time.time()
        trainer.fit(model, data)
    returned = time.time()
    if os.environ.get("LOCAL_RANK", "0") == "0":  # Lightning's ddp re-runs this script per rank
        record = {"call": call, "returned": returned, "ray_init": ray_init}
        record["maxrss_mb"] = _maxrss_mb()
        Path(f"{out}.driver").write_text(json.dumps(record))


def measure_transfer(params: int) -> dict[str, float]:
    """Times bringing a model of ``params`` parameters back: RaySGDStrategy against ray.get."""
    import ray

    RaySGDStrategy = _ray_sgd_strategy()

    _init_ray()
    side = int((params / 10) ** 0.5)
    out = tempfile.mktemp(prefix="bench-transfer-")

    class Big(MLP):
        def __init__(self) -> None:
            super().__init__(features=side, hidden=side, layers=10)

    @ray.remote(num_cpus=1)
    class Holder:
        def __init__(self) -> None:
            self.state = Big().state_dict()

        def state_dict(self):
            return self.state

    holder = Holder.remote()
    ray.get(holder.state_dict.remote())  # the actor's model is built; the next get is the timed one
    plain = []
    for _ in range(3):
        start = time.time()
        state = ray.get(holder.state_dict.remote())
        plain.append(time.time() - start)
        del state
    ray.kill(holder)
    count = sum(p.numel() for p in Big().parameters())
    ours = []
    for _ in range(3):
        model = Big()
        trainer = pl.Trainer(
            strategy=RaySGDStrategy(num_workers=1),
            limit_train_batches=1,
            **_trainer_kwargs(out),
        )
        trainer.fit(model, DataLoader(_data(2, side), batch_size=2))
        returned = time.time()
        ours.append(returned - json.loads(Path(f"{out}.rank0").read_text())["fit_end"])
    return {"params": count, "plain_get_s": min(plain), "ray_sgd_back_s": min(ours)}


def measure_shipping(megabytes: int) -> dict[str, float]:
    """Times the call to the first batch on 1, 2 and 4 warm workers, with a dataset of
    ``megabytes`` in memory and with a tiny one; the difference is what shipping the data costs."""
    RaySGDStrategy = _ray_sgd_strategy()

    _init_ray()
    big = DataLoader(_data(megabytes * 2**20 // (FEATURES * 4)), batch_size=BATCH)
    tiny = DataLoader(_data(2 * BATCH), batch_size=BATCH)
    out = tempfile.mktemp(prefix="bench-ship-")
    starts: dict[str, list[float]] = {}
    for _ in range(3):
        for workers in SHIP_WORKERS:
            for name, data in (("tiny", tiny), ("big", big)):
                # warm: the first call starts the workers (or finds them), the second is timed
                for timed in (False, True):
                    strategy = RaySGDStrategy(num_workers=workers, num_cpus_per_worker=WORKERS / 4)
                    kwargs = _trainer_kwargs(out)
                    trainer = pl.Trainer(strategy=strategy, limit_train_batches=2, **kwargs)
                    call = time.time()
                    trainer.fit(MLP(), data)
                    if timed:
                        first = json.loads(Path(f"{out}.rank0").read_text())["first_batch"]
                        starts.setdefault(f"{name}_{workers}", []).append(first - call)
    result = {"dataset_mb": megabytes}
    for key, values in starts.items():
        result[f"start_{key}_s"] = statistics.median(values)
    for workers in SHIP_WORKERS:
        result[f"ship_{workers}_s"] = (
            result[f"start_big_{workers}_s"] - result[f"start_tiny_{workers}_s"]
        )
    return result


#: Seconds between two runs: a run's Ray processes (and Lightning's ``ddp`` children) exit after
#: the run's own process, and would otherwise share the 2 cores with the next run's start.
SETTLE_S = 3.0


def _one_run(mode: str) -> dict[str, float]:
    time.sleep(SETTLE_S)
    out = tempfile.mktemp(prefix=f"bench-{mode}-")
    subprocess.run(
        [sys.executable, __file__, "--run", mode, "--out", out],
        check=True,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "BENCH_LIGHTNING": _ray_train_lightning() if mode == "ray_train" else LIGHTNING,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    driver = json.loads(Path(f"{out}.driver").read_text())
    ranks = [
        json.loads(p.read_text()) for p in sorted(Path(out).parent.glob(Path(out).name + ".rank*"))
    ]
    rank0 = json.loads(Path(f"{out}.rank0").read_text())
    return {
        "start": rank0["first_batch"] - driver["call"],
        "step": rank0["step"],
        "step_first_half": rank0["step_first_half"],
        "step_second_half": rank0["step_second_half"],
        "call": driver["returned"] - driver["call"],
        "back": driver["returned"] - rank0["fit_end"],
        "driver_mb": driver["maxrss_mb"],
        "worker_mb": max(r["maxrss_mb"] for r in ranks),
        "ray_init": driver["ray_init"],
    }


def _in_subprocess(flag: str, value: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, flag, str(value)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + EXTRA_MODES)
    parser.add_argument("--transfer-params", type=int, default=100_000_000)
    parser.add_argument("--ship-mb", type=int, default=256)
    parser.add_argument("--run", choices=MODES + EXTRA_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--transfer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ship", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help="run the modes on this machine's GPUs")
    parser.add_argument("--small", action="store_true", help="a 64-wide MLP: steps of a few ms")
    parser.add_argument("--layers", type=int, default=LAYERS, help="hidden layers (default 2)")
    parser.add_argument("--steps", type=int, default=STEPS_PER_RANK, help="steps per rank")
    args = parser.parse_args()
    # the module's settings (and every run's) read these variables
    wanted = {"BENCH_GPU": args.gpu and not GPU, "BENCH_SMALL": args.small and not SMALL}
    flags = {name: "1" for name, on in wanted.items() if on}
    if args.layers != LAYERS:
        flags["BENCH_LAYERS"] = str(args.layers)
    if args.steps != STEPS_PER_RANK:
        flags["BENCH_STEPS"] = str(args.steps)
    if flags:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **flags})
    if args.run:
        return run_mode(args.run, args.out)
    if args.transfer:
        return print(json.dumps(measure_transfer(args.transfer)))
    if args.ship:
        return print(json.dumps(measure_shipping(args.ship)))

    modes = [m for m in args.modes if m != "ray_train" or _has_ray_train()]
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            runs[mode].append(_one_run(mode))
            print(f"repeat {repeat + 1}/{args.repeats} {mode}: {runs[mode][-1]}", file=sys.stderr)
    medians = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    _print_table(medians, args.repeats, load_before, os.getloadavg())
    if "ddp" in runs:
        _print_paired(runs)
    if args.transfer_params:
        t = _in_subprocess("--transfer", args.transfer_params)
        print(
            f"\nweights back, {t['params'] / 1e6:.0f}M parameters: RaySGDStrategy "
            f"{t['ray_sgd_back_s']:.2f} s, plain ray.get {t['plain_get_s']:.2f} s, "
            f"ratio {t['ray_sgd_back_s'] / t['plain_get_s']:.2f}x"
        )
    if args.ship_mb:
        s = _in_subprocess("--ship", args.ship_mb)
        print(
            f"\nshipping a {args.ship_mb} MB in-memory dataset to warm workers (0.5 CPU each; "
            "call to first batch with the dataset minus with a tiny one; medians of 3):"
        )
        for workers in SHIP_WORKERS:
            print(
                f"  {workers} worker(s): {s[f'ship_{workers}_s']:.2f} s "
                f"({s[f'start_big_{workers}_s']:.2f} - {s[f'start_tiny_{workers}_s']:.2f}), "
                f"{s[f'ship_{workers}_s'] / s['ship_1_s']:.2f}x 1 worker"
            )


def _ray_sgd_strategy() -> type:
    """RaySGDStrategy of the run's Lightning namespace (``BENCH_LIGHTNING``)."""
    flavour = "lightning" if LIGHTNING == "lightning.pytorch" else "pytorch_lightning"
    return importlib.import_module(f"ray_lightning_sgd.{flavour}").RaySGDStrategy


def _ray_train_lightning() -> str:
    """The namespace Ray Train's Lightning strategies are built on: ``lightning.pytorch`` where
    ``lightning`` is installed (beside ``pytorch_lightning`` too), else ``pytorch_lightning``."""
    return "lightning.pytorch" if importlib.util.find_spec("lightning") else "pytorch_lightning"


def _has_ray_train() -> bool:
    try:
        import ray.train.lightning  # noqa: F401
    except ImportError:
        print("ray[train] is not installed: skipping ray_train", file=sys.stderr)
        return False
    return True


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _print_table(medians, repeats, load_before, load_after) -> None:
    ref = medians.get("ddp")
    columns = [
        ("start", "start s", 2),
        ("step", "step ms", 1000),
        ("call", "call s", 2),
        ("back", "back s", 2),
        ("driver_mb", "driver MB", 0),
        ("worker_mb", "worker MB", 0),
    ]
    print(
        f"\n{WORKERS} workers{f' on GPUs ({torch.cuda.get_device_name()}), bf16-mixed' if GPU else ''}"
        f", {_count(sum(p.numel() for p in MLP().parameters()))}-parameter "
        f"MLP, batch {BATCH}, {STEPS_PER_RANK} steps per rank, 1 thread per worker; medians of "
        f"{repeats} fresh-process runs; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; (x) = ratio to Lightning ddp\n"
    )
    print("| mode | " + " | ".join(c[1] for c in columns) + " | ray.init s |")
    print("|---" * (len(columns) + 2) + "|")
    for mode, row in medians.items():
        cells = []
        for key, _, scale in columns:
            value = row[key] * (1000 if scale == 1000 else 1)
            text = f"{value:.0f}" if scale in (0, 1000) else f"{value:.2f}"
            if scale == 1000 and value < 10:  # --small's steps take a few milliseconds
                text = f"{value:.2f}"
            if ref and key != "back" and ref[key] > 0:  # ddp hands nothing back
                text += f" ({row[key] / ref[key]:.2f}x)"
            cells.append(text)
        init = f"{row['ray_init']:.2f}" if row["ray_init"] else "-"
        print(f"| {mode} | " + " | ".join(cells) + f" | {init} |")


def _print_paired(runs: dict[str, list[dict[str, float]]]) -> None:
    """Each repeat's ratio to the ``ddp`` run of the same repeat (the runs next to each other in
    time): medians and ranges, which a machine whose speed drifts moves less than the table's."""
    print("\nratios to the ddp run of the same repeat: median (lowest-highest)\n")
    print("| mode | start | step | call |")
    print("|---|---|---|---|")
    for mode, rows in runs.items():
        if mode == "ddp":
            continue
        cells = []
        for key in ("start", "step", "call"):
            ratios = sorted(r[key] / d[key] for r, d in zip(rows, runs["ddp"], strict=True))
            cells.append(f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
