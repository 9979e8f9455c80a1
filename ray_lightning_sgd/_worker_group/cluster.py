"""Driver side: the connection to Ray, and what the cluster can and cannot give.

:func:`connect` uses a Ray that is already initialised, the cluster named by ``RAY_ADDRESS``, or a
cluster started with ``ray start`` on this machine; when there is none (or the one recorded there no
longer answers), it starts an embedded local instance on 127.0.0.1 only, without a dashboard, which
Ray shuts down when the program exits. An address that answers nothing, ``RAY_ADDRESS=auto`` with
no cluster to find, or a cluster that refuses the driver, is an error within seconds that says what
to check.

:func:`placement_problem` is a pure function that tells, from the nodes' total resources, whether a
gang of workers could ever be placed; the worker group calls it before it reserves anything, so that
an impossible request fails at once instead of waiting.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from ray_lightning_sgd import _compat
from ray_lightning_sgd.exceptions import ClusterConnectionError, ResourcesUnavailableError

log = logging.getLogger(__name__)

_EPSILON = 1e-9


#: How long a cluster's address may take to accept a connection before it counts as dead.
_PROBE_TIMEOUT_S = 3.0
#: How many times the driver tries to reach the GCS of a cluster whose port answered (Ray: 20,
#: a second apart; one that refuses this driver refuses it every time).
_GCS_TRIES = 5


def connect() -> bool:
    """Driver side: makes sure this process is connected to a Ray cluster.

    Returns:
        True if this call started an embedded local Ray instance.

    Raises:
        ClusterConnectionError: ``RAY_ADDRESS`` names an address where no cluster answers, or
            is ``auto`` and no cluster runs on this machine, or the cluster there refused the
            connection (token authentication, most often).
    """
    if ray.is_initialized():
        return False
    named = os.environ.get("RAY_ADDRESS", "")
    if named.startswith("ray://"):  # Ray Client: its own connection
        server = _client_server(named)
        if server is not None and not _answers(server):
            # Ray Client would try three times, for 30 s, then raise a bare ConnectionError
            raise ClusterConnectionError(
                f"RAY_ADDRESS={named!r}: no Ray Client server answers at {server} (waited "
                f"{_PROBE_TIMEOUT_S:g} s); start the cluster (its head serves Ray Client on "
                "port 10001), correct RAY_ADDRESS, or unset it to train on an embedded Ray on "
                "this machine"
            )
        ray.init(log_to_driver=True)
        return False
    try:
        address = _compat.ray.address_to_join()
    except ValueError as err:  # an address Ray cannot parse
        raise ClusterConnectionError(f"RAY_ADDRESS={named!r} is not a Ray address: {err}") from err
    if address is None and named == "auto":
        # Ray's "auto" finds nothing: the user asked for a running cluster, not a new one
        raise ClusterConnectionError(
            "RAY_ADDRESS='auto' asks for a running Ray cluster, and none was found on this "
            "machine (no `ray start` cluster recorded, no Ray process running); start the head "
            "first (ray start --head), give the head's address (RAY_ADDRESS=<head-ip>:6379), or "
            "unset RAY_ADDRESS to train on an embedded Ray on this machine"
        )
    if address is not None and not _answers(address):
        if named:
            # Ray would retry for minutes before it gives up
            raise ClusterConnectionError(
                f"RAY_ADDRESS={named!r}: no Ray cluster answers at {address} (waited "
                f"{_PROBE_TIMEOUT_S:g} s); start it (ray start --head), correct RAY_ADDRESS, or "
                "unset it to train on an embedded Ray on this machine"
            )
        log.warning(
            "The Ray cluster last started on this machine (%s) no longer runs; starting an "
            "embedded Ray instance instead",
            address,
        )
        address = None
    if address is not None and _join(address, named):
        return False
    _compat.bind_local_ray_to_loopback()
    ray.init(address="local", include_dashboard=False, log_to_driver=True)
    log.info("Started an embedded local Ray instance: %s", ray.cluster_resources())
    return True


def _client_server(address: str) -> str | None:
    """The ``host:port`` of a ``ray://`` address to probe, or None where a probe could be
    wrong: no port given (gRPC picks its own), or a proxy that gRPC would go through."""
    if any(os.environ.get(name) for name in ("grpc_proxy", "https_proxy", "HTTPS_PROXY")):
        return None
    server = address[len("ray://") :].split("/", 1)[0].split("?", 1)[0]
    if ":" not in server.rsplit("]", 1)[-1]:
        return None
    return server


def _answers(address: str) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` within the probe timeout."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), _PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def _join(address: str, named: str) -> bool:
    """Joins the cluster at ``address``; returns False when it was only found running (another
    program's embedded Ray) and refused us. A refusal by a cluster the user named or started
    with ``ray start`` is an error that says what to check."""
    try:
        # its port answers: a GCS that refuses this driver refuses it at every try
        with _compat.ray.few_gcs_tries(_GCS_TRIES):
            ray.init(address=address, log_to_driver=True)
        return True
    except ConnectionError as err:
        if not named and _compat.ray.recorded_address() != address:
            log.warning(
                "A Ray instance runs on this machine (%s) but refused this driver (%s); "
                "starting an embedded Ray instance instead",
                address,
                err,
            )
            return False
        origin = f"RAY_ADDRESS={named!r}" if named else "the Ray cluster started on this machine"
        hint = (
            "it may require token authentication (clusters that `ray start` starts with Ray 2.60 "
            "do when a token exists on the head node): set RAY_AUTH_MODE=token and give the "
            "cluster's token in RAY_AUTH_TOKEN or the token file (~/.ray/auth_token; "
            "`ray get-auth-token` on the head prints it). Ray never sends a token unless asked"
            if os.environ.get("RAY_AUTH_MODE", "").lower() != "token"
            else "check that RAY_AUTH_TOKEN or the token file holds the token of that cluster "
            "(`ray get-auth-token` on its head node prints it)"
        )
        raise ClusterConnectionError(
            f"could not join {origin} at {address}, which answers on its port: {err}; {hint}. "
            f"(The driver tried {_GCS_TRIES} times, a second apart; for a head that is still "
            "starting, RAY_NUM_REDIS_GET_RETRIES=20 tries longer)"
        ) from err


def check_placement_is_possible(
    bundle: Mapping[str, float],
    num_workers: int,
    strategy: str,
    head: Mapping[str, float] | None = None,
) -> None:
    """Driver side: raises if the cluster's nodes could never host the workers (beside a
    ``head`` bundle in the same placement group: a Ray Tune trial's own process).

    Raises:
        ResourcesUnavailableError: Naming what was requested and what the cluster has.
    """
    nodes = node_resources()
    if head:
        problem = _problem_beside(head, bundle, num_workers, strategy, nodes)
    else:
        problem = placement_problem(bundle, num_workers, strategy, nodes)
    if problem is not None:
        raise ResourcesUnavailableError(
            f"cannot place {num_workers} workers of {dict(bundle)} ({strategy}): {problem}. "
            f"{describe_available()}. Ask for less per worker (num_cpus_per_worker, use_gpu, "
            "resources_per_worker), fewer workers, another placement_strategy, or add nodes"
        )


def node_resources() -> list[Mapping[str, float]]:
    """Driver side: each live node's total resources."""
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def placement_problem(
    bundle: Mapping[str, float],
    num_workers: int,
    strategy: str,
    nodes: Sequence[Mapping[str, float]],
) -> str | None:
    """Returns why ``num_workers`` bundles can never be placed on ``nodes``, or None if they can.

    ``nodes`` holds each live node's total resources, as ``ray.nodes()`` reports them.
    """
    for name, amount in bundle.items():
        largest = max((node.get(name, 0.0) for node in nodes), default=0.0)
        if largest <= 0:
            return f"no node has the resource {name!r}"
        if largest + _EPSILON < amount:
            return f"no node has {amount:g} {name}; the largest node has {largest:g}"
    fits = [_bundles_that_fit(bundle, node) for node in nodes]
    if strategy == "STRICT_PACK":
        if max(fits, default=0) < num_workers:
            return (
                f"STRICT_PACK needs one node for all of them, and no node fits more than "
                f"{max(fits, default=0)}"
            )
    elif strategy == "STRICT_SPREAD":
        usable = sum(1 for n in fits if n >= 1)
        if usable < num_workers:
            return f"STRICT_SPREAD needs {num_workers} nodes, and only {usable} node(s) fit one"
    elif sum(fits) < num_workers:
        return f"all nodes together fit only {sum(fits)}"
    return None


def describe_available() -> str:
    """Driver side: one sentence on the cluster's total and free resources."""
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return (
        f"the cluster has {_summary(ray.cluster_resources())} in total over {nodes} node(s), "
        f"{_summary(ray.available_resources())} free now"
    )


def _problem_beside(
    head: Mapping[str, float],
    bundle: Mapping[str, float],
    num_workers: int,
    strategy: str,
    nodes: Sequence[Mapping[str, float]],
) -> str | None:
    """Why the workers can never be placed beside ``head`` (one more bundle of their placement
    group), or None: some node holds the head and the rest of the cluster the workers."""
    first: str | None = None
    for i, node in enumerate(nodes):
        if _bundles_that_fit(head, node) < 1:
            continue
        rest = {name: amount - head.get(name, 0.0) for name, amount in node.items()}
        others: list[Mapping[str, float]]
        if strategy == "STRICT_PACK":
            others = [rest]  # every bundle on the head's node
        elif strategy == "STRICT_SPREAD":
            others = [n for j, n in enumerate(nodes) if j != i]  # each bundle a node of its own
        else:
            others = [rest if j == i else n for j, n in enumerate(nodes)]
        problem = placement_problem(bundle, num_workers, strategy, others)
        if problem is None:
            return None
        first = first or problem
    if first is None:
        return f"no node has the head bundle {dict(head)}"
    return f"{first}, beside the head bundle {dict(head)}"


def _bundles_that_fit(bundle: Mapping[str, float], node: Mapping[str, float]) -> int:
    return min(
        math.floor(node.get(name, 0.0) / amount + _EPSILON) for name, amount in bundle.items()
    )


def _summary(resources: Mapping[str, Any]) -> str:
    shown = {
        name: round(float(value), 2)
        for name, value in sorted(resources.items())
        if not name.startswith("node:")
        and name not in ("memory", "object_store_memory")
        # what placement groups hold shows up as resources of its own
        and not _compat.ray.is_placement_group_resource(name)
    }
    return str(shown)
