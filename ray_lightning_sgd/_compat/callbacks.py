"""This package's callbacks, hidden from the user's ``trainer.callbacks`` on the workers while
Lightning still calls them: through the private functions of Lightning's ``trainer/call.py`` that
call every callback (see :func:`hidden_callbacks`).

Each name here has a test in ``tests/test_compat.py`` that fails, naming it, when a release moves
it; both namespaces are tested.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ray_lightning_sgd._compat.lightning import _CALL_MODULE

#: Lightning's functions (in :data:`_CALL_MODULE`) that call each callback of
#: ``trainer.callbacks``: every hook, and each callback's part of a checkpoint when one is saved
#: and loaded. Lightning's loops and connectors call them through the module (``call.<name>``),
#: its own entry points by their global name there: either way, the module's attribute.
_CALLBACK_DISPATCH = (
    "_call_callback_hooks",
    "_call_callbacks_state_dict",
    "_call_callbacks_on_save_checkpoint",
    "_call_callbacks_on_load_checkpoint",
    "_call_callbacks_load_state_dict",
)
#: Marks a dispatch function of Lightning's that :func:`hidden_callbacks` wrapped.
_WRAPS = "_ray_lightning_sgd_wraps"
#: Lightning's callback connector and its method that, at the start of each call, replaces
#: ``trainer.callbacks`` with a new list that also holds the model's ``configure_callbacks``.
_CONNECTOR = ("{namespace}.trainer.connectors.callback_connector", "_CallbackConnector")
_ATTACH_MODEL_CALLBACKS = "_attach_model_callbacks"


@dataclasses.dataclass(frozen=True)
class _Hidden:
    """The callbacks that Lightning calls before and after those of one Trainer's list."""

    #: The list ``trainer.callbacks`` held when they were hidden: they go with it.
    listed: list[Any]
    first: tuple[Any, ...]
    last: tuple[Any, ...]


_HIDDEN: weakref.WeakKeyDictionary[Any, _Hidden] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def hidden_callbacks(
    trainer: Any, namespace: str, first: Sequence[Any] = (), last: Sequence[Any] = ()
) -> Iterator[None]:
    """Runs on each worker. Within it, Lightning calls each hook of the callbacks ``first``
    before, and of ``last`` after, the same hook of every callback in ``trainer.callbacks``,
    which holds none of them: user code that reads the Trainer's callbacks sees those of
    ``ddp``.

    Each of Lightning's functions that call callbacks (:data:`_CALLBACK_DISPATCH`) is wrapped,
    once per process: for a Trainer with hidden callbacks, it calls theirs around its own.
    Where Lightning calls only its "monitoring" callbacks (``EarlyStopping`` and
    ``Checkpoint``), none of the hidden ones is called: they must be neither. Their states go
    into a checkpoint (those that are not empty, as Lightning's), are handed back when one is
    loaded, and stay out of what the other callbacks' ``on_load_checkpoint`` see. They are not
    profiled. They go with the list ``trainer.callbacks`` holds now, as if they were in it:
    while Lightning's LR and batch size finders put a list of their own there, they are not
    called.
    """
    call = importlib.import_module(_CALL_MODULE.format(namespace=namespace))
    for name in _CALLBACK_DISPATCH:
        original = getattr(call, name)
        if getattr(original, _WRAPS, None) is None:
            setattr(call, name, _wrapped(original, _AROUND[name]))
    module, name = _CONNECTOR
    connector = getattr(importlib.import_module(module.format(namespace=namespace)), name)
    attach = getattr(connector, _ATTACH_MODEL_CALLBACKS)
    if getattr(attach, _WRAPS, None) is None:
        setattr(connector, _ATTACH_MODEL_CALLBACKS, _following_the_model_callbacks(attach))
    _HIDDEN[trainer] = _Hidden(trainer.callbacks, tuple(first), tuple(last))
    try:
        yield
    finally:
        _HIDDEN.pop(trainer, None)


def hidden_callbacks_of(trainer: Any) -> tuple[Any, ...]:
    """Runs on each worker. The callbacks :func:`hidden_callbacks` hides from ``trainer``'s list
    that Lightning calls now (none while a tuner's list of its own is there)."""
    hidden = _active(trainer)
    return () if hidden is None else hidden.first + hidden.last


def _active(trainer: Any) -> _Hidden | None:
    hidden = _HIDDEN.get(trainer)
    if hidden is None or trainer.callbacks is not hidden.listed:
        return None
    return hidden


def _following_the_model_callbacks(attach: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's ``_attach_model_callbacks``, after which the hidden callbacks go with the new
    list it leaves in ``trainer.callbacks`` (a tuner's list, later, is another list again)."""

    @functools.wraps(attach)
    def attach_and_follow(connector: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = connector.trainer
        before = trainer.callbacks
        result = attach(connector, *args, **kwargs)
        hidden = _HIDDEN.get(trainer)
        if hidden is not None and hidden.listed is before:
            _HIDDEN[trainer] = dataclasses.replace(hidden, listed=trainer.callbacks)
        return result

    setattr(attach_and_follow, _WRAPS, attach)
    return attach_and_follow


def _wrapped(original: Callable[..., Any], around: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        hidden = _active(trainer)
        if hidden is None:
            return original(trainer, *args, **kwargs)
        return around(hidden, original, trainer, *args, **kwargs)

    setattr(dispatch, _WRAPS, original)
    return dispatch


def _call_hooks(
    hidden: _Hidden,
    original: Callable[..., Any],
    trainer: Any,
    hook_name: str,
    *args: Any,
    monitoring_callbacks: bool | None = None,
    **kwargs: Any,
) -> None:
    def call(callbacks: tuple[Any, ...]) -> None:
        if monitoring_callbacks is True:  # the monitoring callbacks' turn: none of ours
            return
        for callback in callbacks:
            hook = getattr(callback, hook_name, None)
            if callable(hook):
                hook(trainer, trainer.lightning_module, *args, **kwargs)

    call(hidden.first)
    original(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)
    call(hidden.last)


def _state_dicts(hidden: _Hidden, original: Callable[..., Any], trainer: Any) -> dict[str, Any]:
    def states(callbacks: tuple[Any, ...]) -> dict[str, Any]:
        return {cb.state_key: state for cb in callbacks if (state := cb.state_dict())}

    return {**states(hidden.first), **original(trainer), **states(hidden.last)}


def _on_save_checkpoint(
    hidden: _Hidden, original: Callable[..., Any], trainer: Any, checkpoint: dict[str, Any]
) -> None:
    for callback in hidden.first:
        callback.on_save_checkpoint(trainer, trainer.lightning_module, checkpoint)
    original(trainer, checkpoint)
    for callback in hidden.last:
        callback.on_save_checkpoint(trainer, trainer.lightning_module, checkpoint)


def _on_load_checkpoint(
    hidden: _Hidden, original: Callable[..., Any], trainer: Any, checkpoint: dict[str, Any]
) -> None:
    states = checkpoint.get("callbacks")
    if states is None:  # Lightning calls no callback then
        original(trainer, checkpoint)
        return
    for callback in hidden.first:
        callback.on_load_checkpoint(trainer, trainer.lightning_module, checkpoint)
    # out of sight while Lightning's runs: it warns of states whose callback is not in its list
    keys = {cb.state_key for cb in hidden.first + hidden.last}
    ours = {key: states.pop(key) for key in list(states) if key in keys}
    try:
        original(trainer, checkpoint)
    finally:
        states.update(ours)
    for callback in hidden.last:
        callback.on_load_checkpoint(trainer, trainer.lightning_module, checkpoint)


def _load_state_dicts(
    hidden: _Hidden, original: Callable[..., Any], trainer: Any, checkpoint: dict[str, Any]
) -> None:
    states = checkpoint.get("callbacks") or {}

    def load(callbacks: tuple[Any, ...]) -> None:
        for callback in callbacks:
            if state := states.get(callback.state_key):
                callback.load_state_dict(copy.deepcopy(state))

    load(hidden.first)
    original(trainer, checkpoint)
    load(hidden.last)


#: What each of :data:`_CALLBACK_DISPATCH` does for a Trainer with hidden callbacks.
_AROUND: dict[str, Callable[..., Any]] = {
    "_call_callback_hooks": _call_hooks,
    "_call_callbacks_state_dict": _state_dicts,
    "_call_callbacks_on_save_checkpoint": _on_save_checkpoint,
    "_call_callbacks_on_load_checkpoint": _on_load_checkpoint,
    "_call_callbacks_load_state_dict": _load_state_dicts,
}


def predict_batch_indices(trainer: Any, batch_idx: int, dataloader_idx: int) -> list[int]:
    """Runs on a worker, in a predict batch's hooks. The indices of the samples in that batch, as
    Lightning gives its prediction writers: the batch sampler it wraps each predict DataLoader's
    in (the private ``_IndexBatchSamplerWrapper``) notes each batch's. [] where there is none
    (an iterable that is no DataLoader)."""
    loader = predict_dataloader(trainer, dataloader_idx)
    seen = getattr(getattr(loader, "batch_sampler", None), "seen_batch_indices", None)
    if not seen or batch_idx >= len(seen):
        return []
    return list(seen[batch_idx])


def predict_dataloader(trainer: Any, dataloader_idx: int) -> Any:
    """Runs on a worker, in a predict batch's hooks: the predict dataloader of that index, as
    Lightning iterates it."""
    return trainer.predict_loop._combined_loader.flattened[dataloader_idx]
