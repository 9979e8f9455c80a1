"""Rank assignment is pure logic: tested on fake metadata, without Ray."""

from ray_lightning_sgd._worker_group.ranks import rank_on_node
from ray_lightning_sgd.ranks import (
    WorkerMetadata,
    assign_ranks,
    device_index,
    rank_order,
    visible_devices,
)


def meta(node: str, pid: int, gpus: tuple[str, ...] = ()) -> WorkerMetadata:
    # every node has the same IP, as on a one-machine test cluster
    return WorkerMetadata(node_id=node, node_ip="10.0.0.1", hostname="h", pid=pid, gpu_ids=gpus)


def test_workers_are_grouped_by_node_id_not_ip():
    bundles = [meta("b", 1), meta("a", 2), meta("b", 3), meta("a", 4)]
    order = rank_order(bundles)
    ordered = [bundles[i] for i in order]
    assert [m.pid for m in ordered] == [1, 3, 2, 4]
    ranks = assign_ranks(ordered)
    assert [(r.global_rank, r.node_rank, r.local_rank) for r in ranks] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert {r.world_size for r in ranks} == {4}
    assert {r.num_nodes for r in ranks} == {2}


def test_gpu_ids_order_workers_within_a_node_numerically():
    bundles = [meta("n", 1, ("10",)), meta("n", 2, ("2",)), meta("n", 3, ("9",))]
    ordered = [bundles[i] for i in rank_order(bundles)]
    assert [m.gpu_ids for m in ordered] == [("2",), ("9",), ("10",)]


def test_local_world_size_differs_per_node():
    ordered = [meta("a", 1), meta("a", 2), meta("a", 3), meta("b", 4)]
    ranks = assign_ranks(ordered)
    assert [r.local_world_size for r in ranks] == [3, 3, 3, 1]
    assert [r.node_rank for r in ranks] == [0, 0, 0, 1]


def test_workers_of_a_node_share_visible_devices_and_pick_their_own():
    ordered = [meta("a", 1, ("3",)), meta("a", 2, ("1",)), meta("b", 3, ("0",))]
    ordered = [ordered[i] for i in rank_order(ordered)]
    devices = visible_devices(ordered)
    assert devices == {"a": ("1", "3"), "b": ("0",)}
    assert [device_index(m, devices[m.node_id]) for m in ordered] == [0, 1, 0]


def test_fractional_gpus_share_one_device():
    ordered = [meta("a", 1, ("0",)), meta("a", 2, ("0",))]
    devices = visible_devices(ordered)
    assert devices == {"a": ("0",)}
    assert [device_index(m, devices["a"]) for m in ordered] == [0, 0]


def test_cpu_workers_have_no_device():
    ordered = [meta("a", 1)]
    assert visible_devices(ordered) == {"a": ()}
    assert device_index(ordered[0], ()) is None


def test_a_rank_is_named_with_its_node_ip_and_pid_the_same_way_everywhere():
    worker = WorkerMetadata(node_id="0123456789abcdef", node_ip="10.0.0.7", hostname="h", pid=42)
    assert rank_on_node(3, worker) == "rank 3 (node 0123456789ab, 10.0.0.7, pid 42)"
    assert rank_on_node(3, worker, 4) == "rank 3 of 4 (node 0123456789ab, 10.0.0.7, pid 42)"
    assert rank_on_node(3, None) == "rank 3 (not started)"
    assert rank_on_node(None, None) == "a worker that had not reported its metadata yet"
