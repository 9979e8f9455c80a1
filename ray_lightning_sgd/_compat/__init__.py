"""Every use of a private name of Lightning, Ray or torch, in one place: one module per library.

Each name has a test in ``tests/test_compat.py`` that fails, naming the attribute, when a new
release moves it. :mod:`.flavour` collects the public members of one Lightning namespace.
"""

from __future__ import annotations

from ray_lightning_sgd._compat import ray, torch, trackers
from ray_lightning_sgd._compat.callbacks import (
    hidden_callbacks,
    hidden_callbacks_of,
    predict_batch_indices,
    predict_dataloader,
)
from ray_lightning_sgd._compat.lightning import (
    HPARAMS_ATTRIBUTE,
    METRICS_KEPT,
    ConfigureLauncher,
    InterceptPrecisionPlugin,
    batch_counts,
    checkpoint_selection,
    ckpt_path_of,
    committed_metrics,
    continue_logger,
    end_after_tuner_exit,
    has_callback,
    in_a_hook,
    launcher_interface,
    logged_step,
    mark_loop_finished,
    profiler_state,
    reduce_unbuilt_lazy_instance,
    set_batch_counts,
    set_checkpoint_selection,
    set_profiler_state,
    shift_batch_counts,
    should_check_val_epoch,
    show_as_saved_at_batch_end,
    train_combined_loader,
    train_data_fetcher,
    trainer_arguments_being_parsed,
    tuner_exit_exception,
    val_check_view,
    whole_checkpoints,
    with_ckpt_path,
)
from ray_lightning_sgd._compat.ray import bind_local_ray_to_loopback
from ray_lightning_sgd._serialization import register_reduction

register_reduction(reduce_unbuilt_lazy_instance)
register_reduction(trackers.reduce_logger)

__all__ = [
    "HPARAMS_ATTRIBUTE",
    "METRICS_KEPT",
    "ConfigureLauncher",
    "InterceptPrecisionPlugin",
    "batch_counts",
    "bind_local_ray_to_loopback",
    "checkpoint_selection",
    "ckpt_path_of",
    "committed_metrics",
    "continue_logger",
    "end_after_tuner_exit",
    "has_callback",
    "hidden_callbacks",
    "hidden_callbacks_of",
    "in_a_hook",
    "launcher_interface",
    "logged_step",
    "mark_loop_finished",
    "predict_batch_indices",
    "predict_dataloader",
    "profiler_state",
    "ray",
    "reduce_unbuilt_lazy_instance",
    "set_batch_counts",
    "set_checkpoint_selection",
    "set_profiler_state",
    "shift_batch_counts",
    "should_check_val_epoch",
    "show_as_saved_at_batch_end",
    "torch",
    "trackers",
    "train_combined_loader",
    "train_data_fetcher",
    "trainer_arguments_being_parsed",
    "tuner_exit_exception",
    "val_check_view",
    "whole_checkpoints",
    "with_ckpt_path",
]
