"""What the strategy does about lost and stalled workers: the failure settings of a run."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd.exceptions import ConfigurationError

if TYPE_CHECKING:
    pass

_RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class FailureConfig:
    """What the strategy does about lost and stalled workers.

    Args:
        max_failures: How often to restart the whole group after a worker died (0: never, -1: no
            limit). ``fit`` resumes from the run's latest resume checkpoint.
        max_preemptions: How often to restart after Ray reported a worker's node preempted
            (drained for preemption: a spot node, an autoscaler's drain) or a training worker
            received SIGTERM (``fit`` then resumes at the step boundary where rank 0
            checkpointed); these do not count against ``max_failures``. -1 (default): no limit;
            0: never (and no checkpoint at a SIGTERM).
        progress_timeout_s: Raise ``WorkerTimeoutError`` when a rank reports no progress (a batch,
            a stage) for this long; None: never.
        checkpoint_every_n_epochs: How often the resume checkpoint is written when restarts are on.
        checkpoint_storage: Where rank 0 writes it: a local path or an fsspec URI that the
            workers can write and read; None: its bytes go to the driver's node.
        run_name: Names the run's folder of ``checkpoint_storage``: a new driver running ``fit``
            with the same name resumes from the run's latest resume checkpoint (the driver died).
            None: each launch has a folder of its own, removed when its ``fit`` ends.
        keep_last: How many resume checkpoints of a named run are kept (older ones are deleted).
        resize_interval_s: How often an elastic run checks whether the cluster has room for
            more workers.
    """

    max_failures: int = 0
    max_preemptions: int = -1
    progress_timeout_s: float | None = None
    checkpoint_every_n_epochs: int = 1
    checkpoint_storage: str | None = None
    run_name: str | None = None
    keep_last: int = 2
    resize_interval_s: float = 60.0

    @property
    def writes_resume_checkpoints(self) -> bool:
        """Whether a ``fit`` writes resume checkpoints: for restarts, or for a named run."""
        return bool(self.max_failures) or self.run_name is not None

    def __post_init__(self) -> None:
        if not _is_int(self.max_failures) or self.max_failures < -1:
            raise ConfigurationError(
                f"max_failures must be an int >= 0, or -1 for no limit, got {self.max_failures!r}"
            )
        if not _is_int(self.max_preemptions) or self.max_preemptions < -1:
            raise ConfigurationError(
                "max_preemptions must be an int >= 0, or -1 for no limit, got "
                f"{self.max_preemptions!r}"
            )
        timeout = self.progress_timeout_s
        if timeout is not None and not _is_seconds(timeout):
            raise ConfigurationError(
                f"progress_timeout_s must be a number of seconds > 0, or None, got {timeout!r}"
            )
        if not _is_int(self.checkpoint_every_n_epochs) or self.checkpoint_every_n_epochs < 1:
            raise ConfigurationError(
                "checkpoint_every_n_epochs must be an int >= 1, got "
                f"{self.checkpoint_every_n_epochs!r}"
            )
        if self.checkpoint_storage is not None and (
            not isinstance(self.checkpoint_storage, str) or not self.checkpoint_storage
        ):
            raise ConfigurationError(
                "checkpoint_storage must be a path or fsspec URI (a non-empty str), or None, got "
                f"{self.checkpoint_storage!r}"
            )
        if self.run_name is not None:
            if not isinstance(self.run_name, str) or not _RUN_NAME.fullmatch(self.run_name):
                raise ConfigurationError(
                    "run_name must be a folder name of letters, digits, '.', '_' and '-' (not "
                    f"starting with '.'), got {self.run_name!r}"
                )
            if self.checkpoint_storage is None:
                raise ConfigurationError(
                    f"run_name={self.run_name!r} needs checkpoint_storage: the place where a new "
                    "driver finds the run's resume checkpoints (a path or URI every worker reaches)"
                )
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise ConfigurationError(f"keep_last must be an int >= 1, got {self.keep_last!r}")
        if not _is_seconds(self.resize_interval_s):
            raise ConfigurationError(
                f"resize_interval_s must be a number of seconds > 0, got {self.resize_interval_s!r}"
            )


def _is_seconds(value: Any) -> bool:
    """Whether ``value`` is a finite number of seconds > 0 (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
