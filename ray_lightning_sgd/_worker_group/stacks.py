"""A thread's Python stack, read from another thread of the same process, and what it says.

The worker's poll thread reads the stack of the thread that runs the driver's function (the
training thread) without stopping it and without py-spy (``sys._current_frames``, a public
function of CPython's ``sys`` module). From the frames it names the Lightning hook the thread is
in (the innermost of Lightning's ``trainer/call.py`` functions that call hooks, by its
``hook_name``) and the ``torch.distributed`` collective it waits in, if any.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from types import FrameType

#: Where torch's collectives are, by the ending of their file's path.
_DISTRIBUTED = os.sep.join(("torch", "distributed", ""))
#: Lightning's module that calls every hook (both namespaces).
_LIGHTNING_CALLS = os.sep.join(("trainer", "call.py"))


@dataclass(frozen=True)
class ThreadStack:
    """A thread's stack at one moment, and what it says."""

    #: The stack as ``traceback.format_stack`` writes it, outermost call first.
    text: str
    #: The Lightning hook the thread is in (``training_step``, ``on_validation_epoch_end``,
    #: ...), or None outside any.
    hook: str | None
    #: The ``torch.distributed`` function the thread waits in (``all_gather``, ``barrier``,
    #: ...), or None when it is in none. A DDP backward's gradient all-reduce runs in torch's
    #: C++ autograd engine, below ``backward``: that one reads ``backward (DDP's all-reduce
    #: of gradients, or the backward itself)``.
    collective: str | None
    #: The innermost frame outside torch and Lightning (``file:line in function``): the user's
    #: own code where it is in the stack.
    user_frame: str | None


def stack_of(thread_id: int) -> ThreadStack | None:
    """The stack of the thread ``thread_id`` of this process, or None when it does not run."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    return describe(frame)


def describe(frame: FrameType) -> ThreadStack:
    """What the stack that ends in ``frame`` says."""
    entries = traceback.extract_stack(frame)
    hook = None
    walker: FrameType | None = frame
    while walker is not None:  # innermost first
        if walker.f_code.co_filename.endswith(_LIGHTNING_CALLS) and "hook_name" in walker.f_locals:
            hook = str(walker.f_locals["hook_name"])
            break
        walker = walker.f_back
    # outermost first: the collective the user's code called (c10d's functions, under the
    # wrappers torch and Lightning put around them)
    collectives = [
        entry.name
        for entry in entries
        if _DISTRIBUTED in entry.filename
        and entry.filename.endswith("distributed_c10d.py")
        and not entry.name.startswith("_")
    ]
    collective = collectives[0] if collectives else None
    if collective is None and entries and entries[-1].name == "_engine_run_backward":
        collective = "backward (DDP's all-reduce of gradients, or the backward itself)"
    if collective is None:
        collective = _waiting_inside_torch_distributed(entries)
    user = next(
        (
            f"{entry.filename}:{entry.lineno} in {entry.name}"
            for entry in reversed(entries)
            if not _is_library(entry.filename)
        ),
        None,
    )
    # the frames of Ray's actor and of this package that run the driver's function are the same
    # in every stack: it starts at the first frame of the function's own code
    first = next((i for i, e in enumerate(entries) if not _is_runner(e.filename)), 0)
    shown = traceback.format_list(entries[first:])
    return ThreadStack("".join(shown), hook, collective, user)


#: torch's functions outside c10d's own that wait for the other ranks, by the end of their
#: file's path, and the collective each stands for in the report (one name for each kind, so
#: that the ranks of one step read alike).
_TORCH_WAITS = {
    os.sep.join(("nn", "parallel", "distributed.py")): (
        {"_distributed_broadcast_coalesced", "_sync_buffers", "_sync_module_buffers",
         "_default_broadcast_coalesced", "_sync_params_and_buffers"},
        "DDP's broadcast of buffers (before a forward)",
    ),
    os.sep.join(("distributed", "_functional_collectives.py")): (
        {"wait_tensor", "wait_tensors", "wait"},
        "a functional collective's wait (DTensor, tensor parallelism)",
    ),
    os.sep.join(("_fully_shard", "_fsdp_param_group.py")): (
        {"wait_for_unshard", "unshard", "post_backward", "wait_for_reduce_scatter"},
        "FSDP2's all-gather or reduce-scatter",
    ),
    os.sep.join(("_fully_shard", "_fsdp_collectives.py")): (
        {"foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"},
        "FSDP2's all-gather or reduce-scatter",
    ),
}  # fmt: skip


def _waiting_inside_torch_distributed(entries: traceback.StackSummary) -> str | None:
    """Where the innermost library frames of a stack wait on the other ranks in torch outside
    c10d's own functions (:data:`_TORCH_WAITS`); None for anything else they may be doing."""
    for entry in reversed(entries):
        if not _is_library(entry.filename):
            return None
        in_torch = os.sep + "torch" + os.sep in entry.filename
        for ending, (names, collective) in _TORCH_WAITS.items():
            if in_torch and entry.name in names and entry.filename.endswith(ending):
                return collective
    return None


def _is_runner(filename: str) -> bool:
    parts = filename.split(os.sep)
    return "ray" in parts or "ray_lightning_sgd" in parts


def _is_library(filename: str) -> bool:
    parts = filename.split(os.sep)
    return (
        "site-packages" in parts
        or "dist-packages" in parts
        or filename.startswith(os.path.dirname(os.__file__))
        or "ray_lightning_sgd" in parts
    )
