"""The torch backend: a ``torch.distributed`` process group across the worker group.

``on_start`` asks worker 0 for the rendezvous address and a free port, then joins every worker to
the process group at once (``init_process_group`` blocks until all ranks have joined, so the joins
must run concurrently). The driver never joins. ``on_shutdown`` destroys the group on every worker
and waits a bounded time.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from ray_lightning_sgd._backend.base import Backend, BackendConfig
from ray_lightning_sgd._worker_group.config import seconds_problem
from ray_lightning_sgd._worker_group.group import WorkerGroup
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata, WorkerRank
from ray_lightning_sgd.exceptions import ConfigurationError, WorkerTimeoutError

log = logging.getLogger(__name__)

#: The least time the workers have to join the process group, whatever ``startup_timeout_s``.
JOIN_FLOOR_S = 300.0

BACKENDS = ("gloo", "nccl")
INIT_METHODS = ("env", "tcp")
_SHUTDOWN_WAIT_S = 10.0


@dataclass(frozen=True)
class TorchConfig(BackendConfig):
    """How the workers form their ``torch.distributed`` process group.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; None picks gloo without GPUs and NCCL with them.
        init_method: ``"env"`` (rendezvous through MASTER_ADDR/MASTER_PORT) or ``"tcp"``
            (through a ``tcp://`` URL).
        timeout_s: Timeout of the process group's rendezvous and collectives, in seconds.
    """

    backend: str | None = None
    init_method: str = "env"
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.backend is not None and (
            not isinstance(self.backend, str) or self.backend not in BACKENDS
        ):
            raise ConfigurationError(
                f"TorchConfig.backend must be one of {', '.join(BACKENDS)} or None (gloo on CPU, "
                f"NCCL on GPU), got {self.backend!r}"
            )
        if not isinstance(self.init_method, str) or self.init_method not in INIT_METHODS:
            raise ConfigurationError(
                f"TorchConfig.init_method must be one of {', '.join(INIT_METHODS)}, "
                f"got {self.init_method!r}"
            )
        problem = seconds_problem(self.timeout_s)
        if problem is not None:
            raise ConfigurationError(f"TorchConfig.timeout_s {problem}")

    @property
    def backend_cls(self) -> type[Backend]:
        return TorchBackend

    def resolve_backend(self, use_gpu: bool) -> str:
        """Returns the process group backend to use for workers with or without GPUs."""
        if self.backend is not None:
            return self.backend
        return "nccl" if use_gpu else "gloo"


class TorchBackend(Backend):
    """Sets up and tears down the ``torch.distributed`` process group on every worker."""

    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        if not isinstance(backend_config, TorchConfig):
            raise TypeError(f"TorchBackend takes a TorchConfig, got {backend_config!r}")
        use_gpu = any(meta.gpu_ids for meta in worker_group.metadata)
        backend = backend_config.resolve_backend(use_gpu)
        if backend == "nccl":
            check_one_rank_per_gpu(worker_group.metadata)
        # every worker imports torch now, at once; else each would on its first call, one by one
        worker_group.execute(_imported)
        address, port = worker_group.execute_single(0, _rendezvous_address)
        log.debug(
            "Joining %d workers to a %s process group at %s:%d",
            len(worker_group),
            backend,
            address,
            port,
        )
        # each worker joins under the rank and device its group assigned, given as arguments;
        # one that cannot reach the port would wait the whole process group timeout (30 min)
        # (not less than JOIN_FLOOR_S: NCCL's set-up on hundreds of GPUs can take minutes)
        join_s = min(
            backend_config.timeout_s, max(worker_group.config.startup_timeout_s, JOIN_FLOOR_S)
        )
        joins = [
            worker_group.execute_single_async(
                index,
                _init_process_group,
                rank=worker.rank,
                device_index=worker.device_index,
                backend=backend,
                init_method=backend_config.init_method,
                address=address,
                port=port,
                timeout_s=backend_config.timeout_s,
            )
            for index, worker in enumerate(worker_group.workers)
        ]
        try:
            worker_group.get(joins, timeout_s=join_s)
        except WorkerTimeoutError as err:
            raise WorkerTimeoutError(
                f"the {len(worker_group)} workers did not all join the {backend} process group "
                f"at {address}:{port} (worker 0's node) within {join_s:g}s (startup_timeout_s, "
                f"at least {JOIN_FLOOR_S:g}s, or TorchConfig.timeout_s if lower): a worker's "
                "node cannot reach that port, most often a firewall between the nodes or "
                "another network interface. Open the "
                "ports between the nodes, or name the interface in worker_env "
                "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), or raise startup_timeout_s if the "
                "join is only slow"
            ) from err

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        refs = worker_group.execute_async(_destroy_process_group)
        _done, pending = ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_WAIT_S)
        if pending:
            log.warning(
                "%d of %d workers did not destroy their process group within %.0fs; "
                "they are killed instead",
                len(pending),
                len(refs),
                _SHUTDOWN_WAIT_S,
            )


def check_one_rank_per_gpu(metadata: Sequence[WorkerMetadata]) -> None:
    """Raises if two workers share a GPU, which NCCL refuses (with an opaque message).

    Workers that ask for a fraction of a GPU (``resources_per_worker={"GPU": 0.5}``) may be placed
    on the same one.
    """
    holders: dict[tuple[str, str], list[int]] = {}
    for index, meta in enumerate(metadata):
        for gpu in meta.gpu_ids:
            holders.setdefault((meta.node_id, gpu), []).append(index)
    for (_node_id, gpu), workers in holders.items():
        if len(workers) < 2:
            continue
        node = metadata[workers[0]].node_ip
        raise ConfigurationError(
            f"workers {', '.join(map(str, workers))} share GPU {gpu} on node {node} (each asked "
            "for a fraction of a GPU), and NCCL runs one rank per GPU; give each worker a whole "
            "GPU (use_gpu=True, or resources_per_worker={'GPU': 1}), or keep the fractions and "
            "use gloo: backend_config=TorchConfig(backend='gloo')"
        )


def _imported() -> None:
    """Runs on each worker. Nothing: unpickling it imports this module, and torch with it."""


def _rendezvous_address() -> tuple[str, int]:
    """Runs on each worker (on worker 0). Returns this node's address and a free port on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _init_process_group(
    rank: WorkerRank,
    device_index: int | None,
    backend: str,
    init_method: str,
    address: str,
    port: int,
    timeout_s: float,
) -> None:
    """Runs on each worker. Joins the process group as ``rank``, on CUDA device ``device_index``
    with NCCL; sets the environment variables that torch.distributed's tools read."""
    os.environ.update(
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        RANK=str(rank.global_rank),
        WORLD_SIZE=str(rank.world_size),
        LOCAL_RANK=str(rank.local_rank),
        LOCAL_WORLD_SIZE=str(rank.local_world_size),
        NODE_RANK=str(rank.node_rank),
    )
    device_id = None
    if backend == "nccl" and device_index is not None:
        # a collective that fails or times out then raises (and ends the process) instead of
        # blocking: the driver sees the worker die (the user's own setting wins)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(device_index)
        # binds the group to this device: NCCL connects at once, not at the first collective
        device_id = torch.device("cuda", device_index)
    url = "env://" if init_method == "env" else f"tcp://{address}:{port}"
    dist.init_process_group(
        backend=backend,
        init_method=url,
        rank=rank.global_rank,
        world_size=rank.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device_id,
    )


def _destroy_process_group() -> None:
    """Runs on each worker. Leaves the process group and frees cached GPU memory."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
