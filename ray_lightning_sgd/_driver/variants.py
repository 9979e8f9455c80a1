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

import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ray_lightning_sgd import _compat
from ray_lightning_sgd._driver import signature
from ray_lightning_sgd._driver.strategy import RayStrategyBase
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata
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
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Lightning's; on the driver (``trainer.save_checkpoint`` after a call), a checkpoint
        without the optimizers' state says so: it stays sharded on the workers, and
        ``fit(ckpt_path=...)`` cannot resume from such a file."""
        import torch.distributed as dist

        if not dist.is_initialized() and checkpoint.get("optimizer_states") == []:
            warnings.warn(
                f"{type(self).__name__}: the checkpoint the driver writes to {str(filepath)!r} "
                "holds the model's weights but not the optimizers' state, which stays sharded on "
                "the workers: Trainer.fit(ckpt_path=...) cannot resume from it. Resume from a "
                "checkpoint the workers wrote (a ModelCheckpoint's; a run's resume checkpoints), "
                "or save the weights alone (trainer.save_checkpoint(path, weights_only=True))",
                RuntimeWarning,
                stacklevel=2,
            )
        super().save_checkpoint(checkpoint, filepath, storage_options)


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

    _tensor_parallel: int | str = "auto"
    _data_parallel: int | str = "auto"

    def _resolved(self, metadata: Sequence[WorkerMetadata]) -> list[tuple[int, int]]:
        """The (data, tensor) parallel sizes each worker takes where ``metadata`` placed them,
        one pair for each number of workers a node holds: as Lightning resolves "auto" on each
        worker, the data-parallel size is the number of nodes, the tensor-parallel size the
        number of that worker's node's workers."""
        per_node = Counter(meta.node_id for meta in metadata)
        return [
            (
                len(per_node) if self._data_parallel == "auto" else int(self._data_parallel),
                on_node if self._tensor_parallel == "auto" else int(self._tensor_parallel),
            )
            for on_node in sorted(set(per_node.values()))
        ]

    @override
    def check_placed(self, metadata: Sequence[WorkerMetadata]) -> None:
        workers = len(metadata)
        for data, tensor in self._resolved(metadata):
            if data * tensor != workers:
                per_node = sorted(Counter(meta.node_id for meta in metadata).values())
                raise ConfigurationError(
                    f"{type(self).__name__}: the {workers} workers landed on {len(per_node)} "
                    f"node(s) ({', '.join(str(n) for n in per_node)} a node), where "
                    f"data_parallel_size={self._data_parallel!r} x tensor_parallel_size="
                    f"{self._tensor_parallel!r} resolve to {data} x {tensor} = "
                    f"{data * tensor} ('auto': the nodes, and a node's workers); "
                    "pass both sizes, with a product of the number of workers"
                )

    @override
    def tensor_parallel_size(self, metadata: Sequence[WorkerMetadata] = ()) -> int | None:
        if self._tensor_parallel != "auto":
            return int(self._tensor_parallel)
        return self._resolved(metadata)[0][1] if metadata else None

    @override
    def _check_strategy_kwargs(self, strategy_kwargs: dict[str, Any]) -> None:
        sizes = {
            key: strategy_kwargs.get(key, "auto")
            for key in ("data_parallel_size", "tensor_parallel_size")
        }
        for key, size in sizes.items():
            whole = isinstance(size, int) and not isinstance(size, bool)
            if size != "auto" and not (whole and size >= 1):
                raise ConfigurationError(f"{key} must be 'auto' or an int >= 1, got {size!r}")
        data, tensor = sizes.values()
        self._data_parallel, self._tensor_parallel = data, tensor
        config = self._worker_group_config
        elastic = " (a size this elastic run may take)" if config.sizes else ""
        for workers in config.sizes or (config.num_workers,):
            if data == "auto" and tensor == "auto":
                return  # resolved on the workers from the nodes they landed on, as Lightning does
            if data == "auto" or tensor == "auto":  # known once placed: here, a divisor at least
                key, size = next((k, v) for k, v in sizes.items() if v != "auto")
                if workers % size:
                    raise ConfigurationError(
                        f"{key}={size} must divide the number of workers, {workers}{elastic}: "
                        "data_parallel_size x tensor_parallel_size is the number of workers; "
                        "change it, or leave it at 'auto'"
                    )
            elif data * tensor != workers:
                raise ConfigurationError(
                    f"data_parallel_size={data} x tensor_parallel_size={tensor} must equal the "
                    f"number of workers, {workers}{elastic}; change one of them, or leave them "
                    "at 'auto'"
                )


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
    def _check_strategy_kwargs(self, strategy_kwargs: dict[str, Any]) -> None:
        # what Lightning's FSDPStrategy takes as given and refuses only on the workers
        state_dict_type = strategy_kwargs.get("state_dict_type", "full")
        if state_dict_type not in ("full", "sharded"):
            raise ConfigurationError(
                f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}"
            )
        from torch.distributed.fsdp import CPUOffload, ShardingStrategy

        sharding = strategy_kwargs.get("sharding_strategy", "FULL_SHARD")
        names = list(ShardingStrategy.__members__)
        if not isinstance(sharding, ShardingStrategy) and not (
            isinstance(sharding, str) and sharding.upper() in names
        ):
            raise ConfigurationError(
                f"sharding_strategy must be one of {', '.join(names)} (or torch's "
                f"ShardingStrategy), got {sharding!r}"
            )
        offload = strategy_kwargs.get("cpu_offload")
        if offload is not None and not isinstance(offload, (bool, CPUOffload)):
            raise ConfigurationError(
                f"cpu_offload must be True, False or torch's CPUOffload(...), got {offload!r}"
            )

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
