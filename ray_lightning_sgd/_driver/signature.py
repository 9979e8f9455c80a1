"""Driver side: what ``help``, ``inspect`` and LightningCLI read of a strategy.

A strategy joined with a Lightning strategy (in its namespace's module) gets an ``__init__`` whose
signature lists the worker arguments and the Lightning strategy's (and its module wrapper's)
arguments that it passes on, in place of ``**strategy_kwargs``; each strategy's docstring ends with
the worker arguments, as "Worker arguments".
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ray_lightning_sgd._driver.arguments import passed_on, type_hints


class _Joinable(Protocol):
    """A strategy of this package, as far as its signature is concerned."""

    @classmethod
    def lightning_strategy(cls) -> type: ...

    @classmethod
    def module_wrapper(cls) -> type | None: ...


@functools.cache
def joins_a_lightning_strategy(cls: type[_Joinable]) -> bool:
    """Whether ``cls`` is joined with the Lightning strategy it names (not a mixin)."""
    try:
        return issubclass(cls, cls.lightning_strategy())
    except (NotImplementedError, AttributeError):  # a mixin, not yet joined
        return False


def init_with_accepted_signature(
    cls: type[_Joinable], base: Callable[..., None]
) -> Callable[..., None]:
    """``base`` (``RayStrategyBase.__init__``) for ``cls``, whose signature (what ``help``,
    ``inspect`` and LightningCLI read) lists the worker arguments and the Lightning strategy's
    (and its module wrapper's) arguments that ``cls`` accepts, not ``**strategy_kwargs`` nor the
    owned ones."""
    hints = {k: v for k, v in type_hints(base).items() if k != "strategy_kwargs"}
    own = [
        p if p.name == "self" else p.replace(annotation=hints.get(p.name, Any))
        for p in inspect.signature(base).parameters.values()
        if p.kind is not p.VAR_KEYWORD
    ]
    accepted = passed_on(cls.lightning_strategy(), cls.module_wrapper())
    hints.update({p.name: p.annotation for p in accepted})

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base(self, *args, **kwargs)

    __init__.__doc__ = base.__doc__
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    __init__.__signature__ = inspect.Signature([*own, *accepted])  # type: ignore[attr-defined]
    __init__.__annotations__ = hints
    return __init__


def add_worker_arguments(base: type, strategies: Iterable[type]) -> None:
    """Ends each strategy's docstring with the worker arguments (``base``'s "Args:"), so that its
    help shows them besides its Lightning strategy's."""
    worker_args = (base.__doc__ or "").split("Args:", 1)[-1]
    for strategy in strategies:
        strategy.__doc__ = f"{strategy.__doc__}\n    Worker arguments:\n{worker_args}"
