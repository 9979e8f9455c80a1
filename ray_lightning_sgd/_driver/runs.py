"""Driver side: named runs, which a new driver resumes after the old one died.

A run named with ``run_name`` keeps its resume checkpoints in ``<checkpoint_storage>/<run_name>``,
with a ``run.json`` that says what the run trains (the strategy and the model's class). A driver
that starts ``fit`` with the same name resumes from the run's latest resume checkpoint, or refuses
when the stored run trains something else.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ray_lightning_sgd._worker.resume import ResumePoint, stored_points
from ray_lightning_sgd.exceptions import ConfigurationError

log = logging.getLogger(__name__)

#: The file of a run's folder that says what the run trains.
RUN_FILE = "run.json"


def run_settings(strategy: Any, model: Any) -> dict[str, str]:
    """What a named run must keep training: its strategy's and its model's classes."""
    model_class = type(model)
    return {
        "strategy": type(strategy).__name__,
        "model": f"{model_class.__module__}.{model_class.__qualname__}",
    }


def resume_named_run(folder: str, name: str, settings: dict[str, str]) -> ResumePoint | None:
    """Driver side, before a named run's ``fit`` starts any worker: the run's latest resume
    checkpoint (None for a new run, whose settings are written down now).

    Raises:
        ConfigurationError: The stored run trains another model or with another strategy.
    """
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(folder)
    run_file = f"{path.rstrip('/')}/{RUN_FILE}"
    if filesystem.exists(run_file):
        with filesystem.open(run_file, "r") as file:
            stored = json.load(file)
        differ = {k: (stored.get(k), v) for k, v in settings.items() if stored.get(k) != v}
        if differ:
            shown = "; ".join(
                f"{k}: {old!r} there, {new!r} here" for k, (old, new) in differ.items()
            )
            raise ConfigurationError(
                f"run_name={name!r} names a run in {folder} that trains something else ({shown}). "
                "Pass another run_name for a new run, or remove that folder to start this one over"
            )
    else:
        filesystem.makedirs(path, exist_ok=True)
        with filesystem.open(run_file, "w") as file:
            json.dump(settings, file)
    points = stored_points(folder)
    if not points:
        return None
    point = points[-1]
    log.info(
        "Run %r resumes from its resume checkpoint of epoch %d (global step %d): %s",
        name,
        point.epoch,
        point.global_step,
        point.uri,
    )
    return point
