"""Every use of a private attribute of Lightning's experiment-tracker loggers, in one place.

A tracker logger (MLflow, W&B, Comet) names its run in a private attribute and holds, once the
run exists, a handle that belongs to the process that made it (W&B's run talks to a service
process of its own). Under Lightning's ``ddp`` the run lives in the driver, which is rank 0; here
rank 0 is a worker, so the run's name travels between the driver and rank 0 without the handle:
rank 0 continues the run the name gives, the driver adopts the name rank 0 logged to.

Loggers are recognised by class name, so that both Lightning namespaces match. Each name here has
a test in ``tests/test_compat.py``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

#: Environment variables each tracker reads, by the prefix of their names: the driver's values
#: go to the workers with the call (credentials, endpoints, modes) where the Trainer logs there.
ENV_PREFIXES = {
    "MLFlowLogger": "MLFLOW_",
    "WandbLogger": "WANDB_",
    "CometLogger": "COMET_",
    "NeptuneLogger": "NEPTUNE_",
}
#: Variables with those prefixes that name something of the driver's process only: W&B's
#: service, which a worker on another node cannot reach.
ENV_NOT_CARRIED = ("WANDB_SERVICE",)


def _kind(logger: Any) -> str | None:
    """The name of the Lightning logger class ``logger`` is (or derives from), or None."""
    for cls in type(logger).__mro__:
        if cls.__name__ in _KINDS and cls.__module__.split(".")[0] in _NAMESPACES:
            return cls.__name__
    return None


_KINDS = ("CSVLogger", "TensorBoardLogger", "MLFlowLogger", "WandbLogger", "CometLogger")
_NAMESPACES = ("pytorch_lightning", "lightning")


def env_prefixes(loggers: list[Any]) -> tuple[str, ...]:
    """The prefixes of the environment variables that these loggers' trackers read."""
    return tuple(
        sorted(
            ENV_PREFIXES[cls.__name__]
            for logger in loggers
            for cls in type(logger).__mro__
            if cls.__name__ in ENV_PREFIXES
        )
    )


def tracked(loggers: list[Any]) -> bool:
    """Whether any of ``loggers`` writes to a tracker's run (anything but a CSV or TensorBoard
    folder: Lightning's trackers and custom loggers)."""
    return any(not replaces_later_steps(logger) for logger in loggers)


def set_version(logger: Any, version: Any) -> None:
    """Names the run ``logger`` logs to (its ``version``: a folder's version, an MLflow run id,
    a W&B run id, a Comet experiment key). The next use of its experiment continues that run."""
    if version is None:
        return
    kind = _kind(logger)
    if kind == "MLFlowLogger":
        if logger._run_id != version:
            # fetched again on the next use: the run's experiment comes with it
            logger._run_id, logger._initialized = version, False
    elif kind == "WandbLogger":
        logger._id = version
        logger._wandb_init["id"] = version
    elif kind == "CometLogger":
        if logger._experiment_key != version:
            logger._experiment_key = version
            logger._experiment = None
    elif hasattr(logger, "_version"):  # CSV, TensorBoard and the loggers built on them
        logger._version = version


def known_version(logger: Any) -> Any:
    """The run ``logger`` writes to, where it made or was given one, without making one (its
    ``version`` may make the run); None where it has none yet."""
    kind = _kind(logger)
    if kind == "MLFlowLogger":
        return logger._run_id
    if kind == "WandbLogger":
        return logger._experiment.id if logger._experiment is not None else logger._id
    if kind == "CometLogger":
        return logger._experiment_key
    if kind in ("CSVLogger", "TensorBoardLogger"):
        return logger._version
    return logger.version  # a user's logger: its version is its run's name


def attach(logger: Any) -> None:
    """Driver side, after a call that failed: an MLflow logger named a run it has not fetched
    yet (:func:`set_version`); fetched now, Lightning's ``finalize("failed")`` marks it failed
    (a logger that never fetched its run finalizes nothing)."""
    if _kind(logger) == "MLFlowLogger" and logger._run_id is not None and not logger._initialized:
        try:
            _ = logger.experiment
        except Exception as err:  # noqa: BLE001  (the call's own error is the one to raise)
            log.warning(
                "Could not reach the MLflow run %s to mark it failed: %s", logger._run_id, err
            )


def release(logger: Any) -> None:
    """Driver side, before a call: a W&B run that the driver's logger holds (the user touched
    ``logger.experiment``) is finished here, and rank 0 resumes it by its id. Lightning's own
    pickling of a W&B logger would instead have rank 0 attach to the driver's W&B service,
    which a Ray actor cannot reach."""
    if _kind(logger) != "WandbLogger":
        return
    # the run Lightning's logger would log to here: its own, or one the user started
    # (``wandb.init`` before the logger: Lightning reuses ``wandb.run``)
    wandb = sys.modules.get("wandb")
    run = logger._experiment or getattr(wandb, "run", None)
    if run is not None:
        set_version(logger, run.id)
        logger._name = run.name
        run.finish()
        logger._experiment = None


def end_run(logger: Any, failed: bool) -> None:
    """Runs on rank 0 at the end of a call: ends what the process that ran it would end when it
    exits under ``ddp`` (a W&B run, with its exit code; a Comet experiment's uploads), so that
    the driver and later calls continue the run from the tracker, not from this process."""
    kind = _kind(logger)
    if kind == "WandbLogger" and logger._experiment is not None:
        run = logger._experiment
        set_version(logger, run.id)
        logger._name = run.name
        run.finish(exit_code=1 if failed else 0)
        logger._experiment = None
    elif kind == "CometLogger" and logger._experiment is not None:
        experiment = logger._experiment
        logger._experiment_key = experiment.get_key()
        experiment.end()
        logger._experiment = None


def portable_state(logger: Any) -> Any:
    """A logger's state without what ties it to this process, naming its run. A W&B logger's
    own ``__getstate__`` makes a run in this process for another process to attach to; a Comet
    logger's forgets its experiment's key once the experiment ended."""
    kind = _kind(logger)
    if kind == "TensorBoardLogger":
        # a restarted fit's purge (see purge_later_steps) is for its own writer only: a later
        # call's writer in that folder would hide the fit's steps from it on
        state = logger.__getstate__()
        kwargs = {k: v for k, v in state.get("_kwargs", {}).items() if k != "purge_step"}
        return {**state, "_kwargs": kwargs}
    if kind not in ("WandbLogger", "CometLogger"):
        return logger.__getstate__()
    state = dict(vars(logger))
    state.pop("_attach_id", None)
    experiment, state["_experiment"] = state.get("_experiment"), None
    if experiment is not None and kind == "WandbLogger":
        state["_id"] = experiment.id
    elif experiment is not None:
        state["_experiment_key"] = experiment.get_key()
    return state


def reduce_logger(obj: Any) -> Any:
    """A reduction (see :func:`ray_lightning_sgd._serialization.register_reduction`): a W&B
    or Comet logger travels as :func:`portable_state`, never as its own ``__getstate__`` gives
    it."""
    if _kind(obj) not in ("WandbLogger", "CometLogger"):
        return None
    return _rebuild, (type(obj), portable_state(obj))


def _rebuild(cls: Any, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    vars(obj).update(state)
    return obj


def keep_own_handle(logger: Any, state: Any) -> Any:
    """Driver side: rank 0's state of ``logger``, keeping the driver's own open experiment where
    rank 0 logged to that same run (a Comet experiment the driver's logger made when built)."""
    if not isinstance(state, dict) or state.get("_experiment", True) is not None:
        return state
    if _kind(logger) == "CometLogger" and logger._experiment is not None:
        if logger._experiment.get_key() == state.get("_experiment_key"):
            return {**state, "_experiment": logger._experiment}
    return state


def purge_later_steps(logger: Any, step: int) -> None:
    """Runs on rank 0 of a restarted attempt: a TensorBoard logger's writer drops, from the
    folder's earlier event files, what they hold from ``step`` on (trained again now)."""
    if _kind(logger) == "TensorBoardLogger" and logger._experiment is None:
        logger._kwargs["purge_step"] = step


def replaces_later_steps(logger: Any) -> bool:
    """Whether a restarted attempt's logger replaces what the attempt before logged after its
    resume point (a CSV file keeps the rows before it, TensorBoard purges the later ones), or
    can only add to it (a tracker's run)."""
    return _kind(logger) in ("CSVLogger", "TensorBoardLogger")


__all__ = [
    "ENV_NOT_CARRIED",
    "ENV_PREFIXES",
    "attach",
    "end_run",
    "env_prefixes",
    "keep_own_handle",
    "known_version",
    "portable_state",
    "purge_later_steps",
    "reduce_logger",
    "release",
    "replaces_later_steps",
    "set_version",
    "tracked",
]
