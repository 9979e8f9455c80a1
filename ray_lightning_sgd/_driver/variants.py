"""Driver side: the three kinds of strategy, each joining :class:`~ray_lightning_sgd._driver.strategy.RayStrategyBase`
with a Lightning strategy: :class:`RaySGDStrategyBase` (``DDPStrategy``),
:class:`RayModelParallelStrategyBase` (``ModelParallelStrategy``, FSDP2) and
:class:`RayFSDPStrategyBase` (``FSDPStrategy``, FSDP1).

Each names its Lightning strategy and module wrapper, and refuses the worker settings it cannot
run; its docstring ends with the worker arguments (see :mod:`~ray_lightning_sgd._driver.signature`).
``ray_lightning_sgd.pytorch_lightning`` and ``ray_lightning_sgd.lightning`` join each with its
worker half and that namespace's Lightning strategy.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ray_lightning_sgd import _compat
from ray_lightning_sgd._driver import signature
from ray_lightning_sgd._driver.strategy import RayStrategyBase
from ray_lightning_sgd.exceptions import ConfigurationError


class RaySGDStrategyBase(RayStrategyBase):
    """Distributed data parallel training on a gang of Ray actors: Lightning's ``DDPStrategy``.

    Takes the arguments of :class:`RayStrategyBase` (the workers), and, as ``**ddp_kwargs``,
    those of :class:`torch.nn.parallel.DistributedDataParallel` (``find_unused_parameters``,
    ``bucket_cap_mb``, ``static_graph``, ...) or of Lightning's ``DDPStrategy``
    (``ddp_comm_hook``, ...).
    """

    strategy_name = "ray_sgd"

    @classmethod
    @override
    def lightning_strategy(cls) -> type:
        return cls.flavour.ddp_strategy

    @classmethod
    @override
    def module_wrapper(cls) -> type:
        return DistributedDataParallel


class _ShardedBase(RayStrategyBase):
    """What the sharded strategies share: the full weights gathered shard by shard for the
    driver, and resume checkpoints saved whole."""

    sharded = True

    @override
    def _check_workers(self) -> None:
        storage = self._run_config.checkpoint_storage
        if storage is not None and "://" in storage and not storage.startswith("file://"):
            raise ConfigurationError(
                f"{type(self).__name__} takes a local checkpoint_storage (a folder every worker's "
                f"node reaches, such as a shared file system), got {storage!r}: Lightning's "
                "sharded strategies write and read checkpoints by local path; mount the "
                "storage, or leave checkpoint_storage out to keep resume checkpoints in the driver"
            )


class RayModelParallelStrategyBase(_ShardedBase):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 with ``fully_shard`` and tensor parallelism,
    applied in ``LightningModule.configure_model`` over ``self.device_mesh``) on a gang of Ray
    actors. Runs on CPU workers (gloo) and GPU workers (NCCL).

    Takes the arguments of :class:`RayStrategyBase` (the workers) and those of Lightning's
    ``ModelParallelStrategy``: ``data_parallel_size``, ``tensor_parallel_size`` (each ``"auto"``
    by default: one data-parallel group per node, tensor parallelism across a node's workers) and
    ``save_distributed_checkpoint``.
    """

    strategy_name = "ray_model_parallel"

    @classmethod
    @override
    def lightning_strategy(cls) -> type:
        return cls.flavour.model_parallel_strategy

    @override
    def _check_workers(self) -> None:
        problem = _compat.torch.cpu_fsdp2_problem(torch.__version__)
        if not self._worker_group_config.use_gpu and problem is not None:
            raise ConfigurationError(f"{type(self).__name__} on CPU workers: {problem}")
        super()._check_workers()


class RayFSDPStrategyBase(_ShardedBase):
    """Lightning's ``FSDPStrategy`` (FSDP1: ``auto_wrap_policy``, activation checkpointing, CPU
    offload) on a gang of Ray actors with GPUs.

    Takes the arguments of :class:`RayStrategyBase` (the workers; ``use_gpu=True`` or GPUs in
    ``resources_per_worker``) and those of Lightning's ``FSDPStrategy``.
    """

    strategy_name = "ray_fsdp"
    precision_family = "fsdp"

    @classmethod
    @override
    def lightning_strategy(cls) -> type:
        return cls.flavour.fsdp_strategy

    @classmethod
    @override
    def module_wrapper(cls) -> type:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel

    @override
    def _check_workers(self) -> None:
        if not self._worker_group_config.use_gpu:
            raise ConfigurationError(
                f"{type(self).__name__} needs GPU workers (pass use_gpu=True): torch's FSDP "
                "(FSDP1) runs on CUDA only. To shard a model across CPU workers, use "
                "RayModelParallelStrategy (FSDP2) and apply fully_shard in configure_model"
            )
        super()._check_workers()


signature.add_worker_arguments(
    RayStrategyBase, (RaySGDStrategyBase, RayModelParallelStrategyBase, RayFSDPStrategyBase)
)
