"""Rank assignment: pure functions over worker metadata, testable without Ray.

Workers are ordered by node (nodes in the order in which they host the placement group's bundles),
then by GPU id, then by bundle index. Global rank, local rank, node rank and local world size follow
from that order. Nodes are told apart by node id, never by IP address: on a one-machine test cluster
every node has the same IP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerMetadata:
    """What a worker reports about itself when it starts."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    actor_id: str = ""
    gpu_ids: tuple[str, ...] = ()


def rank_on_node(
    rank: int | None, meta: WorkerMetadata | None, world_size: int | None = None
) -> str:
    """A rank and where it runs, as every message names one:
    ``rank 3 of 4 (node 1a2b3c4d5e6f, 10.0.0.7, pid 4242)`` (``of 4`` with ``world_size``).

    The node id is cut to 12 characters, as Ray's own messages cut it; the IP alone would not
    tell two nodes of one machine apart. Without metadata: ``rank 3 (not started)``, or, without
    a rank either, a worker that had not reported its metadata yet.
    """
    if rank is None:
        return "a worker that had not reported its metadata yet"
    name = f"rank {rank}" if world_size is None else f"rank {rank} of {world_size}"
    if meta is None:
        return f"{name} (not started)"
    return f"{name} (node {meta.node_id[:12]}, {meta.node_ip}, pid {meta.pid})"


@dataclass(frozen=True)
class WorkerRank:
    """Where one worker stands in the group."""

    global_rank: int
    local_rank: int
    node_rank: int
    local_world_size: int
    world_size: int
    num_nodes: int


def rank_order(metadata: Sequence[WorkerMetadata]) -> list[int]:
    """Returns the indices of ``metadata`` (in bundle order) sorted into rank order."""
    node_order: dict[str, int] = {}
    for meta in metadata:
        node_order.setdefault(meta.node_id, len(node_order))

    def key(index: int) -> tuple[int, tuple[tuple[int, int, str], ...], int]:
        meta = metadata[index]
        return (node_order[meta.node_id], tuple(_gpu_sort_key(g) for g in meta.gpu_ids), index)

    return sorted(range(len(metadata)), key=key)


def assign_ranks(ordered: Sequence[WorkerMetadata]) -> list[WorkerRank]:
    """Returns the rank of each worker of ``ordered``, which must already be in rank order."""
    node_ranks: dict[str, int] = {}
    local_sizes: dict[str, int] = {}
    for meta in ordered:
        node_ranks.setdefault(meta.node_id, len(node_ranks))
        local_sizes[meta.node_id] = local_sizes.get(meta.node_id, 0) + 1

    seen_on_node: dict[str, int] = {}
    ranks = []
    for global_rank, meta in enumerate(ordered):
        local_rank = seen_on_node.get(meta.node_id, 0)
        seen_on_node[meta.node_id] = local_rank + 1
        ranks.append(
            WorkerRank(
                global_rank=global_rank,
                local_rank=local_rank,
                node_rank=node_ranks[meta.node_id],
                local_world_size=local_sizes[meta.node_id],
                world_size=len(ordered),
                num_nodes=len(node_ranks),
            )
        )
    return ranks


def visible_devices(ordered: Sequence[WorkerMetadata]) -> dict[str, tuple[str, ...]]:
    """Returns, per node id, the sorted union of the GPU ids of that node's workers.

    Every worker on a node gets this as its ``CUDA_VISIBLE_DEVICES``, so that all of them see the
    same devices (which NCCL needs to find peers on the same node).
    """
    per_node: dict[str, set[str]] = {}
    for meta in ordered:
        per_node.setdefault(meta.node_id, set()).update(meta.gpu_ids)
    return {node: tuple(sorted(ids, key=_gpu_sort_key)) for node, ids in per_node.items()}


def device_index(meta: WorkerMetadata, node_devices: Sequence[str]) -> int | None:
    """Returns the CUDA device index a worker uses: the position of its first GPU id on its node.

    ``None`` means the worker has no GPU.
    """
    if not meta.gpu_ids:
        return None
    first = min(meta.gpu_ids, key=_gpu_sort_key)
    return list(node_devices).index(first)


def _gpu_sort_key(gpu_id: str) -> tuple[int, int, str]:
    # Ray reports GPU ids as strings of integers; sort them numerically so "10" comes after "9"
    try:
        return (0, int(gpu_id), "")
    except ValueError:
        return (1, 0, gpu_id)
