"""Driver side: what is checked before any worker starts: the Trainer's settings, and that the payload pickles."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ray import cloudpickle

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.payload import Payload
from ray_lightning_sgd._boundary.precision import WorkerHardware, resolve_precision
from ray_lightning_sgd._driver.settings import LaunchSettings
from ray_lightning_sgd._serialization import Packed, pack
from ray_lightning_sgd.exceptions import ConfigurationError, SerializationError

if TYPE_CHECKING:
    import pytorch_lightning as pl


def check_trainer(trainer: pl.Trainer, strategy: LaunchSettings) -> None:
    """Driver side: rejects Trainer settings that conflict with the strategy, before Ray starts."""
    accelerator = trainer.accelerator
    name = type(strategy).__name__
    cpu, cuda = strategy.flavour.cpu_accelerator, strategy.flavour.cuda_accelerator
    if not isinstance(accelerator, (cpu, cuda)):
        raise ConfigurationError(
            f"{name} trains on CPUs or CUDA GPUs, but the Trainer chose "
            f"{type(accelerator).__name__}; use Trainer(accelerator='auto') or 'cpu', and "
            f"{name}(use_gpu=True) for GPUs"
        )
    if isinstance(accelerator, cpu) and trainer.num_devices > 1:
        raise ConfigurationError(
            f"Trainer(devices={trainer.num_devices}) conflicts with {name}, which runs one "
            "device per worker: remove devices and set "
            f"{name}(num_workers={trainer.num_devices})"
        )
    use_gpu = strategy.worker_group_config.use_gpu
    request = strategy.precision_request
    if use_gpu and request.accelerator == "cpu":
        raise ConfigurationError(
            f"Trainer(accelerator='cpu') conflicts with {name}(use_gpu=True), which gives "
            "each worker a GPU; remove accelerator (or pass 'auto') to train on the workers' GPUs, "
            "or pass use_gpu=False to train on their CPUs"
        )
    if not use_gpu:
        # CPU workers: a precision they cannot run is refused before any of them starts
        resolve_precision(request, WorkerHardware("cpu"))
    if isinstance(accelerator, cuda) and not use_gpu:
        warnings.warn(
            f"The driver's Trainer chose the CUDA accelerator, but {name}(use_gpu=False) "
            "gives the workers no GPU, so they train on CPUs; pass use_gpu=True to give each "
            "worker a GPU",
            stacklevel=4,
        )


def check_global_batch(trainer: pl.Trainer, model: Any, strategy: LaunchSettings) -> None:
    """Driver side: refuses, before Ray starts, what ``keep_global_batch_size`` cannot scale."""
    if not strategy.keep_global_batch_size:
        return
    name = type(strategy).__name__
    if _compat.has_callback(trainer, "GradientAccumulationScheduler"):
        raise ConfigurationError(
            f"{name}(keep_global_batch_size=True) scales Trainer(accumulate_grad_batches=...), "
            "which a GradientAccumulationScheduler sets anew each epoch: remove one of them"
        )
    if model is not None and getattr(model, "automatic_optimization", True) is False:
        raise ConfigurationError(
            f"{name}(keep_global_batch_size=True) scales accumulate_grad_batches, which manual "
            "optimization does not use (Lightning refuses it there): accumulate in "
            "training_step from self.trainer.world_size, or pass keep_global_batch_size=False"
        )


def pack_payload(payload: Payload) -> Packed:
    """Driver side: pickles the payload for the object store, naming what cannot be pickled.

    Tensors travel as out-of-band buffers (see :mod:`ray_lightning_sgd._serialization`): a
    dataset in memory is written into the object store once, however many workers read it.
    """
    try:
        return pack(payload)
    except Exception as err:  # Ray raises TypeError, pickle.PicklingError and others
        culprit = _find_unpicklable(payload, "payload")
        if culprit is None:
            raise
        raise SerializationError(
            f"cannot send the Trainer to the workers: {culprit} cannot be pickled. "
            "Create it inside the LightningModule or DataModule hooks (setup, "
            "configure_model) instead, or keep it out of the objects that are sent"
        ) from err


def _find_unpicklable(
    obj: Any, path: str, depth: int = 0, ancestors: set[int] | None = None
) -> str | None:
    """Returns the attribute path of the innermost object that cannot be pickled, if any.

    An object that fails only because it refers back to an object being searched (a connector that
    holds its Trainer) is not the culprit: the search goes on in its ancestor's other attributes.
    """
    ancestors = set() if ancestors is None else ancestors
    if depth > 40:
        return None
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception:  # noqa: BLE001 - any failure means "look inside"
        pass
    ancestors.add(id(obj))
    refers_back = False
    try:
        for child_path, child in _children(obj, path):
            if id(child) in ancestors:
                refers_back = True
                continue
            found = _find_unpicklable(child, child_path, depth + 1, ancestors)
            if found is not None:
                return found
    finally:
        ancestors.discard(id(obj))
    return None if refers_back else f"{path} (a {type(obj).__module__}.{type(obj).__qualname__})"


def _children(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"{path}[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
    if hasattr(obj, "_fields"):  # a NamedTuple is a tuple; handled above
        return []
    try:
        state = obj.__getstate__()
    except Exception:  # noqa: BLE001 - objects that refuse to give their state have no children
        return []
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots) form
    if isinstance(state, dict):
        return [(f"{path}.{key}", value) for key, value in state.items()]
    return []
