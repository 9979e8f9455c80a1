"""What comes back from the workers: each worker's :class:`WorkerOutput`."""

from __future__ import annotations

from typing import Any, NamedTuple

from ray_lightning_sgd._serialization import Packed


class RankZeroResults(NamedTuple):
    """What rank 0 sends back: everything the driver's Trainer and model need."""

    state: Any  # the TrainerState of the Trainer's namespace
    #: The model's state dict, packed on its own so that the driver can copy it into its model
    #: straight from Ray's object store (:func:`unpack` with ``copy=False``).
    model_state: Packed | None
    loop_state: dict[str, Any]
    #: Each callback's ``state_dict()``: what the driver's callback loads when
    #: :attr:`attributes` could not be packed for it.
    callback_states: dict[str, dict[str, Any]]
    #: Rank 0's objects as ``ddp``'s driver would hold them (see :func:`_attributes`).
    attributes: Attributes
    callback_metrics: dict[str, Any]
    logged_metrics: dict[str, Any]
    progress_bar_metrics: dict[str, Any]
    should_stop: bool
    #: Files rank 0 wrote that the driver cannot see (see :mod:`ray_lightning_sgd._worker.artifacts`).
    files: dict[str, bytes]
    #: Each logger's version, as rank 0 chose it.
    logger_versions: list[Any]
    #: ``Trainer.ckpt_path`` (the checkpoint the call restored) and whether the user set it
    #: (see :func:`ray_lightning_sgd._compat.checkpoint_selection`).
    checkpoint: tuple[Any, bool] = (None, False)
    #: Each loop's batch counts (see ``_compat.batch_counts``); None: none sent.
    batch_counts: dict[str, Any] | None = None
    #: The model's buffers that its state dict leaves out (``persistent=False``), by name.
    buffers: dict[str, Any] | None = None


class RankPredictions(NamedTuple):
    """One rank's predictions: per dataloader, per batch, the outputs and the samples' indices."""

    outputs: list[list[Any]]
    indices: list[list[list[int] | None]]


class WorkerOutput(NamedTuple):
    """What one worker returns from :func:`run_on_worker`."""

    results: Any
    rank_zero: RankZeroResults | None
    predictions: RankPredictions | None


class Attributes(NamedTuple):
    """Rank 0's objects that the driver holds copies of, as ``ddp``'s driver (rank 0) holds them.

    Each item is packed on its own (:func:`_attributes`), so that one the driver cannot rebuild
    costs only itself; references to the Trainer, its strategy and model, the datamodule, a layer
    or parameter of the model, a callback or a logger travel by name (:func:`shared_objects`).
    """

    #: Each callback's ``state_key`` and its attributes (``__getstate__()``): all its state,
    #: ``state_dict()`` or not (a checkpoint's current score, an LR finder's result).
    callbacks: list[tuple[str, Packed]]
    #: Each logger's attributes, or None (a CSV logger's writer appends to the fit's file).
    loggers: list[Packed | None]
    #: The model's and the datamodule's public attributes (and hyperparameters), set on rank 0
    #: (an LR finder's ``lr``, a batch size finder's ``batch_size``).
    model: dict[str, Packed]
    datamodule: dict[str, Packed] | None
    #: After ``fit``: the optimizers and LR scheduler configs together, over the driver's
    #: parameters (``trainer.optimizers`` and the driver's ``save_checkpoint`` hold them).
    optimizers: Packed | None
    #: The profiler's attributes (``ddp``'s driver holds rank 0's set-up profiler: its
    #: ``dirpath``, what it recorded); None where they could not be packed.
    profiler: Packed | None
    #: What could not be pickled and stayed on the workers (the driver warns, naming each).
    left_out: list[str]
