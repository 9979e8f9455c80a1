"""What this package reads of torch's errors and internals, in one place, with a test in
``tests/test_compat.py``.

torch.distributed reports a lost peer (a rank whose process or node vanished) through its own
exception classes on recent releases and through ``RuntimeError`` messages of gloo on others.
"""

from __future__ import annotations

from typing import Any

#: torch.distributed's exception classes of a failed collective or rendezvous.
PEER_LOSS_ERRORS = ("DistBackendError", "DistNetworkError")
#: Words of the errors gloo raises on a rank whose peer vanished.
PEER_LOSS_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def reads_as_a_lost_peer(error: BaseException) -> bool:
    """Whether ``error``, raised inside torch, is how torch.distributed reports a lost peer."""
    if type(error).__name__ in PEER_LOSS_ERRORS:
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(m in text for m in PEER_LOSS_MARKERS)


def destroy_mesh_groups(mesh: Any) -> None:
    """Runs on each worker. Destroys the process groups of a device mesh (those still alive; not
    the default group): torch keeps every group until it is destroyed or the process ends."""
    import torch.distributed as dist

    alive = dist.distributed_c10d._world.pg_map
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if group is not dist.GroupMember.WORLD and group in alive:
            dist.destroy_process_group(group)
