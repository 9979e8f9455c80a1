"""Every private Ray or Lightning name in ray_lightning_sgd._compat still exists where we expect it.

When one of these fails after an upgrade, the message names the attribute that moved.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import ray._private.ray_constants as ray_constants

from ray_lightning_sgd import _compat
from ray_lightning_sgd._compat import ray as _compat_ray
from ray_lightning_sgd import lightning as rls_lightning
from ray_lightning_sgd import pytorch_lightning as rls_pl

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")


def test_ray_loopback_constant_exists():
    assert hasattr(ray_constants, "ENABLE_RAY_CLUSTER"), (
        "ray._private.ray_constants.ENABLE_RAY_CLUSTER moved; update _compat.bind_local_ray_to_loopback"
    )
    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == _compat_ray._RAY_LOOPBACK_ENV, (
        "ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR changed its name"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_launcher_interface_exists(namespace):
    module = importlib.import_module(f"{namespace}.strategies.launchers.launcher")
    assert hasattr(module, "_Launcher"), (
        f"{namespace}.strategies.launchers.launcher._Launcher moved; update "
        "_compat.launcher_interface"
    )
    interface = _compat.launcher_interface(namespace)
    abstract = set(getattr(interface, "__abstractmethods__", ()))
    assert abstract == {"launch", "kill", "is_interactive_compatible"}, (
        f"{namespace}'s _Launcher now asks for {sorted(abstract)}; RayLauncherBase implements "
        "launch, kill and is_interactive_compatible"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_configure_launcher_hook_exists(namespace):
    strategies = importlib.import_module(f"{namespace}.strategies")
    hook = getattr(strategies.DDPStrategy, "_configure_launcher", None)
    assert hook is not None, (
        f"{namespace}.strategies.DDPStrategy._configure_launcher moved; update "
        "_compat.ConfigureLauncher"
    )
    assert "_configure_launcher" in inspect.getsource(strategies.Strategy.__init__) or (
        "_configure_launcher" in inspect.getsource(strategies.DDPStrategy)
    ), f"{namespace} no longer calls Strategy._configure_launcher; update _compat.ConfigureLauncher"
    assert isinstance(inspect.getattr_static(strategies.Strategy, "launcher"), property), (
        f"{namespace}.strategies.Strategy.launcher is no longer a property over _launcher"
    )


@pytest.mark.parametrize("module", [rls_pl, rls_lightning], ids=NAMESPACES)
def test_the_strategy_hands_lightning_its_launcher(module):
    strategy = module.RaySGDStrategy(num_workers=2)
    strategy._configure_launcher()
    assert isinstance(strategy.launcher, module.RayLauncher), (
        "Strategy.launcher no longer returns what _configure_launcher set in _launcher; "
        "update _compat.ConfigureLauncher"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_keeps_committed_metrics_behind_the_properties(namespace):
    trainer = importlib.import_module(namespace).Trainer(logger=False)
    connector = getattr(trainer, "_logger_connector", None)
    assert connector is not None, (
        f"{namespace}.Trainer._logger_connector moved; update _compat.committed_metrics"
    )
    committed = _compat.committed_metrics(trainer)
    properties = (trainer.progress_bar_metrics, trainer.callback_metrics, trainer.logged_metrics)
    for name, dict_, prop in zip(
        ("_progress_bar_metrics", "_callback_metrics", "_logged_metrics"),
        committed,
        properties,
        strict=True,
    ):
        # with no results to compute, each property returns its committed dict itself
        assert isinstance(dict_, dict) and dict_ is prop, (
            f"{namespace}'s logger connector no longer keeps {name} behind the Trainer's "
            "property; update _compat.committed_metrics"
        )
    source = inspect.getsource(type(connector))
    for commit_point in ("def on_batch_end", "def on_epoch_end", "def update_eval_epoch_metrics"):
        assert commit_point in source, (
            f"{namespace}'s logger connector has no {commit_point[4:]} any more: check where "
            "it commits metrics on every rank; update _compat.committed_metrics"
        )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_should_check_val_epoch_exists(namespace):
    trainer = importlib.import_module(namespace).Trainer(logger=False)
    method = getattr(trainer.fit_loop.epoch_loop, "_should_check_val_epoch", None)
    assert callable(method), (
        f"{namespace}'s _TrainingEpochLoop._should_check_val_epoch moved; update "
        "_compat.should_check_val_epoch"
    )
    assert _compat.should_check_val_epoch(trainer) in (True, False)


def test_no_assert_guards_runtime_behaviour():
    # asserts vanish under python -O; the package raises errors that say what went wrong
    import ast
    from pathlib import Path

    import ray_lightning_sgd

    found = []
    for path in Path(ray_lightning_sgd.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], f"assert statements in the package: {found}"
