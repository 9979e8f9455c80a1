"""What goes to every worker: the call, as one object in Ray's object store."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import ray
import torch
import torch.backends.cudnn
from torch import Tensor

from ray_lightning_sgd import _files
from ray_lightning_sgd._boundary.artifacts import Artifacts
from ray_lightning_sgd._boundary.resume_points import ResumePoint
from ray_lightning_sgd._compat import trackers
from ray_lightning_sgd._serialization import Packed

if TYPE_CHECKING:
    import pytorch_lightning as pl

# the values of Lightning's TrainerFn, the same in both namespaces
FITTING, VALIDATING, TESTING, PREDICTING = "fit", "validate", "test", "predict"


#: Environment variables of the driver that Lightning's spawned processes inherit and read.
_INHERITED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")
#: The prefixes of the variables that experiment trackers read (credentials, endpoints, modes):
#: the driver's go to the workers where the Trainer has such a tracker's logger.
#: And those of the storages' packages (credentials, endpoints): the driver's go where the
#: Trainer or ``checkpoint_storage`` uses such a storage.
_CARRIED_PREFIXES = tuple(trackers.ENV_PREFIXES.values()) + tuple(
    sorted({prefix for prefixes in _files.STORAGE_ENV_PREFIXES.values() for prefix in prefixes})
)
#: On a worker: its own values of those variables before its first call (set by the job's or
#: the actor's runtime environment, the node, a container image).
_started_with: dict[str, str] | None = None


def _carried(key: str, prefixes: tuple[str, ...] = _CARRIED_PREFIXES) -> bool:
    if key in trackers.ENV_NOT_CARRIED:
        return False
    return key in _INHERITED_ENV or key.startswith(prefixes)


class Payload(NamedTuple):
    """What goes to every worker, as one object in Ray's object store."""

    trainer: pl.Trainer | None
    function: Callable
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    global_state: GlobalState
    #: This attempt's id: the workers' outboxes are opened under it.
    call_id: str
    #: Where a restarted ``fit`` resumes from.
    resume: ResumePoint | None = None
    #: A restarted attempt's: the runs the attempts before logged to (each of rank 0's
    #: loggers' ``version``), and by logger index the last step each metric was logged at.
    logger_versions: tuple[Any, ...] = ()
    logged_steps: Mapping[int, Mapping[str, int]] | None = None
    #: Whether rank 0 sends its callback events to the driver.
    forward_events: bool = False
    #: Whether each rank notes its progress, for the driver's progress timeout and hang report.
    report_progress: bool = False
    #: Epochs between resume checkpoints of a ``fit``; 0: none (no restarts).
    resume_every_n_epochs: int = 0
    #: Whether a ``fit`` writes a resume checkpoint at the step where a worker got SIGTERM.
    resume_on_preemption: bool = False
    #: Where rank 0 writes them: this launch's own folder of ``checkpoint_storage`` (runs that
    #: share the storage, Tune trials, never overwrite each other's), or None: to the driver.
    resume_storage: str | None = None
    #: How many resume checkpoints rank 0 keeps in ``resume_storage`` (older ones are deleted).
    resume_keep_last: int = 2
    #: Whether a fit that ends after an epoch without one writes one as it ends (a named run:
    #: its next driver resumes where this one ended, with nothing to train again).
    resume_at_fit_end: bool = False
    #: Optimizer steps, and seconds, between resume checkpoints inside epochs (0: none).
    resume_every_n_steps: int = 0
    resume_every_s: float = 0.0
    #: The fsspec options of ``resume_storage`` (secrets: never logged).
    storage_options: Mapping[str, Any] | None = None
    #: Where the driver expects rank 0's logs and checkpoints.
    artifacts: Artifacts | None = None
    #: Whether the results travel without out-of-band buffers: the driver is a Ray Client,
    #: whose server pickles them once more and cannot pickle the buffers Ray hands it.
    results_in_band: bool = False
    #: An elastic run that keeps its global batch: the most workers it may have (0: it does
    #: not); each worker multiplies ``accumulate_grad_batches`` by that over the world size.
    global_batch_workers: int = 0


class Shipped(NamedTuple):
    """The packed payload's object in Ray's object store, as each worker's call receives it.

    Ray fetches the objects a task names as its own arguments before the task begins, not those
    inside one: the worker fetches this one inside its call (:meth:`fetch`), where a SIGTERM
    is the call's preemption notice. Fetched by Ray before the call (seconds for a large
    Trainer on another node), a SIGTERM ended the worker as an idle one, and its loss counted
    against ``max_failures``."""

    ref: ray.ObjectRef

    def fetch(self) -> Packed:
        """Runs on each worker: the packed payload, from the object store."""
        packed: Packed = ray.get(self.ref)
        return packed


@dataclass(frozen=True)
class GlobalState:
    """The process-global state that Lightning's spawn launcher carries into its processes."""

    use_deterministic_algorithms: bool
    deterministic_warn_only: bool
    cudnn_benchmark: bool
    python_rng: Any
    numpy_rng: Any
    torch_rng: Tensor
    #: The seed of torch's default generator (``torch.manual_seed`` seeds every CUDA device with
    #: it too): a worker seeds its CUDA devices with it.
    torch_seed: int
    env: dict[str, str]

    @classmethod
    def capture(
        cls, worker_env: Mapping[str, str] | None = None, env_prefixes: tuple[str, ...] = ()
    ) -> GlobalState:
        """Driver side: captures the flags, RNG states and inherited environment variables,
        and those whose names start with ``env_prefixes`` (the trackers' the Trainer logs to,
        the storages' it writes);
        those that the workers' own ``worker_env`` sets keep its values there."""
        env = {k: v for k, v in os.environ.items() if _carried(k, env_prefixes)}
        env.update({k: v for k, v in (worker_env or {}).items() if _carried(k, env_prefixes)})
        return cls(
            use_deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            python_rng=random.getstate(),
            numpy_rng=np.random.get_state(),
            torch_rng=torch.get_rng_state(),
            torch_seed=torch.initial_seed(),
            env=env,
        )

    def restore(self) -> None:
        """Runs on each worker. Restores what :meth:`capture` captured."""
        torch.use_deterministic_algorithms(
            self.use_deterministic_algorithms, warn_only=self.deterministic_warn_only
        )
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        if torch.cuda.is_available():
            # as a process of Lightning's ddp, which ran seed_everything itself: the CUDA
            # generators start from the seed (the driver may have no GPU, or other ones)
            torch.cuda.manual_seed_all(self.torch_seed)
        global _started_with
        if _started_with is None:
            _started_with = {k: v for k, v in os.environ.items() if _carried(k)}
        # a warm worker's values of an earlier call go; the worker's own stay unless the
        # driver sets the variable
        for key in [k for k in os.environ if _carried(k)]:
            os.environ.pop(key, None)
        os.environ.update(_started_with)
        os.environ.update(self.env)
