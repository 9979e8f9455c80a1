"""Every use of a private attribute of Lightning, in one place.

Each name here has a test in ``tests/test_compat.py`` that fails, naming the attribute, when a new
release moves it; both namespaces are tested.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ray_lightning_sgd import _files
from ray_lightning_sgd._compat import trackers

if TYPE_CHECKING:
    # for type checkers, the standalone namespace's interface; launcher_interface gives either
    from pytorch_lightning.strategies.launchers.launcher import _Launcher as LauncherInterface

#: Where each Lightning namespace keeps its (private) launcher interface.
_LAUNCHER_MODULE = "{namespace}.strategies.launchers.launcher"


_LAUNCHER_CLASS = "_Launcher"


def launcher_interface(namespace: str) -> type[LauncherInterface]:
    """Lightning's launcher interface (``_Launcher``) in ``namespace``: the base of a launcher."""
    module = importlib.import_module(_LAUNCHER_MODULE.format(namespace=namespace))
    cls: type[LauncherInterface] = getattr(module, _LAUNCHER_CLASS)
    return cls


class ConfigureLauncher:
    """A strategy mixin: Lightning asks a strategy for its launcher through a private hook.

    ``Strategy._configure_launcher`` runs when the strategy is set up (and again when its
    accelerator changes); it must set ``self._launcher``, which the public ``launcher`` property
    returns. The strategy gives the launcher through :meth:`make_launcher`.
    """

    _launcher: Any

    def make_launcher(self) -> Any:
        raise NotImplementedError

    def _configure_launcher(self) -> None:
        self._launcher = self.make_launcher()


def continue_logger(logger: Any, version: Any, before_step: int) -> None:
    """Runs on rank 0 of a restarted attempt. The logger writes on in the folder or run
    (``version``) of the attempt before; TensorBoard's drops what the folder holds from
    ``before_step`` on (the checkpoint's logging step: later steps are trained again); a CSV
    logger keeps the rows logged before it, which Lightning's CSV writer would delete when it
    starts in a folder that has them."""
    trackers.set_version(logger, version)
    trackers.purge_later_steps(logger, before_step)
    if version is None or not any(cls.__name__ == "CSVLogger" for cls in type(logger).__mro__):
        return
    import csv
    import io

    import fsspec

    uri = f"{str(logger.log_dir).rstrip('/')}/metrics.csv"
    filesystem, path = fsspec.core.url_to_fs(uri)
    # the rows wait under another name while Lightning's writer starts (it deletes the file it
    # finds) and until the kept ones are in place: a kill at any moment leaves them in one of
    # the two files, and the next attempt takes them from there
    aside = f"{path.rpartition('/')[0]}/{METRICS_KEPT}"
    # what a rank 0 killed while it wrote the file left (it alone writes the folder)
    _files.remove_leftovers(path.rpartition("/")[0] or ".", starting=".metrics.csv")
    if filesystem.isfile(path):
        filesystem.mv(path, aside)
    elif not filesystem.isfile(aside):
        return
    with filesystem.open(aside, "r", newline="") as file:
        reader = csv.DictReader(file)
        rows = list(reader)
        header = list(reader.fieldnames or [])
    kept = [row for row in rows if _step_of(row) < before_step]
    writer = logger.experiment  # Lightning's writer, which deletes the file it finds
    out = io.StringIO()
    rows_writer = csv.DictWriter(out, fieldnames=header)
    rows_writer.writeheader()
    rows_writer.writerows(kept)
    _files.write_atomically(uri, out.getvalue())
    filesystem.rm(aside)
    # the columns the file has: a later row with other keys rewrites it with all of them
    writer.metrics_keys = list(header)


#: Where a CSV logger's rows wait while a restarted attempt continues its folder.
METRICS_KEPT = ".metrics.csv.kept"


def has_callback(trainer: Any, class_name: str) -> bool:
    """Whether the Trainer has a callback of that Lightning class (by name: either namespace)."""
    return any(
        class_name in (cls.__name__ for cls in type(callback).__mro__)
        for callback in trainer.callbacks
    )


#: The training epoch loop's count of batches that stepped (the step its loggers record rows at),
#: an attribute of the loop and a key of its saved state alike.
_BATCHES_THAT_STEPPED = "_batches_that_stepped"


def logged_step(trainer: Any) -> int:
    """Runs on a worker. The step Lightning's loggers record rows at now (optimizer steps that
    were taken, counted once per batch: ``global_step`` counts each optimizer's step)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return int(getattr(epoch_loop, _BATCHES_THAT_STEPPED, trainer.global_step))


#: Where a checkpoint keeps the fit loop's state (under ``checkpoint["loops"]``), and in it the
#: training epoch loop's batch counts and its own saved state (which holds
#: :data:`_BATCHES_THAT_STEPPED`).
_FIT_LOOP_STATE = "fit_loop"
_BATCH_PROGRESS_STATE = "epoch_loop.batch_progress"
_EPOCH_LOOP_STATE = "epoch_loop.state_dict"
#: The batch counts Lightning keeps twice (``total`` and ``current``) in the epoch loop's
#: ``batch_progress``; a checkpoint keeps them as dicts, the live loop as attributes.
_BATCH_COUNTS = ("ready", "started", "processed", "completed")
_BATCH_COUNT_SCOPES = ("total", "current")


def show_as_saved_at_batch_end(checkpoint: dict[str, Any]) -> None:
    """Runs on rank 0. Makes the loop state of a checkpoint saved at a batch's start read as a
    save at the previous batch's end, the one Lightning's restart knows: the batch about to start
    not counted as fetched (``ready``), the last one not as ``completed``, the epoch not at its
    last batch, and one logging step (:data:`_BATCHES_THAT_STEPPED`) fewer."""
    loop = checkpoint["loops"][_FIT_LOOP_STATE]
    progress = loop[_BATCH_PROGRESS_STATE]
    for scope in _BATCH_COUNT_SCOPES:
        progress[scope]["ready"] -= 1
        progress[scope]["completed"] -= 1
    progress["is_last_batch"] = False
    loop[_EPOCH_LOOP_STATE][_BATCHES_THAT_STEPPED] -= 1


def shift_batch_counts(trainer: Any, delta: int) -> None:
    """Runs on each worker. Moves every batch count of the fit's epoch loop (its
    ``batch_progress``, restored and not yet reset by the loop) by ``delta``."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for scope in _BATCH_COUNT_SCOPES:
        counts = getattr(progress, scope)
        for name in _BATCH_COUNTS:
            setattr(counts, name, getattr(counts, name) + delta)


#: Where the fit loop keeps the train iterables it combined (set when it sets up the data).
_COMBINED_LOADER = "_combined_loader"


def train_combined_loader(trainer: Any) -> Any | None:
    """Runs on each worker. The fit's train iterables as Lightning iterates them (a
    ``CombinedLoader``, whose ``flattened`` lists them), or None before the fit loop set them up."""
    return getattr(trainer.fit_loop, _COMBINED_LOADER, None)


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Runs on each worker. Gives a ModelParallelStrategy and its LightningModule ``mesh``, as
    its ``setup_environment`` gave them the one it made."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


#: Where Lightning's fit loop keeps the fetcher of its train batches.
_DATA_FETCHER = "_data_fetcher"


def train_data_fetcher(trainer: Any) -> Any | None:
    """Runs on each worker. The fetcher the fit loop takes its train batches from (``iter()`` on
    it begins the train iterables again), or None before the fit loop set it up."""
    return getattr(trainer.fit_loop, _DATA_FETCHER, None)


#: Where a LightningModule or LightningDataModule keeps its hyperparameters (the ``hparams``
#: property reads it): the one private attribute of theirs that travels as user state.
HPARAMS_ATTRIBUTE = "_hparams"


def _step_of(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0


def committed_metrics(trainer: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Runs on a worker. The progress bar, callback and logged metrics Lightning last committed.

    Never starts a collective. The Trainer's ``progress_bar_metrics``, ``callback_metrics`` and
    ``logged_metrics`` properties compute epoch-level metrics on demand, and computing one logged
    with ``sync_dist=True`` (or a torchmetrics object) syncs it across ranks: a collective. Read on
    one rank alone, that collective pairs with whatever the other ranks run next (a hang, or two
    different collectives exchanging the wrong data). The dicts behind those properties hold what
    Lightning's logger connector committed on every rank at the same points (after each batch, at
    each epoch end, after each evaluation); reading them is a plain dict read.
    """
    connector = trainer._logger_connector
    return (
        connector._progress_bar_metrics,
        connector._callback_metrics,
        connector._logged_metrics,
    )


def in_a_hook(trainer: Any) -> bool:
    """Whether one of Lightning's hooks runs now (a callback's or the module's): Lightning names
    it on the module while it runs (``_current_fx_name``) and clears it after. True where that
    cannot be read."""
    module = getattr(trainer, "lightning_module", None)
    return getattr(module, "_current_fx_name", "unknown") is not None


def should_check_val_epoch(trainer: Any) -> bool:
    """Runs on a worker. Whether this training epoch ends with a validation (the TQDM bar's total
    asks it through the same private method); reads loop counters only, no collective."""
    return bool(trainer.fit_loop.epoch_loop._should_check_val_epoch())


def with_ckpt_path(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], path: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Runs on each worker. The arguments of the Trainer's entry point (``Trainer._fit_impl``,
    which Lightning hands the launcher) with ``ckpt_path`` set to ``path``: a restarted fit
    resumes from there."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.arguments["ckpt_path"] = path
    return bound.args, bound.kwargs


def ckpt_path_of(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Driver side: the ``ckpt_path`` that the Trainer's entry point was called with (None)."""
    bound = inspect.signature(function).bind_partial(*args, **kwargs)
    return bound.arguments.get("ckpt_path")


def checkpoint_selection(trainer: Any) -> tuple[Any, bool]:
    """Runs on rank 0. The checkpoint the call restored (``Trainer.ckpt_path``) and whether the
    user chose it by setting ``trainer.ckpt_path`` (the connector's private ``_user_managed``:
    such a path is restored by the next call too)."""
    return trainer.ckpt_path, bool(trainer._checkpoint_connector._user_managed)


def set_checkpoint_selection(trainer: Any, selection: tuple[Any, bool]) -> None:
    """Driver side: gives the driver's Trainer what :func:`checkpoint_selection` read on rank 0
    (the public setter alone would count every restored path as the user's choice)."""
    path, user_managed = selection
    trainer.ckpt_path = path
    trainer._checkpoint_connector._user_managed = user_managed


#: What the Trainer's set-up gives its profiler: a weak proxy of the model (it cannot be pickled;
#: the driver's profiler keeps its own).
_PROFILER_MODEL = "_lightning_module"


def profiler_state(profiler: Any) -> dict[str, Any]:
    """Runs on rank 0. The profiler's attributes after a call (its ``dirpath``, stage, what it
    recorded), without its weak reference to the model."""
    return {key: value for key, value in vars(profiler).items() if key != _PROFILER_MODEL}


def set_profiler_state(profiler: Any, state: dict[str, Any]) -> None:
    """Driver side: makes the driver's profiler hold what :func:`profiler_state` read on rank 0,
    as ``ddp``'s driver (rank 0) holds it. Its attributes are replaced, not merged: a lazy
    instance (jsonargparse's ``lazy_instance``) that was never set up here becomes the set-up one."""
    own = vars(profiler)
    kept = {key: own[key] for key in (_PROFILER_MODEL,) if key in own}
    own.clear()
    own.update(state)
    own.update(kept)


#: The Trainer's loops whose batch counts (``num_training_batches``, ``num_val_batches``, ...)
#: rank 0 sends back, and the attribute each keeps them in (an evaluation loop's ``max_batches``
#: is a property over its private ``_max_batches``).
_LOOP_BATCHES = (
    ("fit_loop", "max_batches"),
    ("fit_loop.epoch_loop.val_loop", "_max_batches"),
    ("validate_loop", "_max_batches"),
    ("test_loop", "_max_batches"),
    ("predict_loop", "max_batches"),
)


def _loop(trainer: Any, path: str) -> Any:
    for name in path.split("."):
        trainer = getattr(trainer, name)
    return trainer


def batch_counts(trainer: Any) -> dict[str, Any]:
    """Runs on rank 0. Each loop's number of batches per dataloader after a call, which the
    Trainer's ``num_*_batches`` read."""
    return {path: getattr(_loop(trainer, path), name) for path, name in _LOOP_BATCHES}


def set_batch_counts(trainer: Any, counts: dict[str, Any]) -> None:
    """Driver side: the driver's loops count rank 0's batches, as ``ddp``'s driver (rank 0)."""
    for path, name in _LOOP_BATCHES:
        if path in counts:
            setattr(_loop(trainer, path), name, counts[path])


def mark_loop_finished(loop: Any) -> None:
    """Driver side: a loop whose state came from rank 0 finished there, and so did each loop it
    holds: none is resuming, as none is on rank 0 after the call. Lightning's own end of an
    iteration (``on_iteration_done`` of its private loop base class) clears the flags that
    ``load_state_dict`` set; the ``restarting`` setter would not (a fit loop with ``max_steps``
    keeps it True, and the next ``fit`` would start as a restart inside an epoch)."""
    loop.on_iteration_done()
    for child in vars(loop).values():
        if callable(getattr(child, "on_iteration_done", None)) and hasattr(child, "restarting"):
            mark_loop_finished(child)


def val_check_view(should_check: bool) -> Any:
    """Driver side: what the TQDM bar reads on the driver's view of the Trainer: whether this
    epoch ends with a validation, as ``fit_loop.epoch_loop._should_check_val_epoch()``."""
    epoch_loop = SimpleNamespace(_should_check_val_epoch=lambda: should_check)
    return SimpleNamespace(epoch_loop=epoch_loop)


#: Where each namespace keeps the exception its tuners end a ``fit`` with.
_TUNER_EXIT = ("{namespace}.utilities.exceptions", "_TunerExitException")
#: Where Lightning's entry points handle it, and the teardown they call then.
_CALL_MODULE = "{namespace}.trainer.call"
_TEARDOWN_HOOK = "_call_teardown_hook"


def tuner_exit_exception(namespace: str) -> type[BaseException]:
    """The exception that Lightning's LR and batch size finders raise to end their ``fit``
    (``_TunerExitException``); Lightning's ``_call_and_handle_interrupt`` ends the call on it."""
    module = importlib.import_module(_TUNER_EXIT[0].format(namespace=namespace))
    cls: type[BaseException] = getattr(module, _TUNER_EXIT[1])
    return cls


def end_after_tuner_exit(trainer: Any, namespace: str) -> None:
    """Runs on each worker. What Lightning's ``_call_and_handle_interrupt`` does when a tuner ends
    the call: the teardown hooks, the Trainer's own teardown, and a finished state. (On a worker
    the launcher calls the Trainer's ``_fit_impl`` directly, outside that handler.)"""
    call = importlib.import_module(_CALL_MODULE.format(namespace=namespace))
    getattr(call, _TEARDOWN_HOOK)(trainer)
    trainer._teardown()
    trainer.state.status = type(trainer.state.status).FINISHED
    trainer.state.stage = None


#: Where Lightning's Strategy keeps its precision plugin (its ``precision_plugin`` property reads
#: it); Lightning's accelerator connector reads it too, while it parses the Trainer's arguments.
PRECISION_PLUGIN_ATTRIBUTE = "_precision_plugin"
#: Where :class:`InterceptPrecisionPlugin` keeps the plugin written to that attribute.
_OWN_PRECISION_PLUGIN = "_own_precision_plugin"


class InterceptPrecisionPlugin:
    """A strategy mixin: makes the strategy's private precision plugin attribute
    (:data:`PRECISION_PLUGIN_ATTRIBUTE`) a property. A write keeps the plugin; a read returns
    what :meth:`read_precision_plugin` makes of it, told whether the reader is Lightning's
    accelerator connector parsing a Trainer's arguments."""

    def read_precision_plugin(self, own: Any, parsed: tuple[Any, Any, Any] | None) -> Any:
        """What a read of the precision plugin returns (by default ``own``, the plugin last
        written). ``parsed``: what :func:`trainer_arguments_being_parsed` returned for this
        read (None unless the accelerator connector is the reader)."""
        return own


def _read_precision_plugin(strategy: Any) -> Any:
    # calls trainer_arguments_being_parsed itself: it looks for the connector two frames up
    own = strategy.__dict__.get(_OWN_PRECISION_PLUGIN)
    return strategy.read_precision_plugin(own, trainer_arguments_being_parsed())


def _write_precision_plugin(strategy: Any, plugin: Any) -> None:
    strategy.__dict__[_OWN_PRECISION_PLUGIN] = plugin


# a property with a setter on the class wins over the instance attribute Strategy.__init__ sets
setattr(
    InterceptPrecisionPlugin,
    PRECISION_PLUGIN_ATTRIBUTE,
    property(_read_precision_plugin, _write_precision_plugin),
)


#: The method of Lightning's accelerator connector that parses the Trainer's arguments. It reads
#: the strategy's ``_precision_plugin`` right after it has stored the user's precision, precision
#: plugin and accelerator, before it adapts them to the driver's machine.
_PARSE_METHOD = "_check_config_and_set_final_flags"


def trainer_arguments_being_parsed() -> tuple[Any, Any, Any] | None:
    """Driver side: called by a strategy's ``_precision_plugin`` getter (as
    :class:`InterceptPrecisionPlugin`'s). When Lightning's accelerator connector is the reader,
    parsing a Trainer's arguments, returns the precision, the precision plugin and the accelerator
    the user passed, as the connector holds them then (the precision in Lightning's unified form,
    ``"16-mixed"``); otherwise None."""
    frame = sys._getframe(2)  # the getter's caller
    if frame.f_code.co_name != _PARSE_METHOD:
        return None
    connector: Any = frame.f_locals["self"]
    return (
        connector._precision_flag,
        connector._precision_plugin_flag,
        connector._accelerator_flag,
    )


#: The private attribute of each sharded Lightning strategy that says how it saves a checkpoint,
#: and its value for one whole file that rank 0 writes (as DDP's checkpoints are).
WHOLE_CHECKPOINTS = {
    "ModelParallelStrategy": ("_save_distributed_checkpoint", False),
    "FSDPStrategy": ("_state_dict_type", "full"),
}


@contextlib.contextmanager
def whole_checkpoints(strategy: Any, lightning_strategy: str) -> Iterator[None]:
    """Runs on each worker. Within it, a sharded strategy (``lightning_strategy`` names its
    Lightning class) saves checkpoints whole: every rank sends its shards, rank 0 writes one file
    on the CPU. Lightning's sharded strategies load such a file too."""
    name, whole = WHOLE_CHECKPOINTS[lightning_strategy]
    saved = getattr(strategy, name)
    setattr(strategy, name, whole)
    try:
        yield
    finally:
        setattr(strategy, name, saved)


def reduce_unbuilt_lazy_instance(obj: Any) -> Any:
    """A reduction for :func:`ray_lightning_sgd._serialization.pack`: an object of jsonargparse's
    ``lazy_instance`` (LightningCLI's defaults, ``profiler=lazy_instance(SimpleProfiler)``) not
    yet built, whose class has a ``__del__``, travels as the same lazy instance built on arrival.

    Such an object builds itself at its first method call. A copy of the CLI's configuration
    (``SaveConfigCallback.config``) is never called: unpickled on a worker, or back on the
    driver, it is collected unbuilt, and its class's ``__del__`` fails on it (Lightning's
    ``Profiler.__del__``: "no attribute '_stage'"), where ``ddp``'s processes keep theirs until
    they exit. None for anything else (a built one travels as it is, with its state).
    """
    if getattr(type(obj), "_lazy_init", None) is None:  # cheap: most objects stop here
        return None
    typing = sys.modules.get("jsonargparse.typing")
    base = getattr(typing, "_LazyInitBaseClass", None)
    if base is None or not isinstance(obj, base) or getattr(type(obj), "__del__", None) is None:
        return None
    state = getattr(obj, "__dict__", {})
    methods = state.get("_lazy_methods")
    if not isinstance(methods, dict) or not any(name in state for name in methods):
        return None  # built: its methods are the class's again
    return _built_lazy_instance, (type(obj), state["_lazy_class_type"], state["_lazy_kwargs"])


def _built_lazy_instance(lazy_class: type, class_type: type, kwargs: dict[str, Any]) -> Any:
    instance = lazy_class(class_type, dict(kwargs))
    instance._lazy_init()
    return instance
