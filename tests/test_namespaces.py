"""Both Lightning namespaces: pytorch_lightning and lightning.pytorch, one implementation."""

from __future__ import annotations

import inspect
import subprocess
import sys

import lightning as L
import pytest
import pytorch_lightning as pl
import torch

import ray_lightning_sgd
from ray_lightning_sgd import ConfigurationError
from ray_lightning_sgd import lightning as rls_lightning
from ray_lightning_sgd import pytorch_lightning as rls_pl
from ray_lightning_sgd._compat import flavour
from ray_lightning_sgd._driver.launcher import RayLauncherBase
from ray_lightning_sgd._driver.variants import RaySGDStrategyBase
from tests.helpers import TinyModel, TinyModelSteps, loader, quiet_trainer_kwargs


class LTinyModel(TinyModelSteps, L.LightningModule):
    """TinyModelSteps as a lightning.pytorch module."""


def test_each_namespace_gets_strategy_classes_of_its_own():
    for module, namespace, other in (
        (rls_pl, pl, L.pytorch),
        (rls_lightning, L.pytorch, pl),
    ):
        strategy = module.RaySGDStrategy(num_workers=2)
        assert isinstance(strategy, namespace.strategies.DDPStrategy)
        assert not isinstance(strategy, other.strategies.Strategy)
        assert isinstance(strategy, RaySGDStrategyBase)
        assert strategy.flavour.ddp_strategy is namespace.strategies.DDPStrategy
        strategy._configure_launcher()
        assert isinstance(strategy.launcher, module.RayLauncher)
        assert isinstance(strategy.launcher, RayLauncherBase)
    # one implementation: the namespaced classes define no methods of their own; a strategy's
    # __init__ is the base's, under the signature of what that strategy accepts (one wrapper)
    generated = vars(rls_pl.RaySGDStrategy)["__init__"].__code__
    for module in (rls_pl, rls_lightning):
        for cls in (module.RaySGDStrategy, module.RayLauncher, module.RayEnvironment):
            own = {
                k for k, v in vars(cls).items() if inspect.isfunction(v) or isinstance(v, property)
            }
            if cls is module.RaySGDStrategy:
                assert vars(cls)["__init__"].__code__ is generated
                own.discard("__init__")
            assert own == set(), f"{cls.__module__}.{cls.__name__} defines {own}"


def test_the_top_level_name_is_pytorch_lightnings_where_it_is_installed():
    assert ray_lightning_sgd.RaySGDStrategy is rls_pl.RaySGDStrategy
    assert ray_lightning_sgd.RayEnvironment is rls_pl.RayEnvironment
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = ray_lightning_sgd.Nope  # type: ignore[attr-defined]


def test_without_pytorch_lightning_the_top_level_name_is_lightnings():
    code = (
        "import sys; sys.modules['pytorch_lightning'] = None\n"
        "import ray_lightning_sgd\n"
        "print(ray_lightning_sgd.RaySGDStrategy.__module__)\n"
        "assert 'pytorch_lightning' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ray_lightning_sgd.lightning"


def test_importing_the_package_imports_no_lightning():
    code = (
        "import sys, ray_lightning_sgd\n"
        "print(sorted(m for m in ('pytorch_lightning', 'lightning') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("trainer_cls", "strategy_cls", "hint"),
    [
        (L.Trainer, rls_pl.RaySGDStrategy, "ray_lightning_sgd.lightning.RaySGDStrategy"),
        (pl.Trainer, rls_lightning.RaySGDStrategy, "ray_lightning_sgd.pytorch_lightning"),
    ],
    ids=["lightning-trainer-pl-strategy", "pl-trainer-lightning-strategy"],
)
def test_mixing_namespaces_gives_lightnings_error_with_the_right_class(
    trainer_cls, strategy_cls, hint
):
    with pytest.raises(ValueError, match="invalid strategy") as caught:
        trainer_cls(strategy=strategy_cls(num_workers=2), **quiet_trainer_kwargs())
    assert hint in str(caught.value)


def test_versions_older_than_tested_are_refused(monkeypatch):
    monkeypatch.setattr(flavour.metadata, "version", lambda name: "2.4.0")
    with pytest.raises(ConfigurationError, match=r"pytorch-lightning >= 2\.5, found 2\.4\.0"):
        flavour.check_version("pytorch-lightning")
    monkeypatch.setattr(flavour.metadata, "version", lambda name: "2.6.6")
    flavour.check_version("lightning")


def _fit(trainer_cls, strategy_cls, model_cls):
    pl.seed_everything(0)
    model = model_cls()
    trainer = trainer_cls(
        strategy=strategy_cls(num_workers=2),
        accelerator="cpu",
        max_epochs=2,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, loader(shuffle=True), loader(n=40))
    metrics = trainer.validate(model, loader(n=40), verbose=False)
    return trainer, model, metrics


def test_lightning_and_pytorch_lightning_trainers_train_alike_in_one_process(ray_cluster):
    # a codebase that mixes both namespaces: each Trainer with a strategy of its own namespace
    pl_trainer, pl_model, pl_metrics = _fit(pl.Trainer, rls_pl.RaySGDStrategy, TinyModel)
    l_trainer, l_model, l_metrics = _fit(L.Trainer, rls_lightning.RaySGDStrategy, LTinyModel)
    assert isinstance(l_trainer.strategy, L.pytorch.strategies.DDPStrategy)
    assert l_trainer.global_step == pl_trainer.global_step == 12
    assert l_trainer.current_epoch == pl_trainer.current_epoch == 2
    for key, value in pl_model.state_dict().items():
        assert torch.allclose(l_model.state_dict()[key], value, atol=1e-6), key
    assert l_metrics[0]["val_loss"] == pytest.approx(pl_metrics[0]["val_loss"], abs=1e-6)
    predictions = l_trainer.predict(l_model, loader(n=20, batch_size=5))
    assert torch.allclose(torch.cat(predictions), l_model(loader(n=20).dataset.tensors[0]))
