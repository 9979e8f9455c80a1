"""Driver side: a run's settings beyond its workers: restarts and their budgets, the progress
timeout, resume checkpoints and their storage, the run's name, the elastic resize interval."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray_lightning_sgd import _files
from ray_lightning_sgd._worker_group.config import seconds_problem
from ray_lightning_sgd.exceptions import ConfigurationError

_RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class RunConfig:
    """A run's settings beyond its workers: what the strategy does about lost, preempted and
    stalled workers, where the resume checkpoints go, the run's name, and how often an elastic
    run looks for room to grow.

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
        hang_report_after_s: When no rank has reported progress for this long, the driver logs
            every rank's stack once (again after progress resumes and stops anew). None
            (default): 20 times the longest wait between two progress reports of a rank so far
            in the call, and at least 5 minutes: no step of a run that moves takes that long.
        checkpoint_every_n_epochs: How often the resume checkpoint is written when restarts are on.
        checkpoint_storage: Where rank 0 writes it: a local path (``~`` is expanded at launch; a
            ``pathlib.Path`` is kept as its str) or an fsspec URI that the workers can write and
            read; None: its bytes go to the driver's node.
        run_name: Names the run's folder of ``checkpoint_storage``: a new driver running ``fit``
            with the same name resumes from the run's latest resume checkpoint (the driver died).
            None: each launch has a folder of its own, removed when its ``fit`` ends.
        keep_last: How many resume checkpoints of a named run are kept (older ones are deleted).
        storage_options: fsspec options of ``checkpoint_storage`` (an endpoint, credentials, a
            profile), used by the driver and every worker; never shown (``repr``, logs).
        checkpoint_every_n_steps: Optimizer steps between resume checkpoints inside epochs too
            (besides every ``checkpoint_every_n_epochs`` epochs); None: none.
        checkpoint_every_s: Seconds (rank 0's clock) between resume checkpoints inside epochs
            too; None: none.
        resize_interval_s: How often an elastic run checks whether the cluster has room for
            more workers.
    """

    max_failures: int = 0
    max_preemptions: int = -1
    progress_timeout_s: float | None = None
    hang_report_after_s: float | None = None
    checkpoint_every_n_epochs: int = 1
    checkpoint_storage: str | None = None
    run_name: str | None = None
    keep_last: int = 2
    resize_interval_s: float = 60.0
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    checkpoint_every_n_steps: int | None = None
    checkpoint_every_s: float | None = None

    @property
    def writes_resume_checkpoints(self) -> bool:
        """Whether a ``fit`` writes resume checkpoints: for restarts, or for a named run."""
        return bool(self.max_failures) or self.run_name is not None

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_storage, os.PathLike):
            object.__setattr__(self, "checkpoint_storage", os.fspath(self.checkpoint_storage))
        if not _is_int(self.max_failures) or self.max_failures < -1:
            raise ConfigurationError(
                f"max_failures must be an int >= 0, or -1 for no limit, got {self.max_failures!r}"
            )
        if not _is_int(self.max_preemptions) or self.max_preemptions < -1:
            raise ConfigurationError(
                "max_preemptions must be an int >= 0, or -1 for no limit, got "
                f"{self.max_preemptions!r}"
            )
        _check_optional_seconds("progress_timeout_s", self.progress_timeout_s, "no timeout")
        _check_optional_seconds(
            "hang_report_after_s", self.hang_report_after_s, "the automatic window"
        )
        if not _is_int(self.checkpoint_every_n_epochs) or self.checkpoint_every_n_epochs < 1:
            raise ConfigurationError(
                "checkpoint_every_n_epochs must be an int >= 1, got "
                f"{self.checkpoint_every_n_epochs!r}"
            )
        if self.checkpoint_storage is not None:
            _check_storage(self.checkpoint_storage)
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
        self._check_storage_options()
        steps = self.checkpoint_every_n_steps
        if steps is not None and (not _is_int(steps) or steps < 1):
            raise ConfigurationError(
                f"checkpoint_every_n_steps must be an int >= 1, or None, got {steps!r}"
            )
        _check_optional_seconds(
            "checkpoint_every_s", self.checkpoint_every_s, "no timed checkpoints"
        )
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise ConfigurationError(f"keep_last must be an int >= 1, got {self.keep_last!r}")
        interval_problem = seconds_problem(self.resize_interval_s)
        if interval_problem is not None:
            raise ConfigurationError(f"resize_interval_s {interval_problem}")

    def _check_storage_options(self) -> None:
        options = self.storage_options
        if options is None:
            return
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            raise ConfigurationError(
                "storage_options must be a dict of fsspec options with str keys (for example "
                "{'client_kwargs': {'endpoint_url': ...}, 'profile': ...}), or None, got a "
                f"{type(options).__name__}"  # its values may be secrets: never shown
            )
        if self.checkpoint_storage is None:
            raise ConfigurationError(
                f"storage_options (keys {sorted(options)}) are options of checkpoint_storage, "
                "which is not given: give checkpoint_storage='s3://bucket/folder' (or another "
                "fsspec URI) too, or leave storage_options out"
            )
        object.__setattr__(self, "storage_options", _files.StorageOptions(options))


def _check_optional_seconds(name: str, value: Any, none_means: str) -> None:
    """Raises unless ``value`` is None or a number of seconds (see ``seconds_problem``)."""
    problem = None if value is None else seconds_problem(value)
    if problem is not None:
        raise ConfigurationError(f"{name} {problem}; or None for {none_means}")


def _check_storage(storage: Any) -> None:
    """Raises unless ``storage`` is a non-empty path or a URI whose protocols fsspec knows."""
    if not isinstance(storage, str) or not storage.strip() or "\0" in storage:
        raise ConfigurationError(
            "checkpoint_storage must be a path or fsspec URI (a non-empty str or a "
            f"pathlib.Path), or None, got {storage!r}"
        )
    if "://" not in storage:
        scheme = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]+):(/*)", storage)
        if scheme is None or os.path.exists(scheme.group(1) + ":"):
            return  # a local path (a local folder named "name:" included)
        import fsspec

        name, slashes = scheme.groups()
        if name not in fsspec.available_protocols():
            return  # a local folder such as "exp1:v2"
        rest = storage[scheme.end() :]
        meant = f"{name}:///{rest}" if name == "file" and slashes else f"{name}://{rest}"
        raise ConfigurationError(
            f"checkpoint_storage={storage!r} reads as a URI without '://' (it would be a local "
            f"folder named {name + ':'!r}); write {meant!r}"
        )
    import fsspec  # only where a URI is given

    known = set(fsspec.available_protocols())
    for part in storage.split("::"):  # fsspec's chained URLs: simplecache::s3://...
        protocol = fsspec.core.split_protocol(part)[0]
        if protocol is not None and protocol not in known:
            raise ConfigurationError(
                f"checkpoint_storage={storage!r} names the protocol {protocol!r}, which fsspec "
                "does not know; give a local path, or a URI such as s3://bucket/folder (with "
                "its fsspec package, s3fs here, installed on the driver and the workers)"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
