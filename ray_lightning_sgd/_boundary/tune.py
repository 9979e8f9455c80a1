"""What rank 0's Tune report callback sends to the driver (the trial's process): the function that
hands a report to Tune there, sent with :func:`~ray_lightning_sgd._worker.events.send_to_driver`."""

from __future__ import annotations

import os
import shutil
import tempfile


def report_to_tune(metrics: dict[str, float], data: bytes | None, filename: str) -> None:
    """Runs on the driver (the trial's process). Reports to Tune, with the checkpoint if any."""
    from ray import tune

    if data is None:
        tune.report(metrics)
        return
    folder = tempfile.mkdtemp(prefix="ray_lightning_sgd-tune-")
    try:
        with open(os.path.join(folder, filename), "wb") as file:
            file.write(data)
        # Tune copies the folder into the trial's storage before report returns
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
