"""Driver side: turns the Ray errors of a group's calls into the exceptions the driver raises."""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from ray_lightning_sgd._compat import ray as _compat_ray
from ray_lightning_sgd._compat import torch as _compat_torch
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata, rank_on_node
from ray_lightning_sgd._worker_group.worker import IN_COLLECTIVE
from ray_lightning_sgd.exceptions import WorkerDiedError, WorkerError, WorkerGroupError

# how long an error of a collective (gloo/NCCL lost its peer) waits for Ray to name the dead peer
_PEER_LOSS_GRACE_S = 5.0


def may_follow_a_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` looks like a collective that failed because another rank vanished.

    Only an error the worker saw raised inside torch qualifies: a user's own
    ``RuntimeError("broken pipe")`` is raised as it is, at once.
    """
    if isinstance(error, WorkerGroupError) or not getattr(error, IN_COLLECTIVE, False):
        return False
    return _compat_torch.reads_as_a_lost_peer(error)


def blame_a_lost_peer(
    pending: list[ray.ObjectRef],
    metadata: Sequence[WorkerMetadata],
    error: BaseException,
    cause: BaseException | None,
) -> tuple[BaseException, BaseException | None]:
    """A rank saw its peer vanish before Ray reported the peer dead (a lost node shows up in the
    survivors' sockets first): waits briefly for the death, which is the error worth raising."""
    deadline = time.monotonic() + _PEER_LOSS_GRACE_S
    while pending and remaining(deadline):
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(1.0, remaining(deadline)))
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as err:
                died = translate(err, metadata, actor_of(ref))
                if isinstance(died, WorkerDiedError):
                    died.add_note(f"Another rank failed first, as it lost its peer: {error!r}")
                    for note in getattr(error, "__notes__", ()):
                        died.add_note(note)  # which rank, and its worker traceback
                    return died, chain(err)
    return error, cause


def remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def actor_of(ref: ray.ObjectRef) -> str:
    """The id of the actor whose task returns ``ref`` ("" for a plain object)."""
    return _compat_ray.actor_id_of(ref)


def translate(err: RayError, metadata: Sequence[WorkerMetadata], actor_id: str) -> BaseException:
    """Turns a Ray error from a worker into the exception the driver raises.

    ``actor_id`` is the actor whose result failed; it names the rank when Ray's error does not
    (a lost object, a system error).
    """
    if isinstance(err, RayTaskError):
        # the worker has already noted its rank and traceback on the exception
        cause = err.cause
        if isinstance(cause, BaseException) and not isinstance(cause, RayError):
            return cause
        if isinstance(cause, RayActorError):
            err = cause
        else:
            return WorkerGroupError(f"a call on a worker failed: {err}")
    died = isinstance(err, RayActorError)
    if isinstance(err, RayActorError) and err.actor_id:
        actor_id = err.actor_id
    index = next((i for i, m in enumerate(metadata) if m.actor_id == actor_id), None)
    meta = metadata[index] if index is not None else None
    unpickled = getattr(ray.exceptions, "UnserializableException", None)
    if unpickled is not None and isinstance(err, unpickled):
        # the worker's exception arrived but would not unpickle here: an error of the call, not
        # a lost worker (the workers send a stand-in for those they can tell: WorkerError)
        return WorkerError(
            f"{rank_on_node(index, meta)} raised an exception that cannot be unpickled on the "
            f"driver: {err}"
        )
    # Ray says so when the node was drained for preemption (a spot node, an autoscaler's drain)
    preempted = bool(getattr(err, "preempted", False))
    what = "died" if died else "was lost"
    if preempted:
        what = "died: its node was preempted"
    return WorkerDiedError(
        f"the worker of {rank_on_node(index, meta)} {what}: {err}",
        rank=-1 if index is None else index,
        node_id="" if meta is None else meta.node_id,
        preempted=preempted,
    )


def chain(err: RayError) -> BaseException | None:
    # a user exception is re-raised as itself; its Ray wrapper adds nothing but noise
    return None if isinstance(err, RayTaskError) else err
