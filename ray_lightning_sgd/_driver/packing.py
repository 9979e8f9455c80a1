"""Driver side: the payload pickled for Ray's object store, naming what cannot be pickled."""

from __future__ import annotations

from typing import Any

from ray import cloudpickle

from ray_lightning_sgd import _compat
from ray_lightning_sgd._boundary.payload import Payload
from ray_lightning_sgd._driver.datasets import dataset_types
from ray_lightning_sgd._serialization import Packed, pack
from ray_lightning_sgd.exceptions import SerializationError


def pack_payload(payload: Payload) -> Packed:
    """Driver side: pickles the payload for the object store, naming what cannot be pickled.

    Tensors travel as out-of-band buffers (see :mod:`ray_lightning_sgd._serialization`): a
    dataset in memory is written into the object store once, however many workers read it.
    Ray Data's datasets are set aside (``Packed.set_aside``): each attempt splits them.
    """
    try:
        return pack(payload, set_aside=dataset_types())
    except Exception as err:  # Ray raises TypeError, pickle.PicklingError and others
        culprit = _find_unpicklable(payload, "payload")
        if culprit is None:
            raise
        raise SerializationError(
            f"cannot send the Trainer to the workers: {culprit} cannot be pickled. "
            "Create it inside the LightningModule or DataModule hooks (setup, "
            "configure_model) instead, or keep it out of the objects that are sent"
        ) from err


def release_logger_runs(loggers: list[Any]) -> None:
    """Driver side, before a call: a tracker's run that a driver logger holds open (a W&B run
    the user touched through ``logger.experiment``) is ended here; rank 0 continues it by its id
    (see :mod:`ray_lightning_sgd._compat.trackers`)."""
    for logger in loggers:
        _compat.trackers.release(logger)


def _find_unpicklable(
    obj: Any, path: str, depth: int = 0, ancestors: set[int] | None = None
) -> str | None:
    """Returns the attribute path of the innermost object that cannot be pickled, if any.

    An object that fails only because it refers back to an object being searched (a connector that
    holds its Trainer) is not the culprit: the search goes on in its ancestor's other attributes.
    """
    ancestors = set() if ancestors is None else ancestors
    if depth > 40:
        return None
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception:  # noqa: BLE001 - any failure means "look inside"
        pass
    ancestors.add(id(obj))
    refers_back = False
    try:
        for child_path, child in _children(obj, path):
            if id(child) in ancestors:
                refers_back = True
                continue
            found = _find_unpicklable(child, child_path, depth + 1, ancestors)
            if found is not None:
                return found
    finally:
        ancestors.discard(id(obj))
    return None if refers_back else f"{path} (a {type(obj).__module__}.{type(obj).__qualname__})"


def _children(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"{path}[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
    if hasattr(obj, "_fields"):  # a NamedTuple is a tuple; handled above
        return []
    try:
        state = obj.__getstate__()
    except Exception:  # noqa: BLE001 - objects that refuse to give their state have no children
        return []
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots) form
    if isinstance(state, dict):
        return [(f"{path}.{key}", value) for key, value in state.items()]
    return []
