"""The parts of a Trainer that both halves read: its callbacks, the loop of its call, the objects
that both the driver and rank 0 hold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.payload import FITTING, PREDICTING, TESTING, VALIDATING

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback


def shared_objects(
    trainer: Any, model: Any, datamodule: Any, datasets: Sequence[Any] = ()
) -> dict[str, Any]:
    """The objects that both the driver and rank 0 hold, by the name each travels under
    (:func:`~ray_lightning_sgd._serialization.pack`'s ``shared``): a reference to one of them
    comes back as the driver's own. ``datasets``: the call's Ray Data datasets in the order the
    payload set them aside (on the driver) or this rank's shards of them (on a worker)."""
    names = {"trainer": trainer, "strategy": trainer.strategy, "module:": model}
    for index, dataset in enumerate(datasets):
        names[f"dataset:{index}"] = dataset
    # DDP's wrapper on a worker; the model itself on the driver
    names["wrapped model"] = getattr(trainer.strategy, "model", None) or model
    if datamodule is not None:
        names["datamodule"] = datamodule
    keys = [cb.state_key for cb in callbacks_of(trainer)]
    for callback in callbacks_of(trainer):
        if keys.count(callback.state_key) == 1:
            names[f"callback:{callback.state_key}"] = callback
    for index, logger in enumerate(trainer.loggers):
        names[f"logger:{index}"] = logger
    # a submodule compiled on the workers only (configure_model) has the driver's names
    for name, module in model.named_modules():
        names.setdefault(f"module:{_compat.torch.uncompiled_name(name)}", module)
    for name, parameter in model.named_parameters():
        names[f"parameter:{_compat.torch.uncompiled_name(name)}"] = parameter
    return names


def public_attributes(obj: Any) -> dict[str, Any]:
    """An object's attributes whose names do not start with ``_`` (but its hyperparameters): what
    user code sets on a model or datamodule. Less torch's module flag ``training`` and the
    object's own methods (DDP's forward redirection leaves ``forward`` in the model's
    ``__dict__``)."""
    return {
        key: value
        for key, value in vars(obj).items()
        if (not key.startswith("_") or key == _compat.HPARAMS_ATTRIBUTE)
        and key != "training"
        and getattr(value, "__self__", None) is not obj
    }


def callbacks_of(trainer: pl.Trainer) -> list[Callback]:
    # the Trainer sets this attribute in its callback connector, where type checkers do not see it
    return trainer.callbacks  # type: ignore[attr-defined]


def loop_of(trainer: pl.Trainer) -> Any:
    return {
        FITTING: trainer.fit_loop,
        VALIDATING: trainer.validate_loop,
        TESTING: trainer.test_loop,
        PREDICTING: trainer.predict_loop,
    }[trainer.state.fn.value]  # type: ignore[union-attr]
