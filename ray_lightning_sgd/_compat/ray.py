"""Every use of a private attribute of Ray, in one place, each with a test in ``tests/test_compat.py``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import ray._private.ray_constants as _ray_constants

#: Ray reads this environment variable once, at import, into ``ENABLE_RAY_CLUSTER``. With it off,
#: a local instance binds and advertises 127.0.0.1 instead of the machine's external address.
_RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def bind_local_ray_to_loopback() -> None:
    """Driver side: makes the next local Ray instance listen on 127.0.0.1 only.

    Sets the environment variable for Ray's own processes, which read it at start, and the module
    constant for this process, which read it when ``ray`` was imported.
    """
    os.environ[_RAY_LOOPBACK_ENV] = "0"
    _ray_constants.ENABLE_RAY_CLUSTER = False


#: The environment variables with which a user sets how long Ray's driver tries to reach a
#: cluster's GCS: where one is set, :func:`few_gcs_tries` leaves Ray's count alone.
_GCS_TRIES_ENVS = ("RAY_NUM_REDIS_GET_RETRIES", "RAY_gcs_server_port_wait_time_s")


@contextlib.contextmanager
def few_gcs_tries(tries: int) -> Iterator[None]:
    """Driver side, while it joins a cluster whose port answers: Ray's driver tries to reach the
    GCS ``NUM_REDIS_GET_RETRIES`` times (20), about a second apart, also when the GCS refuses it
    (a token cluster and a driver without the token): 20 s before the error. Here at most
    ``tries`` (Ray reads the module constant at each connection), unless the user set how long."""
    if any(name in os.environ for name in _GCS_TRIES_ENVS):
        yield
        return
    saved = _ray_constants.NUM_REDIS_GET_RETRIES
    _ray_constants.NUM_REDIS_GET_RETRIES = min(saved, tries)
    try:
        yield
    finally:
        _ray_constants.NUM_REDIS_GET_RETRIES = saved


def actor_id_of(ref: Any) -> str:
    """Driver side: the id (hex) of the actor whose task returns ``ref`` (for a plain object, an id
    that names no actor of ours; "" for a reference Ray cannot take apart).

    Ray's public API names the actor of a failed task only in some of its errors; the id inside
    the object reference names it always.
    """
    try:
        return str(ref.task_id().actor_id().hex())
    except Exception:  # noqa: BLE001 - an id Ray cannot take apart names no actor
        return ""


#: What the name of a resource that a placement group holds contains (``CPU_group_<id>``, ...).
_PLACEMENT_GROUP_RESOURCE = "_group_"


def is_placement_group_resource(name: str) -> bool:
    """Whether ``name`` in ``ray.cluster_resources()`` is a placement group's share of a resource
    (shown in Ray's resource lists next to the node's own)."""
    return _PLACEMENT_GROUP_RESOURCE in name


def address_to_join() -> str | None:
    """Driver side: the ``host:port`` that ``ray.init(address="auto")`` would join: ``RAY_ADDRESS``,
    else the cluster that ``ray start`` last recorded on this machine (in Ray's temp folder; a
    stopped or crashed one leaves its address there), else a running Ray found by its processes;
    None when there is none."""
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address("auto")
    except ConnectionError:  # nothing recorded and nothing running
        return None


def recorded_address() -> str | None:
    """Driver side: the address (``host:port``, as :func:`address_to_join` gives it) of the
    cluster that ``ray start`` last started on this machine, as recorded in Ray's temp folder
    (None when none is)."""
    from ray._private import services

    address = services.find_bootstrap_address(None)
    return None if address is None else services.canonicalize_bootstrap_address(str(address))


def driver_is_a_client() -> bool:
    """Driver side: whether this process reaches its cluster through Ray Client
    (``ray.init("ray://...")``)."""
    from ray.util.client import ray as client

    return bool(client.is_connected())


def known_row_count(dataset: Any) -> int | None:
    """Driver side: the number of rows of a Ray Data ``Dataset`` when Ray Data knows it without
    running the dataset (its plan's metadata: ``range``, ``from_items``, a materialised dataset,
    a ``limit``), else None. The public ``Dataset.count()`` would run it."""
    count = dataset._meta_count()
    return None if count is None else int(count)


def split_coordinator(iterator: Any) -> Any:
    """Driver side: the actor that ``Dataset.streaming_split`` started to deal the blocks to its
    iterators (one actor for all of them); Ray Data offers no call that ends it."""
    return iterator._coord_actor
