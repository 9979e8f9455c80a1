"""What this package reads of torch's errors and internals, in one place, with a test in
``tests/test_compat.py``.

torch.distributed reports a lost peer (a rank whose process or node vanished) through its own
exception classes on recent releases and through ``RuntimeError`` messages of gloo on others.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

#: The first torch whose FSDP2 (``fully_shard``) runs on CPU: torch 2.6's calls CUDA's stream API
#: on the CPU too (``'Stream' object has no attribute 'record_event'``), in Lightning's own
#: ModelParallelStrategy as in ours.
CPU_FSDP2_SINCE = "2.7"

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


#: The names of the wrappers that FSDP1 and activation checkpointing put between a module and
#: its submodules; torch's state dicts leave them out of the names, as must ours.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def unwrapped_name(name: str) -> str:
    """A submodule's tensor's name as the model's state dict has it, without its wrappers'."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def non_persistent_buffers(module: Any) -> list[tuple[str, dict[str, Any], str]]:
    """A module's buffers that its state dict leaves out (registered with ``persistent=False``;
    torch lists them in each submodule's ``_non_persistent_buffers_set``): each one's qualified
    name, the table that holds it (its submodule's ``_buffers``) and its name there."""
    return [
        (f"{path}.{name}" if path else name, owner._buffers, name)
        for path, owner in module.named_modules()
        for name in sorted(owner._non_persistent_buffers_set)
    ]


def mesh_key(mesh: Any) -> tuple[Any, ...]:
    """Runs on each worker. What makes two device meshes alike: their device, shape, ranks and
    names, over the same default process group."""
    import torch.distributed as dist

    return (
        mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
        mesh.mesh_dim_names, id(dist.GroupMember.WORLD),
    )  # fmt: skip


def cpu_fsdp2_problem(version: str) -> str | None:
    """Why torch ``version`` cannot shard a model with FSDP2 on CPU workers, or None if it can."""
    if Version(version).release >= Version(CPU_FSDP2_SINCE).release:
        return None
    return (
        f"torch {version}'s FSDP2 (fully_shard) runs on CUDA only: it calls CUDA's stream API on "
        f"the CPU as well. Install torch>={CPU_FSDP2_SINCE}, or use GPU workers (use_gpu=True)"
    )


#: Where torch.compile's wrapper (``OptimizedModule``) keeps the module it compiled: the names of
#: a compiled submodule's weights and submodules carry it (``<name>._orig_mod.<...>``).
COMPILED_MODULE_ATTRIBUTE = "_orig_mod"


def uncompiled_name(name: str) -> str:
    """A weight's or submodule's name (or a state dict key) as the model has it uncompiled:
    without the part that compiling a submodule adds (``<name>._orig_mod.<...>``)."""
    return name.replace(f".{COMPILED_MODULE_ATTRIBUTE}", "")
