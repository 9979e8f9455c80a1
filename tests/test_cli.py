"""LightningCLI and the strategy registry: the strategy from flags, a YAML config and its name."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap

import pytest
import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

import ray_lightning_sgd
from ray_lightning_sgd import RaySGDStrategy
from tests.helpers import TinyData, TinyModel, TinyRayData

QUIET = [
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def _cli(args: list[str], run: bool = True, data: type = TinyData) -> LightningCLI:
    """A CLI for the tiny model; with run=False it only parses (and takes no subcommand)."""
    return LightningCLI(
        TinyModel,
        data,
        args=args,
        run=run,
        save_config_callback=None,
        seed_everything_default=0,
    )


def _python(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter; it must succeed."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_cli_flags_train_with_the_strategy(ray_cluster):
    # the datamodule streams Ray Data datasets it makes from its flags (half a CPU a worker
    # leaves Ray Data the cluster's other CPU)
    cli = _cli(
        [
            "fit",
            "--trainer.strategy=ray_lightning_sgd.RaySGDStrategy",
            "--trainer.strategy.num_workers=2",
            "--trainer.strategy.num_cpus_per_worker=0.5",
            "--trainer.strategy.reuse_workers=false",
            "--trainer.max_epochs=1",
            "--data.batch_size=8",
            *QUIET,
        ],
        data=TinyRayData,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RaySGDStrategy)
    assert strategy.worker_group_config.num_workers == 2 and not strategy.reuse_workers
    assert cli.trainer.global_step == 6  # 96 samples, batches of 8, over 2 workers
    assert cli.trainer.state.finished


def test_a_yaml_config_sets_the_strategy(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            """
            trainer:
              max_epochs: 1
              strategy:
                class_path: ray_lightning_sgd.RaySGDStrategy
                init_args:
                  num_workers: 3
                  num_cpus_per_worker: 0.5
                  placement_strategy: SPREAD
                  max_failures: 2
                  progress_timeout_s: 30
            """
        )
    )
    cli = _cli([f"--config={config}", *QUIET], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RaySGDStrategy)
    assert strategy.worker_group_config.num_workers == 3
    assert strategy.worker_group_config.resources_per_worker == {"CPU": 0.5}
    assert strategy.worker_group_config.placement_strategy == "SPREAD"
    assert strategy.run_config.max_failures == 2
    assert strategy.failure_config is strategy.run_config  # the earlier name
    assert strategy.run_config.progress_timeout_s == 30


def test_a_bad_value_on_the_command_line_names_the_argument(capsys):
    with pytest.raises(SystemExit):
        _cli(
            [
                "--trainer.strategy=ray_lightning_sgd.RaySGDStrategy",
                "--trainer.strategy.num_workers=two",
            ],
            run=False,
        )
    assert "num_workers" in capsys.readouterr().err


def test_the_strategy_name_works_on_the_command_line():
    cli = _cli(["--trainer.strategy=ray_sgd", *QUIET], run=False)
    assert isinstance(cli.trainer.strategy, RaySGDStrategy)


def test_cli_help_lists_the_typed_arguments():
    # --help exits; a subprocess keeps jsonargparse's output and exit apart from this process
    code = (
        "from pytorch_lightning.cli import LightningCLI\n"
        "from tests.helpers import TinyData, TinyModel, TinyRayData\n"
        "LightningCLI(TinyModel, TinyData, args=['fit', '--trainer.strategy.help', "
        "'ray_lightning_sgd.RaySGDStrategy'])\n"
    )
    out = _python(code)
    help_text = " ".join(out.stdout.split()).split("Help for", 1)[1]
    for flag, kind in [
        ("num_workers", "int"),
        ("num_cpus_per_worker", "float"),
        ("use_gpu", "bool"),
        ("max_failures", "int"),
        ("progress_timeout_s", "float"),
        ("checkpoint_storage", "str"),
    ]:
        entry = help_text.split(f"--trainer.strategy.{flag} ", 1)[1].split("--trainer.", 1)[0]
        # jsonargparse writes optional types as "float | null" or "Optional[float]"
        assert f"(type: {kind}" in entry or f"(type: Optional[{kind}]" in entry, (flag, entry)


def test_the_registry_names_the_strategy_in_both_namespaces():
    import lightning.pytorch as lp

    trainer = pl.Trainer(strategy="ray_sgd", logger=False, enable_checkpointing=False)
    assert type(trainer.strategy) is ray_lightning_sgd.pytorch_lightning.RaySGDStrategy
    assert trainer.strategy.worker_group_config.num_workers == 1
    trainer = lp.Trainer(strategy="ray_sgd", logger=False, enable_checkpointing=False)
    assert type(trainer.strategy) is ray_lightning_sgd.lightning.RaySGDStrategy
    assert "ray_sgd" in pl.strategies.StrategyRegistry.available_strategies()


def test_importing_the_package_first_registers_the_name_when_lightning_comes():
    code = (
        "import sys, ray_lightning_sgd\n"
        "assert 'pytorch_lightning' not in sys.modules\n"
        "import pytorch_lightning as pl\n"
        "t = pl.Trainer(strategy='ray_sgd', logger=False)\n"
        "print(type(t.strategy).__module__)\n"
    )
    out = _python(code)
    assert out.stdout.strip().endswith("ray_lightning_sgd.pytorch_lightning")


@pytest.mark.parametrize(
    "strategy, lightning_argument",
    [
        ("RaySGDStrategy", "find_unused_parameters"),
        ("RayModelParallelStrategy", "tensor_parallel_size"),
        ("RayFSDPStrategy", "auto_wrap_policy"),
    ],
)
def test_cli_help_lists_the_arguments_the_strategy_takes_only(strategy, lightning_argument, capsys):
    with pytest.raises(SystemExit):
        _cli(["--trainer.strategy.help", f"ray_lightning_sgd.{strategy}"], run=False)
    shown = set(re.findall(r"--trainer\.strategy\.(\w+)", capsys.readouterr().out))
    assert {"num_workers", "use_gpu", "max_failures", lightning_argument} <= shown, shown
    # Lightning's arguments that the strategy decides itself, which its constructor refuses
    refused = {"parallel_devices", "cluster_environment", "start_method", "timeout"}
    assert not shown & (refused | {"process_group_backend", "device_ids", "strategy_kwargs"})
    parameters = inspect.signature(getattr(ray_lightning_sgd, strategy)).parameters
    assert lightning_argument in parameters and not refused & set(parameters)
