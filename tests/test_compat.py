"""Every private Ray or Lightning name in ray_lightning_sgd._compat still exists where we expect it.

When one of these fails after an upgrade, the message names the attribute that moved.
"""

from __future__ import annotations

import importlib
import inspect
import time
import warnings
from typing import Any

import pytest
import ray
import ray._private.ray_constants as ray_constants
import torch

from ray_lightning_sgd import _compat
from ray_lightning_sgd import lightning as rls_lightning
from ray_lightning_sgd import pytorch_lightning as rls_pl
from ray_lightning_sgd._compat import ray as _compat_ray
from ray_lightning_sgd._compat.callbacks import _CALLBACK_DISPATCH
from tests.trackers import offline_comet_logger

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")


def test_ray_loopback_constant_exists():
    assert hasattr(ray_constants, "ENABLE_RAY_CLUSTER"), (
        "ray._private.ray_constants.ENABLE_RAY_CLUSTER moved; update _compat.bind_local_ray_to_loopback"
    )
    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == _compat_ray._RAY_LOOPBACK_ENV, (
        "ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR changed its name"
    )


def test_ray_reads_its_gcs_tries_when_a_driver_connects(monkeypatch):
    import inspect

    from ray._private import node

    # Node reads the module constant at each connection (where the count comes from)
    assert "ray_constants.NUM_REDIS_GET_RETRIES" in inspect.getsource(node.Node), (
        "ray._private.node.Node no longer reads NUM_REDIS_GET_RETRIES; update "
        "_compat.ray.few_gcs_tries"
    )
    for name in _compat_ray._GCS_TRIES_ENVS:
        monkeypatch.delenv(name, raising=False)
    before = ray_constants.NUM_REDIS_GET_RETRIES
    with _compat_ray.few_gcs_tries(5):
        assert ray_constants.NUM_REDIS_GET_RETRIES == min(before, 5)
    assert ray_constants.NUM_REDIS_GET_RETRIES == before
    monkeypatch.setenv("RAY_NUM_REDIS_GET_RETRIES", "40")  # the user's count stays
    with _compat_ray.few_gcs_tries(5):
        assert ray_constants.NUM_REDIS_GET_RETRIES == before


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_launcher_interface_exists(namespace):
    module = importlib.import_module(f"{namespace}.strategies.launchers.launcher")
    assert hasattr(module, "_Launcher"), (
        f"{namespace}.strategies.launchers.launcher._Launcher moved; update "
        "_compat.launcher_interface"
    )
    interface = _compat.launcher_interface(namespace)
    abstract = set(getattr(interface, "__abstractmethods__", ()))
    assert abstract == {"launch", "kill", "is_interactive_compatible"}, (
        f"{namespace}'s _Launcher now asks for {sorted(abstract)}; RayLauncherBase implements "
        "launch, kill and is_interactive_compatible"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_configure_launcher_hook_exists(namespace):
    strategies = importlib.import_module(f"{namespace}.strategies")
    hook = getattr(strategies.DDPStrategy, "_configure_launcher", None)
    assert hook is not None, (
        f"{namespace}.strategies.DDPStrategy._configure_launcher moved; update "
        "_compat.ConfigureLauncher"
    )
    assert "_configure_launcher" in inspect.getsource(strategies.Strategy.__init__) or (
        "_configure_launcher" in inspect.getsource(strategies.DDPStrategy)
    ), f"{namespace} no longer calls Strategy._configure_launcher; update _compat.ConfigureLauncher"
    assert isinstance(inspect.getattr_static(strategies.Strategy, "launcher"), property), (
        f"{namespace}.strategies.Strategy.launcher is no longer a property over _launcher"
    )


@pytest.mark.parametrize("module", [rls_pl, rls_lightning], ids=NAMESPACES)
def test_the_strategy_hands_lightning_its_launcher(module):
    strategy = module.RaySGDStrategy(num_workers=2)
    strategy._configure_launcher()
    assert isinstance(strategy.launcher, module.RayLauncher), (
        "Strategy.launcher no longer returns what _configure_launcher set in _launcher; "
        "update _compat.ConfigureLauncher"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_keeps_committed_metrics_behind_the_properties(namespace):
    trainer = importlib.import_module(namespace).Trainer(logger=False)
    connector = getattr(trainer, "_logger_connector", None)
    assert connector is not None, (
        f"{namespace}.Trainer._logger_connector moved; update _compat.committed_metrics"
    )
    committed = _compat.committed_metrics(trainer)
    properties = (trainer.progress_bar_metrics, trainer.callback_metrics, trainer.logged_metrics)
    for name, dict_, prop in zip(
        ("_progress_bar_metrics", "_callback_metrics", "_logged_metrics"),
        committed,
        properties,
        strict=True,
    ):
        # with no results to compute, each property returns its committed dict itself
        assert isinstance(dict_, dict) and dict_ is prop, (
            f"{namespace}'s logger connector no longer keeps {name} behind the Trainer's "
            "property; update _compat.committed_metrics"
        )
    source = inspect.getsource(type(connector))
    for commit_point in ("def on_batch_end", "def on_epoch_end", "def update_eval_epoch_metrics"):
        assert commit_point in source, (
            f"{namespace}'s logger connector has no {commit_point[4:]} any more: check where "
            "it commits metrics on every rank; update _compat.committed_metrics"
        )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_should_check_val_epoch_exists(namespace):
    trainer = importlib.import_module(namespace).Trainer(logger=False)
    method = getattr(trainer.fit_loop.epoch_loop, "_should_check_val_epoch", None)
    assert callable(method), (
        f"{namespace}'s _TrainingEpochLoop._should_check_val_epoch moved; update "
        "_compat.should_check_val_epoch"
    )
    assert _compat.should_check_val_epoch(trainer) in (True, False)


def test_no_assert_guards_runtime_behaviour():
    # asserts vanish under python -O; the package raises errors that say what went wrong
    import ast
    from pathlib import Path

    import ray_lightning_sgd

    found = []
    for path in Path(ray_lightning_sgd.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], f"assert statements in the package: {found}"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_fit_impl_takes_ckpt_path(namespace):
    trainer_cls = importlib.import_module(namespace).Trainer
    fit_impl = getattr(trainer_cls, "_fit_impl", None)
    assert fit_impl is not None, (
        f"{namespace}.Trainer._fit_impl moved; update _compat.with_ckpt_path"
    )
    assert "ckpt_path" in inspect.signature(fit_impl).parameters, (
        f"{namespace}.Trainer._fit_impl takes no ckpt_path any more; update _compat.with_ckpt_path"
    )

    def entry(model, train_dataloaders=None, ckpt_path=None):
        return model, ckpt_path

    args, kwargs = _compat.with_ckpt_path(entry, ("model",), {}, "/tmp/resume.ckpt")
    assert entry(*args, **kwargs) == ("model", "/tmp/resume.ckpt")
    assert _compat.ckpt_path_of(entry, args, kwargs) == "/tmp/resume.ckpt"
    assert _compat.ckpt_path_of(entry, ("model",), {}) is None


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_keeps_whether_the_user_chose_ckpt_path(namespace):
    trainer = importlib.import_module(namespace).Trainer(logger=False, enable_progress_bar=False)
    connector = getattr(trainer, "_checkpoint_connector", None)
    assert connector is not None and hasattr(connector, "_user_managed"), (
        f"{namespace}.Trainer._checkpoint_connector._user_managed moved; update "
        "_compat.checkpoint_selection and set_checkpoint_selection"
    )
    assert _compat.checkpoint_selection(trainer) == (None, False)
    trainer.ckpt_path = "/chosen.ckpt"
    assert _compat.checkpoint_selection(trainer) == ("/chosen.ckpt", True)
    # a path a call restored (rank 0's) is not the user's choice: the next call does not reuse it
    _compat.set_checkpoint_selection(trainer, ("/restored.ckpt", False))
    assert trainer.ckpt_path == "/restored.ckpt" and connector._user_managed is False
    assert _compat.checkpoint_selection(trainer) == ("/restored.ckpt", False)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_gives_the_profiler_a_weak_proxy_of_the_model(namespace):
    trainer_cls = importlib.import_module(namespace).Trainer
    assert "profiler._lightning_module = proxy(" in inspect.getsource(trainer_cls), (
        f"{namespace}.Trainer no longer sets profiler._lightning_module; update "
        "_compat.profiler_state and set_profiler_state"
    )
    profiler = importlib.import_module(f"{namespace}.profilers").SimpleProfiler()
    profiler.setup("fit", 0, "/logs")
    profiler._lightning_module = object()
    state = _compat.profiler_state(profiler)
    assert "_lightning_module" not in state and state["dirpath"] == "/logs"
    driver = importlib.import_module(f"{namespace}.profilers").SimpleProfiler()
    own = driver._lightning_module = object()
    _compat.set_profiler_state(driver, state)
    assert driver.dirpath == "/logs" and driver._lightning_module is own


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_loops_keep_their_batch_counts_where_the_trainer_reads_them(namespace):
    trainer = importlib.import_module(namespace).Trainer(logger=False, enable_progress_bar=False)
    counts = _compat.batch_counts(trainer)
    assert len(counts) == 5, "a loop's batch counts moved: update _compat._LOOP_BATCHES"
    counts = {
        "fit_loop": 4,
        "fit_loop.epoch_loop.val_loop": [2, 3],
        "validate_loop": [5],
        "test_loop": [6],
        "predict_loop": [7, 1],
    }
    _compat.set_batch_counts(trainer, counts)
    assert trainer.num_training_batches == 4 and trainer.num_val_batches == [2, 3]
    assert trainer.num_test_batches == [6] and trainer.num_predict_batches == [7, 1]
    assert trainer.validate_loop.max_batches == [5]
    assert _compat.batch_counts(trainer) == counts


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("max_steps", [-1, 8])
def test_a_loop_state_loaded_from_rank_0_is_finished_with_every_loop_it_holds(namespace, max_steps):
    # max_steps: the fit loop's restarting setter keeps True for an iteration-based fit
    trainer = importlib.import_module(namespace).Trainer(
        logger=False, enable_progress_bar=False, max_steps=max_steps
    )
    loop = trainer.fit_loop
    assert callable(getattr(loop, "on_iteration_done", None)), (
        f"{namespace}'s loops have no on_iteration_done any more; update _compat.mark_loop_finished"
    )
    loop.load_state_dict(loop.state_dict())  # what the driver does with rank 0's state
    loops = [loop, loop.epoch_loop, loop.epoch_loop.val_loop]
    assert loop.restarting == loop.epoch_loop.restarting == (max_steps > 0)
    _compat.mark_loop_finished(loop)
    assert [each.restarting for each in loops] == [False, False, False]
    assert not any(each._loaded_from_state_dict for each in loops)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_progress_bars_read_should_check_val_epoch(namespace):
    bar = importlib.import_module(namespace).callbacks.ProgressBar
    assert "fit_loop.epoch_loop._should_check_val_epoch()" in inspect.getsource(bar), (
        f"{namespace}'s ProgressBar no longer asks fit_loop.epoch_loop._should_check_val_epoch(); "
        "update _compat.val_check_view"
    )
    assert _compat.val_check_view(True).epoch_loop._should_check_val_epoch() is True
    assert _compat.val_check_view(False).epoch_loop._should_check_val_epoch() is False


def test_torch_has_its_distributed_error_classes():
    import torch.distributed as dist

    for name in _compat.torch.PEER_LOSS_ERRORS:
        assert isinstance(getattr(dist, name, None), type), (
            f"torch.distributed.{name} moved; update _compat.torch.PEER_LOSS_ERRORS"
        )
    assert _compat.torch.reads_as_a_lost_peer(dist.DistBackendError("gone"))
    assert _compat.torch.reads_as_a_lost_peer(RuntimeError("[gloo] Connection closed by peer"))
    assert not _compat.torch.reads_as_a_lost_peer(ValueError("broken pipe"))


def test_ray_object_refs_name_their_actor(ray_cluster):
    @ray.remote(num_cpus=0)
    class Probe:
        def ping(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    actor = Probe.remote()
    try:
        ref = actor.ping.remote()
        assert _compat.ray.actor_id_of(ref) == ray.get(ref), (
            "ObjectRef.task_id().actor_id() no longer names the actor; update _compat.ray.actor_id_of"
        )
        assert _compat.ray.actor_id_of(ray.put(1)) != ray.get(ref)
    finally:
        ray.kill(actor)


def test_ray_names_placement_group_resources_apart(free_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 0.001}])
    try:
        ray.get(group.ready(), timeout=30)
        deadline = time.monotonic() + 20
        while True:  # the cluster's resource view catches up with the new group within seconds
            names = list(ray.available_resources()) + list(ray.cluster_resources())
            held = [name for name in names if _compat.ray.is_placement_group_resource(name)]
            if held or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert held, f"no resource of {names} looks like a placement group's; update _compat.ray"
        assert not _compat.ray.is_placement_group_resource("CPU")
    finally:
        remove_placement_group(group)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_tuners_end_their_fit_with_the_tuner_exit_exception(namespace):
    exit_type = _compat.tuner_exit_exception(namespace)
    call = importlib.import_module(f"{namespace}.trainer.call")
    finder = importlib.import_module(f"{namespace}.callbacks.lr_finder")
    handler = inspect.getsource(call._call_and_handle_interrupt)
    assert f"except {exit_type.__name__}" in handler, (
        f"{namespace}'s _call_and_handle_interrupt no longer handles {exit_type.__name__}; "
        "update _compat.tuner_exit_exception"
    )
    assert "_call_teardown_hook(trainer)" in handler and "trainer._teardown()" in handler, (
        f"{namespace}'s tuner-exit handling changed; update _compat.end_after_tuner_exit"
    )
    assert callable(call._call_teardown_hook)
    assert f"raise {exit_type.__name__}()" in inspect.getsource(finder), (
        f"{namespace}'s LR finder no longer raises {exit_type.__name__}; "
        "update _compat.tuner_exit_exception"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_connector_reads_the_strategys_precision_while_parsing_the_arguments(namespace):
    connectors = importlib.import_module(f"{namespace}.trainer.connectors.accelerator_connector")
    method = getattr(connectors._AcceleratorConnector, _compat.lightning._PARSE_METHOD, None)
    assert method is not None, (
        f"{namespace}'s _AcceleratorConnector._check_config_and_set_final_flags moved; update "
        "_compat.trainer_arguments_being_parsed"
    )
    seen = []

    class Probe(_compat.InterceptPrecisionPlugin):
        def read_precision_plugin(self, own, arguments):
            seen.append(arguments)
            return own

    probe = Probe()
    attribute = _compat.lightning.PRECISION_PLUGIN_ATTRIBUTE
    assert getattr(probe, attribute) is None and seen == [None], "read outside the parse: nothing"
    pl = importlib.import_module(namespace)
    strategy = (rls_pl if namespace == "pytorch_lightning" else rls_lightning).RaySGDStrategy
    trainer_strategy = strategy(num_workers=1)
    # on this CPU machine Lightning turns 16-mixed into bf16-mixed after the capture
    pl.Trainer(strategy=trainer_strategy, precision=16, accelerator="cpu", logger=False)
    assert trainer_strategy.precision_request.precision == "16-mixed", (
        f"{namespace}'s accelerator connector no longer reads strategy.{attribute} in "
        "_check_config_and_set_final_flags after setting _precision_flag, _precision_plugin_flag "
        "and _accelerator_flag; update _compat.trainer_arguments_being_parsed"
    )
    assert trainer_strategy._precision_request is not None
    assert trainer_strategy.precision_request.accelerator == "cpu"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_sharded_strategies_keep_their_checkpoint_mode_where_expected(namespace):
    strategies = importlib.import_module(f"{namespace}.strategies")
    for cls, (name, whole) in _compat.lightning.WHOLE_CHECKPOINTS.items():
        strategy = getattr(strategies, cls)()
        assert hasattr(strategy, name), (
            f"{namespace}.strategies.{cls}.{name} moved; update _compat.whole_checkpoints"
        )
        sharded = {"_save_distributed_checkpoint": True, "_state_dict_type": "sharded"}[name]
        setattr(strategy, name, sharded)
        before = getattr(strategy, name)
        with _compat.whole_checkpoints(strategy, cls):
            assert getattr(strategy, name) == whole
        assert getattr(strategy, name) == before
    for cls, (name, _) in _compat.lightning.WHOLE_CHECKPOINTS.items():
        source = inspect.getsource(getattr(strategies, cls).save_checkpoint)
        assert name in source, (
            f"{namespace}'s {cls}.save_checkpoint no longer reads {name}; update "
            "_compat.whole_checkpoints"
        )


def test_torch_keeps_its_live_process_groups_where_expected():
    import torch.distributed.distributed_c10d as c10d

    assert isinstance(getattr(getattr(c10d, "_world", None), "pg_map", None), dict), (
        "torch.distributed.distributed_c10d._world.pg_map moved; update "
        "_compat.torch.destroy_mesh_groups"
    )


def test_ray_finds_the_address_to_join_where_expected(monkeypatch):
    from ray._private import services

    for name in ("canonicalize_bootstrap_address", "find_bootstrap_address"):
        assert callable(getattr(services, name, None)), (
            f"ray._private.services.{name} moved; update _compat.ray.address_to_join and "
            "recorded_address"
        )
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6553")
    assert _compat_ray.address_to_join().endswith(":6553")


def test_ray_tells_a_client_driver_from_a_connected_one(ray_cluster):
    # a driver connected directly is no client (tests/test_client.py drives a real client, whose
    # results would hang the driver if this did not say True there)
    assert _compat.ray.driver_is_a_client() is False


def test_an_unbuilt_lazy_instance_travels_built_and_a_built_one_as_it_is():
    """jsonargparse's lazy_instance (LightningCLI's profiler default): a copy of an unbuilt
    one, unpickled elsewhere and collected, must not run Lightning's Profiler.__del__ on an
    object that never got its attributes (each worker printed "no attribute '_stage'")."""
    import gc
    import sys

    from jsonargparse import lazy_instance
    from pytorch_lightning.profilers import SimpleProfiler

    from ray_lightning_sgd._serialization import pack, unpack

    unbuilt = lazy_instance(SimpleProfiler, filename="perf")
    assert "setup" in vars(unbuilt), "jsonargparse no longer keeps its lazy methods per object"
    failures: list[object] = []
    previous = sys.unraisablehook
    sys.unraisablehook = failures.append
    try:
        copy = unpack(pack(unbuilt))
        assert copy.filename == "perf" and copy._stage is None  # built on arrival
        del copy
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert failures == []
    assert "setup" in vars(unbuilt)  # the driver's own stays as it was
    built = lazy_instance(SimpleProfiler)
    built.setup(stage="fit")
    built.recorded_durations["step"].append(1.0)
    assert unpack(pack(built)).recorded_durations["step"] == [1.0]  # its state travels
    unbuilt._lazy_init()  # collected unbuilt, the test's own would fail as the copies did


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_strategy_keeps_its_precision_plugin_in_the_intercepted_attribute(namespace):
    attribute = _compat.lightning.PRECISION_PLUGIN_ATTRIBUTE
    strategies = importlib.import_module(f"{namespace}.strategies")
    plugin = importlib.import_module(f"{namespace}.plugins").Precision()
    lightning_strategy = strategies.DDPStrategy()
    lightning_strategy.precision_plugin = plugin
    assert vars(lightning_strategy).get(attribute) is plugin, (
        f"{namespace}.strategies.Strategy no longer keeps its precision plugin in {attribute}; "
        "update _compat.InterceptPrecisionPlugin and _compat.trainer_arguments_being_parsed"
    )
    vars(lightning_strategy)[attribute] = None
    assert lightning_strategy.precision_plugin is not plugin, (
        f"{namespace}.strategies.Strategy.precision_plugin no longer reads {attribute}; "
        "update _compat.InterceptPrecisionPlugin"
    )
    connectors = importlib.import_module(f"{namespace}.trainer.connectors.accelerator_connector")
    parse = getattr(connectors._AcceleratorConnector, _compat.lightning._PARSE_METHOD)
    assert f"self._strategy_flag.{attribute}" in inspect.getsource(parse), (
        f"{namespace}'s accelerator connector no longer reads the strategy's {attribute}; "
        "update _compat.InterceptPrecisionPlugin and _compat.trainer_arguments_being_parsed"
    )
    ours = (rls_pl if namespace == "pytorch_lightning" else rls_lightning).RaySGDStrategy()
    ours.precision_plugin = plugin  # through Lightning's setter: it writes the attribute
    assert attribute not in vars(ours) and getattr(ours, attribute) is plugin
    assert ours.precision_plugin is plugin


@pytest.fixture(scope="module", params=NAMESPACES)
def fitted(request, tmp_path_factory):
    """A Trainer of each namespace after a short fit on the CPU (4 batches), and its namespace."""
    namespace = request.param
    pl = importlib.import_module(namespace)
    boring = importlib.import_module(f"{namespace}.demos.boring_classes")

    class BeginsAgain(pl.Callback):
        """Does what the workers' strategy may do as the fit starts: iter() on its fetcher."""

        def on_train_start(self, trainer, pl_module):
            fetcher = _compat.train_data_fetcher(trainer)
            trainer.fetcher_began_again = iter(fetcher) is fetcher and fetcher.done is False

    trainer = pl.Trainer(
        callbacks=[BeginsAgain()],
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path_factory.mktemp("fit"),
    )
    trainer.fit(boring.BoringModel())
    return trainer, namespace


def test_lightning_checkpoints_keep_the_fit_loops_batch_counts_where_expected(fitted, tmp_path):
    import torch

    trainer, namespace = fitted
    lightning = _compat.lightning
    epoch_loop = trainer.fit_loop.epoch_loop
    assert getattr(epoch_loop, lightning._BATCHES_THAT_STEPPED, None) == 4, (
        f"{namespace}'s _TrainingEpochLoop.{lightning._BATCHES_THAT_STEPPED} moved; update "
        "_compat.logged_step and _compat.show_as_saved_at_batch_end"
    )
    assert _compat.logged_step(trainer) == 4
    trainer.save_checkpoint(tmp_path / "fit.ckpt")
    checkpoint = torch.load(tmp_path / "fit.ckpt", weights_only=False)
    loop = checkpoint["loops"].get(lightning._FIT_LOOP_STATE, {})
    for key in (lightning._BATCH_PROGRESS_STATE, lightning._EPOCH_LOOP_STATE):
        assert key in loop, (
            f"{namespace}'s checkpoints keep no loops['{lightning._FIT_LOOP_STATE}']['{key}'] any "
            "more; update _compat.show_as_saved_at_batch_end"
        )
    progress, state = loop[lightning._BATCH_PROGRESS_STATE], loop[lightning._EPOCH_LOOP_STATE]
    assert state.get(lightning._BATCHES_THAT_STEPPED) == 4, (
        f"{namespace}'s epoch loop state keeps no {lightning._BATCHES_THAT_STEPPED} any more; "
        "update _compat.show_as_saved_at_batch_end"
    )
    for scope in lightning._BATCH_COUNT_SCOPES:
        for name in ("ready", "completed"):
            assert progress.get(scope, {}).get(name) == 4, (
                f"{namespace}'s checkpoints keep no batch_progress['{scope}']['{name}'] any more; "
                "update _compat.show_as_saved_at_batch_end"
            )
    assert progress.get("is_last_batch") is True, (
        f"{namespace}'s checkpoints keep no batch_progress['is_last_batch'] any more; update "
        "_compat.show_as_saved_at_batch_end"
    )
    _compat.show_as_saved_at_batch_end(checkpoint)
    assert [progress[scope]["ready"] for scope in ("total", "current")] == [3, 3]
    assert [progress[scope]["completed"] for scope in ("total", "current")] == [3, 3]
    assert progress["is_last_batch"] is False and state[lightning._BATCHES_THAT_STEPPED] == 3
    restored = type(epoch_loop.batch_progress)()
    restored.load_state_dict(progress)
    assert (restored.total.ready, restored.current.completed) == (3, 3), (
        f"{namespace}'s batch_progress no longer loads the counts a checkpoint keeps; update "
        "_compat.show_as_saved_at_batch_end"
    )


def test_lightning_epoch_loop_keeps_its_batch_counts_where_expected(fitted):
    trainer, namespace = fitted
    progress = trainer.fit_loop.epoch_loop.batch_progress
    lightning = _compat.lightning
    before = {}
    for scope in lightning._BATCH_COUNT_SCOPES:
        for name in lightning._BATCH_COUNTS:
            value = getattr(getattr(progress, scope, None), name, None)
            assert isinstance(value, int), (
                f"{namespace}'s _TrainingEpochLoop.batch_progress.{scope}.{name} moved; update "
                "_compat.shift_batch_counts"
            )
            before[scope, name] = value
    _compat.shift_batch_counts(trainer, -2)
    try:
        for (scope, name), value in before.items():
            assert getattr(getattr(progress, scope), name) == value - 2
    finally:
        _compat.shift_batch_counts(trainer, 2)


def test_lightning_fit_loop_keeps_its_combined_loader_where_expected(fitted):
    from torch.utils.data import DataLoader

    trainer, namespace = fitted
    fresh = importlib.import_module(namespace).Trainer(logger=False, enable_progress_bar=False)
    attribute = _compat.lightning._COMBINED_LOADER
    assert hasattr(fresh.fit_loop, attribute), (
        f"{namespace}'s _FitLoop.{attribute} moved; update _compat.train_combined_loader"
    )
    assert _compat.train_combined_loader(fresh) is None
    combined = _compat.train_combined_loader(trainer)
    flattened = getattr(combined, "flattened", None)
    assert isinstance(flattened, list) and isinstance(flattened[0], DataLoader), (
        f"{namespace}'s _FitLoop.{attribute} no longer holds the fit's train iterables (a "
        "CombinedLoader's flattened); update _compat.train_combined_loader"
    )
    fetcher = _compat.lightning._DATA_FETCHER
    assert hasattr(fresh.fit_loop, fetcher) and _compat.train_data_fetcher(fresh) is None
    assert trainer.fetcher_began_again, (  # type: ignore[attr-defined]
        f"{namespace}'s _FitLoop.{fetcher} no longer holds the fetcher of the fit's train "
        "batches as the fit starts; update _compat.train_data_fetcher"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_keeps_hyperparameters_where_expected(namespace):
    pl = importlib.import_module(namespace)
    attribute = _compat.HPARAMS_ATTRIBUTE

    class Module(pl.LightningModule):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()

    class Data(pl.LightningDataModule):
        def __init__(self, batch_size: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters()

    for obj, hparams in ((Module(), {"width": 3}), (Data(), {"batch_size": 2})):
        assert vars(obj).get(attribute) == hparams, (
            f"{namespace}'s {type(obj).__mro__[1].__name__} no longer keeps its hyperparameters "
            f"in {attribute}; update _compat.HPARAMS_ATTRIBUTE"
        )
        assert obj.hparams is vars(obj)[attribute], (
            f"{namespace}'s hparams no longer reads {attribute}; update _compat.HPARAMS_ATTRIBUTE"
        )


def test_torch_compile_keeps_the_compiled_module_where_expected():
    import torch

    attribute = _compat.torch.COMPILED_MODULE_ATTRIBUTE
    inner = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.compile(inner))
    assert getattr(model[0], attribute, None) is inner, (
        f"torch.compile's OptimizedModule no longer keeps the module it compiled in {attribute}; "
        "update _compat.torch.uncompiled_name"
    )
    uncompiled = torch.nn.Sequential(torch.nn.Linear(2, 2))
    names = [_compat.torch.uncompiled_name(name) for name, _ in model.named_parameters()]
    assert names == [name for name, _ in uncompiled.named_parameters()], (
        f"a compiled submodule's weights are no longer named <name>.{attribute}.<...>; update "
        "_compat.torch.uncompiled_name"
    )
    state = {_compat.torch.uncompiled_name(key) for key in model.state_dict()}
    assert state == set(uncompiled.state_dict())


class _HookRecorder:
    """A callback body for either namespace: notes its hooks in ``calls``, and what user code
    sees in ``trainer.callbacks``."""

    def __init__(self, name: str, calls: list[str], seen: list[list[Any]] | None = None) -> None:
        super().__init__()
        self.name, self.calls, self.seen = name, calls, seen
        self.loaded: dict[str, Any] = {}

    @property
    def state_key(self) -> str:
        return f"recorder.{self.name}"

    def _note(self, hook: str, trainer: Any) -> None:
        self.calls.append(f"{self.name}.{hook}")
        if self.seen is not None:
            self.seen.append(list(trainer.callbacks))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._note("on_train_batch_start", trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._note("on_train_epoch_end", trainer)

    def setup(self, trainer, pl_module, stage):
        self._note("setup", trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._note("on_save_checkpoint", trainer)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._note("on_load_checkpoint", trainer)
        if self.seen is not None:  # the user's: our states are out of sight
            self.seen.append(sorted(checkpoint["callbacks"]))


def _tiny_fit_parts(namespace: str, tmp_path):
    from torch.utils.data import DataLoader

    from tests.helpers import TinyModelSteps, make_data

    pl = importlib.import_module(namespace)
    model = type("TinyModel", (TinyModelSteps, pl.LightningModule), {})()
    kwargs = dict(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    return pl, model, kwargs, DataLoader(make_data(32), batch_size=8)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_calls_hidden_callbacks_around_its_own(namespace, tmp_path):
    pl, model, kwargs, data = _tiny_fit_parts(namespace, tmp_path)
    callback = type("Recorder", (_HookRecorder, pl.Callback), {})
    calls: list[str] = []
    seen: list[list[Any]] = []
    user = callback("user", calls, seen)
    first, last = callback("first", calls), callback("last", calls)
    trainer = pl.Trainer(callbacks=[user], **kwargs)
    with _compat.hidden_callbacks(trainer, namespace, [first], [last]):
        assert _compat.hidden_callbacks_of(trainer) == (first, last)
        trainer.fit(model, data)
        trainer.save_checkpoint(tmp_path / "saved.ckpt")
    moved = (
        f"{namespace}.trainer.call no longer calls callbacks through {', '.join(_CALLBACK_DISPATCH)}; "
        "update _compat.hidden_callbacks"
    )
    assert calls[:3] == ["first.setup", "user.setup", "last.setup"], moved
    assert calls.count("first.on_train_batch_start") == 2, moved
    for index, call in enumerate(calls):
        if call == "user.on_train_batch_start":
            assert calls[index - 1] == "first.on_train_batch_start", moved
        if call == "user.on_train_epoch_end":
            assert calls[index + 1] == "last.on_train_epoch_end", moved
    assert ["first.on_save_checkpoint", "user.on_save_checkpoint", "last.on_save_checkpoint"] == [
        c for c in calls if c.endswith("on_save_checkpoint")
    ], moved
    assert all(cbs == [user] for cbs in seen), "user code saw the hidden callbacks"
    saved = torch.load(tmp_path / "saved.ckpt", weights_only=False)["callbacks"]
    assert list(saved) == ["recorder.first", "recorder.user", "recorder.last"], moved

    # loaded back: each hidden one gets its state, the user's callback sees only its own, and
    # Lightning does not warn of a callback missing from its list
    calls.clear()
    seen.clear()
    first, last = callback("first", calls), callback("last", calls)
    trainer = pl.Trainer(callbacks=[user], **{**kwargs, "max_epochs": 2})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*callbacks used to create the checkpoint")
        with _compat.hidden_callbacks(trainer, namespace, [first], [last]):
            trainer.fit(model, data, ckpt_path=tmp_path / "saved.ckpt")
    assert (first.loaded, last.loaded) == ({"name": "first"}, {"name": "last"}), moved
    assert ["recorder.user"] in seen and all(
        entry in ([user], ["recorder.user"]) for entry in seen
    ), "the user's on_load_checkpoint saw the hidden callbacks' states"

    # a list of Lightning's own in their place (a tuner's): the hidden ones are not called
    with _compat.hidden_callbacks(trainer, namespace, [first], [last]):
        trainer.callbacks = []
        assert _compat.hidden_callbacks_of(trainer) == ()
    assert _compat.hidden_callbacks_of(trainer) == ()


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_hidden_callbacks_stay_called_when_the_model_configures_callbacks(namespace, tmp_path):
    pl, model, kwargs, data = _tiny_fit_parts(namespace, tmp_path)
    callback = type("Recorder", (_HookRecorder, pl.Callback), {})
    calls: list[str] = []
    seen: list[list[Any]] = []
    from_model = callback("model", calls, seen)
    model.configure_callbacks = lambda: [from_model]  # Lightning puts a new list in place
    first, last = callback("first", calls), callback("last", calls)
    trainer = pl.Trainer(**kwargs)
    with _compat.hidden_callbacks(trainer, namespace, [first], [last]):
        trainer.fit(model, data)
    assert calls.count("first.on_train_batch_start") == 2, (
        f"{namespace}'s _CallbackConnector._attach_model_callbacks moved: the hidden callbacks "
        "no longer follow the list it makes; update _compat.hidden_callbacks"
    )
    assert calls.count("last.on_train_epoch_end") == 1
    assert seen and all(cbs == [from_model] for cbs in seen), "user code saw the hidden callbacks"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_predict_batch_indices_are_those_lightning_gives_its_writers(namespace, tmp_path):
    pl, model, kwargs, data = _tiny_fit_parts(namespace, tmp_path)
    given: list[list[int]] = []
    read: list[list[int]] = []

    class Writer(pl.callbacks.BasePredictionWriter):
        def write_on_batch_end(self, trainer, pl_module, prediction, indices, *args):
            given.append(list(indices))
            read.append(_compat.predict_batch_indices(trainer, args[-2], args[-1]))

    pl.Trainer(callbacks=[Writer("batch")], **kwargs).predict(model, data)
    assert given == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert read == given, (
        f"{namespace}'s predict loop no longer notes a batch's indices in "
        "_combined_loader.flattened[i].batch_sampler.seen_batch_indices; update "
        "_compat.predict_batch_indices"
    )


def test_ray_data_tells_a_known_row_count_and_a_split_names_its_coordinator(ray_cluster):
    import ray.data

    assert _compat.ray.known_row_count(ray.data.range(10)) == 10, (
        "Dataset._meta_count() no longer gives a range's rows; update _compat.ray.known_row_count"
    )
    mapped = ray.data.range(10).map_batches(lambda batch: batch)
    assert _compat.ray.known_row_count(mapped) is None  # a map may change it: Ray Data says so
    iterators = ray.data.range(10).streaming_split(2)
    coordinator = _compat.ray.split_coordinator(iterators[0])
    assert isinstance(coordinator, ray.actor.ActorHandle), (
        "a streaming split's iterator no longer holds its coordinator in _coord_actor; update "
        "_compat.ray.split_coordinator"
    )
    assert _compat.ray.split_coordinator(iterators[1]) == coordinator
    ray.kill(coordinator, no_restart=True)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_keeps_the_device_mesh_where_expected(namespace):
    """The workers give a ModelParallelStrategy and its module the mesh of an earlier call."""
    pl = importlib.import_module(namespace)
    strategy = pl.strategies.ModelParallelStrategy()
    module = pl.LightningModule()
    strategy._lightning_module = module
    mesh = object()
    _compat.lightning.set_device_mesh(strategy, mesh)
    assert strategy.device_mesh is mesh and module.device_mesh is mesh, (
        f"{namespace}'s ModelParallelStrategy or LightningModule no longer keep the device mesh "
        "in _device_mesh; update _compat.lightning.set_device_mesh"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_tracker_loggers_keep_their_runs_where_expected(namespace, tmp_path, monkeypatch):
    """The private attributes of Lightning's tracker loggers that ``_compat.trackers`` reads and
    sets (no run is made: the loggers are only built)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = importlib.import_module(f"{namespace}.loggers")
    trackers = _compat.trackers
    mlflow = loggers.MLFlowLogger("e", tracking_uri="http://127.0.0.1:9")  # never reached
    assert {"_run_id", "_initialized"} <= set(vars(mlflow)), "MLFlowLogger moved its run's id"
    trackers.set_version(mlflow, "abc")
    assert (mlflow._run_id, mlflow._initialized) == ("abc", False), "MLFlowLogger moved _run_id"
    wandb = loggers.WandbLogger(project="p", save_dir=str(tmp_path), offline=True)
    assert {"_id", "_wandb_init", "_experiment"} <= set(vars(wandb)), "WandbLogger moved its id"
    trackers.set_version(wandb, "xyz")
    assert wandb.version == "xyz" and wandb._wandb_init["id"] == "xyz", "WandbLogger moved _id"
    assert wandb._experiment is None, "WandbLogger moved _experiment"
    state = trackers.portable_state(wandb)
    assert state["_id"] == "xyz" and state["_experiment"] is None and "_attach_id" not in state
    comet = offline_comet_logger(loggers, tmp_path, "p")
    assert hasattr(comet, "_experiment_key"), "CometLogger moved _experiment_key"
    comet._experiment = _OpenRun()  # an experiment this process holds
    state = trackers.portable_state(comet)
    assert state["_experiment_key"] == "run-id" and state["_experiment"] is None
    trackers.set_version(comet, "0" * 32)
    assert (comet._experiment_key, comet._experiment) == ("0" * 32, None)
    board = loggers.TensorBoardLogger(str(tmp_path))
    assert {"_kwargs", "_version", "_experiment"} <= set(vars(board)), "TensorBoardLogger moved"
    trackers.purge_later_steps(board, 7)
    assert board._kwargs["purge_step"] == 7
    # the purge is the restarted fit's own: the driver's copy, and a later call's, have none
    assert "purge_step" not in trackers.portable_state(board)["_kwargs"]
    trackers.set_version(board, 3)
    assert board.version == 3
    assert trackers.tracked([board, loggers.CSVLogger(str(tmp_path))]) is False
    assert trackers.tracked([mlflow]) is True
    assert trackers.env_prefixes([wandb, mlflow, board]) == ("MLFLOW_", "WANDB_")


class _OpenRun:
    """Stands for a W&B run that a process holds open (pure logic: no W&B service)."""

    id, name = "run-id", "run-name"

    def __init__(self) -> None:
        self.finished = False

    def get_key(self) -> str:  # as a Comet experiment names itself
        return self.id

    def finish(self, exit_code: int | None = None) -> None:
        self.finished = True


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_wandb_logger_travels_by_its_runs_id_never_attached(namespace, tmp_path, monkeypatch):
    """Packed for the workers, a W&B logger whose run is open carries its id and no handle
    (Lightning's own ``__getstate__`` would make the run attachable to this process only); the
    driver finishes a run it holds before a call, and rank 0 resumes it by its id."""
    from ray_lightning_sgd._serialization import pack, unpack

    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = importlib.import_module(f"{namespace}.loggers")
    logger = loggers.WandbLogger(project="p", save_dir=str(tmp_path), offline=True)
    logger._experiment = run = _OpenRun()
    copy = unpack(pack(logger))
    assert type(copy) is type(logger)
    assert copy._experiment is None and copy.version == "run-id"
    assert not hasattr(copy, "_attach_id")
    assert not run.finished
    _compat.trackers.release(logger)
    assert run.finished and logger._experiment is None
    assert logger.version == "run-id" and logger._wandb_init["id"] == "run-id"
    # a run the user started (wandb.init before the logger: Lightning logs to wandb.run)
    import wandb as wandb_module

    other = loggers.WandbLogger(project="p", save_dir=str(tmp_path), offline=True)
    monkeypatch.setattr(wandb_module, "run", user_run := _OpenRun())
    _compat.trackers.release(other)
    assert user_run.finished and other.version == "run-id"
