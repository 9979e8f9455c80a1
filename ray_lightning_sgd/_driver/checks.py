"""Driver side: what is checked before any worker starts: the Trainer's settings, and that the payload pickles."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.precision import WorkerHardware, resolve_precision
from ray_lightning_sgd._driver.strategy_view import StrategyView
from ray_lightning_sgd.exceptions import ConfigurationError

if TYPE_CHECKING:
    import pytorch_lightning as pl


def check_trainer(trainer: pl.Trainer, strategy: StrategyView) -> None:
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


def check_global_batch(trainer: pl.Trainer, model: Any, strategy: StrategyView) -> None:
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
