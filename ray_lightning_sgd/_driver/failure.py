"""What the strategy does about lost and stalled workers: the failure settings of a run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd.exceptions import ConfigurationError

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class FailureConfig:
    """What the strategy does about lost and stalled workers.

    Args:
        max_failures: How often to restart the whole group after a worker died (0: never, -1: no
            limit). ``fit`` resumes from the run's latest resume checkpoint.
        progress_timeout_s: Raise ``WorkerTimeoutError`` when a rank reports no progress (a batch,
            a stage) for this long; None: never.
        checkpoint_every_n_epochs: How often the resume checkpoint is written when restarts are on.
        checkpoint_storage: Where rank 0 writes it: a local path or an fsspec URI that the
            workers can write and read; None: its bytes go to the driver's node.
    """

    max_failures: int = 0
    progress_timeout_s: float | None = None
    checkpoint_every_n_epochs: int = 1
    checkpoint_storage: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_failures) or self.max_failures < -1:
            raise ConfigurationError(
                f"max_failures must be an int >= 0, or -1 for no limit, got {self.max_failures!r}"
            )
        timeout = self.progress_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
