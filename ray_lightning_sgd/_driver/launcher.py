"""The launcher: runs a Trainer entry point (fit, validate, test, predict) on a Ray worker group.

Driver half. :meth:`RayLauncherBase.launch` checks the call (:mod:`.checks`), snapshots the
driver's global state into one :class:`~ray_lightning_sgd._boundary.payload.Payload`, and runs it
through the :class:`~ray_lightning_sgd._executor.controller.RunController`: each attempt pickles
the payload (:mod:`.packing`) into Ray's object store while it takes workers from the pool
(:mod:`ray_lightning_sgd._executor.pool`), sends every worker the worker half (its namespace's
``RayLauncher.worker_half``: :func:`ray_lightning_sgd._worker.entry.run_on_worker`) and waits
while the inbox (:mod:`.inbox`) polls them and delivers into the launch's :class:`~.run.Run`;
an elastic fit's :class:`~.scaling.GrowthPolicy` is asked between waits. The workers go back on
every path. Rank 0's results then go into the driver's Trainer and model (:mod:`.results`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import ray
from typing_extensions import override

from ray_lightning_sgd import _compat, _files, _scratch
from ray_lightning_sgd._boundary.datasets import DatasetSplit
from ray_lightning_sgd._boundary.environment import RayEnvironmentBase
from ray_lightning_sgd._boundary.payload import FITTING, PREDICTING, GlobalState, Payload, Shipped
from ray_lightning_sgd._boundary.results import WorkerOutput
from ray_lightning_sgd._boundary.resume_points import ResumePoint, remove_storage_folder
from ray_lightning_sgd._compat.flavour import Flavour
from ray_lightning_sgd._driver import artifacts, datasets, runs, signals
from ray_lightning_sgd._driver import storage as _storage
from ray_lightning_sgd._driver.checks import check_global_batch, check_trainer
from ray_lightning_sgd._driver.inbox import PUMP_INTERVAL_S, RunInbox
from ray_lightning_sgd._driver.packing import pack_payload, release_logger_runs
from ray_lightning_sgd._driver.replay import DriverReplay
from ray_lightning_sgd._driver.results import adopt_logger_runs, recover_results_in_driver
from ray_lightning_sgd._driver.run import Run, describe_sizes
from ray_lightning_sgd._driver.run_config import RunConfig
from ray_lightning_sgd._driver.scaling import GrowthPolicy, PlacementGroupProbe
from ray_lightning_sgd._driver.stacks import RankStack
from ray_lightning_sgd._driver.strategy_view import StrategyView
from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._executor.controller import Attempts, Resize, RunController
from ray_lightning_sgd._executor.executor import BackendExecutor
from ray_lightning_sgd._serialization import Packed, unpack
from ray_lightning_sgd._worker_group import cluster, code
from ray_lightning_sgd._worker_group.config import WorkerGroupConfig
from ray_lightning_sgd.exceptions import (
    ConfigurationError,
    WorkerDiedError,
    WorkerGroupError,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

    from ray_lightning_sgd._compat.lightning import LauncherInterface as _Base
else:
    _Base = object

log = logging.getLogger(__name__)

#: How long a failed attempt's end waits for its killed workers' local checkpoint copies to be
#: released, at most (seconds).
_SWEEP_WAIT_S = 1.0
#: How long rank 0 may take to remove a succeeded launch's folder of the storage.
_REMOVE_FOLDER_WAIT_S = 60.0
#: How long a failed attempt's rank 0 may take to end its trackers' runs before it is stopped.
_TRACKERS_END_S = 20.0


class RayLauncherBase(_Base):
    """Driver side: launches a Trainer entry point on a gang of Ray actors and brings results back.

    The implementation for either Lightning namespace; the ``RayLauncher`` of
    :mod:`ray_lightning_sgd.pytorch_lightning` and :mod:`ray_lightning_sgd.lightning` join it with
    that namespace's launcher interface.

    Args:
        strategy: The strategy whose worker group and backend configs the launch uses.
    """

    #: The worker half: what each worker runs (the packed payload's object, the modules to import
    #: first, the Ray Data splits, the attempt's id) and returns (its packed
    #: :class:`~ray_lightning_sgd._boundary.results.WorkerOutput`); each namespace's
    #: ``RayLauncher`` names :func:`ray_lightning_sgd._worker.entry.run_on_worker`.
    worker_half: ClassVar[
        staticmethod[[Shipped, Sequence[str], Sequence[DatasetSplit], str], Packed]
    ]

    def __init__(self, strategy: StrategyView) -> None:
        self._strategy = strategy
        #: The attempt whose workers run now (what ``kill`` stops).
        self._attempt: _Attempt | None = None
        #: The latest launch's state (its world sizes, ...); None before the first.
        self.run: Run | None = None
        #: The running launch's inbox (for its workers' stacks); None between launches.
        self._inbox: RunInbox | None = None
        #: Whether the running launch's Trainer logs to an experiment tracker's run.
        self._tracked = False

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        # Ray actors are separate processes started by Ray, so notebooks work
        return True

    @override
    def launch(
        self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any
    ) -> Any:
        """Driver side: runs ``function`` on every worker and returns rank 0's result.

        With a Trainer, the driver's Trainer and model afterwards hold what the workers produced.
        """
        self.run = None  # the previous launch's state goes, also when this one is refused
        call = _Call(function, args, kwargs, trainer, self._strategy.flavour)
        config = self._strategy.run_config
        _check_call(call, self._strategy)
        cluster.connect()
        run_id = uuid.uuid4().hex[:12]
        storage = _storage.run_folder(config.checkpoint_storage, run_id, config.run_name)
        named = call.fitting and config.run_name is not None and storage is not None
        with contextlib.ExitStack() as held:
            if named:  # one driver at a time trains a named run: until this call ends
                held.enter_context(runs.run_lock(str(storage), str(config.run_name)))
            self.run = run = Run(
                _stored_resume_point(call, self._strategy, storage) if named else None
            )
            inbox = _inbox_for(call, self._strategy, run, run_id)
            # after the checks that may refuse the call: nothing of it is left on the driver's disk
            mirror = artifacts.prepare(trainer) if trainer is not None else None
            try:  # from here on, every path out removes the probe
                template = self._payload(call, run_id, storage, mirror, inbox is not None)
                controller = self._controller(call, template, run, inbox)
                self._inbox = inbox
                with (
                    signals.sigterm_raises(self._strategy.flavour.sigterm_exception),
                    signals.sigusr1_calls(lambda: _want_stacks(inbox)),
                ):
                    outputs = controller.run(resume=run.resume)
            except BaseException as err:
                if inbox is not None and inbox.replay is not None:
                    inbox.replay.fail(err)
                if trainer is not None:  # Lightning's finalize("failed") follows, on these
                    adopt_logger_runs(trainer, run.logger_versions)
                raise
            finally:
                self._inbox = None
                _finish_artifacts(mirror)
            return self._bring_back(call, outputs, run)  # a named run's lock held till the end

    def _payload(
        self, call: _Call, run_id: str, storage: str | None, mirror: Any, polled: bool
    ) -> Payload:
        """Driver side: the call as the workers receive it, less each attempt's id and resume
        point; the driver's global state captured now."""
        config, group = self._strategy.run_config, self._strategy.worker_group_config
        loggers = [] if call.trainer is None else call.trainer.loggers
        release_logger_runs(loggers)
        self._tracked = _compat.trackers.tracked(loggers)
        # the storage's options, where given, are its settings: its variables stay on the driver
        given = None if config.storage_options else config.checkpoint_storage
        prefixes = _compat.trackers.env_prefixes(loggers) + _files.env_prefixes(
            _storage_uris(call.trainer, given)
        )
        return Payload(
            call.trainer, call.function, call.args, call.kwargs,
            GlobalState.capture(group.worker_env, prefixes),
            call_id=run_id,
            forward_events=polled and bool(_driver_callbacks(call.trainer, self._strategy)),
            report_progress=polled,  # for the progress timeout and the hang report
            resume_every_n_epochs=(
                config.checkpoint_every_n_epochs
                if config.writes_resume_checkpoints or group.elastic
                else 0
            ),
            resume_on_preemption=config.max_preemptions != 0,
            resume_storage=storage, resume_keep_last=config.keep_last,
            resume_at_fit_end=storage is not None and config.run_name is not None,
            resume_every_n_steps=config.checkpoint_every_n_steps or 0,
            resume_every_s=config.checkpoint_every_s or 0.0,
            storage_options=config.storage_options,
            artifacts=mirror,
            results_in_band=_compat.ray.driver_is_a_client(),
            global_batch_workers=(
                group.num_workers if self._strategy.keep_global_batch_size and group.elastic else 0
            ),
        )  # fmt: skip

    def _controller(
        self, call: _Call, template: Payload, run: Run, inbox: RunInbox | None
    ) -> RunController[_Attempt, list[WorkerOutput], ResumePoint]:
        """Driver side: the controller of this launch's attempts, with their functions and, for
        an elastic ``fit``, a growth policy."""
        config, group = self._strategy.run_config, self._strategy.worker_group_config
        growth = None
        if call.fitting and group.elastic and call.trainer is not None:
            growth = GrowthPolicy(
                group.num_workers, config.resize_interval_s, call.trainer.max_epochs,
                latest=lambda: run.resume,
                probe=PlacementGroupProbe(lambda: self._group_config(bool(run.datasets))),
            )  # fmt: skip
        numbers = itertools.count()
        # a fit's own folder of the storage goes after its success; a named run's stays
        own_folder = template.resume_storage if call.fitting and config.run_name is None else None

        def start(resume: ResumePoint | None) -> _Attempt:
            payload = template._replace(
                call_id=f"{template.call_id}-{next(numbers)}",
                resume=resume,
                # a restart: rank 0's loggers continue the runs the attempts before wrote
                logger_versions=run.logger_versions,
                logged_steps=run.logged_steps,
            )
            return self._start_attempt(payload, run, inbox, growth)

        def on_restart(cause: WorkerDiedError | Resize, count: int, resume: Any) -> None:
            _log_restart(cause, count, resume, config, call.fitting)

        return RunController(
            Attempts(
                start=start,
                wait=functools.partial(self._wait, run=run, inbox=inbox),
                stop=lambda attempt, succeeded, error: self._stop_attempt(
                    attempt, succeeded, run, inbox, own_folder, error=error
                ),
                resume_point=lambda: run.resume if call.fitting and inbox is not None else None,
            ),
            max_failures=config.max_failures,
            on_restart=on_restart,
            max_preemptions=config.max_preemptions,
            scaling=growth,
            decide_every_s=PUMP_INTERVAL_S,  # asked between two looks at the polls' answers
        )

    def _bring_back(self, call: _Call, outputs: list[WorkerOutput], run: Run) -> Any:
        """Driver side: the call's result; with a Trainer, rank 0's results put into the
        driver's Trainer, model and datamodule."""
        trainer = call.trainer
        if trainer is None:
            return outputs[0].results
        result = recover_results_in_driver(trainer, outputs, call.datamodule, run.datasets)
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(environment, RayEnvironmentBase):
            environment.ran_with(len(outputs))  # an elastic run's last size
        if run.rank_timings:
            log.info("Step times by rank:\n%s", "\n".join(str(t) for t in run.rank_timings))
        if call.fitting:
            run.fit_ended(trainer.current_epoch)
            if self._strategy.worker_group_config.elastic:
                log.info("World size by epoch: %s", describe_sizes(run.world_sizes))
        return result

    def _start_attempt(
        self, payload: Payload, run: Run, inbox: RunInbox | None, growth: GrowthPolicy | None
    ) -> _Attempt:
        """Driver side: pickles the payload, puts it into the object store and, meanwhile, starts
        (or takes warm) workers; then sends them the call. Pickled first: what cannot be pickled
        fails before any worker starts; what fails once the workers started stops them.

        Ray Data's datasets are set aside from the payload and split once the workers are
        placed, over this attempt's world size."""
        packed = pack_payload(payload)
        to_split, packed = packed.set_aside, packed._replace(set_aside=())
        run.datasets = to_split  # what rank 0's shards stand for when its results come back
        predicting = payload.trainer is not None and payload.trainer.state.fn == PREDICTING
        strategy = self._strategy
        feeds = (type(strategy).__name__, strategy.sharded, predicting)
        unplaced = strategy.tensor_parallel_size()  # None: "auto", known once placed
        if to_split:
            datasets.check_room(strategy.worker_group_config, to_split)
            datasets.check_strategy(*feeds, unplaced)
        putter = ThreadPoolExecutor(1, thread_name_prefix="ray_lightning_sgd-put")
        shipped = putter.submit(ray.put, packed)  # the copy overlaps the workers' start
        putter.shutdown(wait=False)
        del packed
        self._attempt = attempt = _Attempt(None, shipped, payload.call_id)
        try:
            # held by the attempt as it returns: a Ctrl-C right after still stops its workers
            attempt.executor = executor = self._start_executor(bool(to_split))
            run.attempt_started(executor.worker_group.metadata)
            if growth is not None:
                growth.attempt_started(run.size)
            if inbox is not None:
                inbox.attach(executor.worker_group, attempt.call_id)
            placed = executor.worker_group.metadata
            strategy.check_placed(placed)  # "auto" sizes resolved where the workers landed
            if to_split and unplaced is None:
                datasets.check_strategy(*feeds, strategy.tensor_parallel_size(placed), auto=True)
            attempt.splits = datasets.split(to_split, placed, predicting)
            imports = (self._strategy.flavour.namespace,)
            attempt.refs = executor.run_async(
                self.worker_half,
                Shipped(shipped.result()),
                imports,
                attempt.splits,
                attempt.call_id,
            )
        except BaseException:  # the controller stops only the attempts it got back
            if attempt.executor is None:  # none started
                self._attempt = None
                shipped.cancel()  # nothing keeps the payload in the object store
                raise
            self._stop_attempt(attempt, succeeded=False, run=run, inbox=inbox)
            raise
        return attempt

    def _wait(
        self, attempt: _Attempt, wait_s: float | None, run: Run, inbox: RunInbox | None
    ) -> list[WorkerOutput] | None:
        """Driver side: waits for the workers' results up to ``wait_s`` while the inbox polls
        them; None while they still run."""
        executor = attempt.executor
        if executor is None:
            raise WorkerGroupError("an attempt is waited for while its workers run")
        watch, interval = (None, 1.0) if inbox is None else (inbox.pump, PUMP_INTERVAL_S)
        try:
            results = executor.worker_group.wait(
                attempt.refs, wait_s, watch=watch, watch_interval_s=interval
            )
        except WorkerDiedError as err:
            raise run.lost(err)  # noqa: B904 - the same error, completed
        if results is None:
            return None
        if inbox is not None:
            inbox.finish()  # the last output and events: the workers left them before returning
            run.rank_timings = inbox.stragglers.summary()
        return [unpack(out) for out in results]

    def _stop_attempt(
        self,
        attempt: _Attempt,
        succeeded: bool,
        run: Run,
        inbox: RunInbox | None,
        storage_to_remove: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Driver side: keeps (after a success, with ``reuse_workers``) or stops the workers;
        after a success, has rank 0 remove the launch's own folder of the storage. ``error``:
        what ended the attempt, if anything did."""
        executor, attempt.executor = attempt.executor, None
        refs, attempt.shipped, attempt.refs = attempt.refs, None, []  # (the payload may go)
        self._attempt = None
        splits, attempt.splits = attempt.splits, []
        # False until rank 0 has removed the folder: a Ctrl-C during the removal (up to a
        # minute) leaves that rank 0 at it, not one to keep warm
        removed = storage_to_remove is None
        try:
            if isinstance(error, WorkerDiedError) and refs and self._tracked:
                # rank 0, its collective broken by the lost process, ends its trackers' runs
                # as failed (an offline W&B run of a killed process loses what it had not
                # written); not after a rank's error (its process lives: the collective waits)
                # nor an interrupt, a hang or a resize, where rank 0 trains on
                ray.wait(refs[:1], timeout=_TRACKERS_END_S)
            datasets.close(splits)  # the workers are done with them, or about to be stopped
            if succeeded and executor is not None and storage_to_remove is not None:
                removed = _remove_storage_folder(executor, storage_to_remove)
            if inbox is not None:
                inbox.abandon()  # a lost or failed attempt: what its survivors left, no calls
        finally:  # a second Ctrl-C during the above still stops the workers
            if executor is not None:
                # a worker that received SIGTERM is about to end: not one to keep warm
                # nor one whose rank 0 failed to remove the folder (dead, or still at it)
                keep = succeeded and self._strategy.reuse_workers and not run.doomed and removed
                try:
                    pool.release(executor, keep=keep, graceful=succeeded)
                finally:
                    # local copies of resume checkpoints that killed workers of this node left
                    # (workers on other nodes sweep theirs at the next copy they make); after a
                    # failure, a moment for the killed ones' locks to go with their processes
                    _scratch.sweep(wait_s=0.0 if succeeded else _SWEEP_WAIT_S)

    def _group_config(self, streams: bool) -> WorkerGroupConfig:
        """The strategy's group settings for a call; one that ``streams`` Ray Data datasets on
        an elastic group keeps a CPU free for Ray Data's tasks at every size but its smallest
        (:func:`datasets.check_room` checks that one before the workers start)."""
        config = self._strategy.worker_group_config
        if streams and config.elastic:
            config = dataclasses.replace(config, keep_free=datasets.KEEP_FREE)
        return config

    def _start_executor(self, streams: bool) -> BackendExecutor:
        strategy = self._strategy
        config = self._group_config(streams)
        if config.ship_driver_code:
            config = dataclasses.replace(config, driver_code=_driver_code())
        # returned at once: the attempt holds it before a Ctrl-C can land (the pool logs reuse)
        return pool.acquire(strategy.backend_config, config, reuse=strategy.reuse_workers)[0]

    def worker_stacks(self, timeout_s: float) -> list[RankStack]:
        """Driver side, any thread: every rank's stack now; [] when no call runs."""
        inbox = self._inbox
        return [] if inbox is None else inbox.stacks(timeout_s)

    @override
    def kill(self, signum: int) -> None:
        """Driver side: stops every worker at once."""
        attempt = self._attempt
        if attempt is not None and attempt.executor is not None:
            attempt.executor.shutdown(graceful=False)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_attempt"] = None  # the driver's handles stay on the driver
        state["run"] = None
        state["_inbox"] = None
        return state


def _remove_storage_folder(executor: BackendExecutor, uri: str) -> bool:
    """Driver side: has rank 0 remove a succeeded fit's own folder of the storage (where rank 0
    wrote it: the driver's machine may not reach it); whether it did. A failure to is a warning,
    not an error."""
    group = executor.worker_group
    try:
        ref = group.execute_single_async(0, remove_storage_folder, uri)
        group.get([ref], timeout_s=_REMOVE_FOLDER_WAIT_S)
    except Exception as err:  # noqa: BLE001 - the call succeeded; a stale folder is no error
        log.warning("Could not remove the resume checkpoints in %s: %s", uri, err)
        return False
    return True


@dataclass
class _Attempt:
    """Driver side: one attempt's running workers and its payload in the object store."""

    executor: BackendExecutor | None
    shipped: Future[ray.ObjectRef] | None
    call_id: str
    #: The workers' futures of the call, once sent.
    refs: list[ray.ObjectRef] = field(default_factory=list)
    #: The call's Ray Data datasets, split over this attempt's ranks.
    splits: list[DatasetSplit] = field(default_factory=list)


@dataclass(frozen=True)
class _Call:
    """Driver side: the Trainer entry point a launch runs, as Lightning handed it over."""

    function: Callable
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    trainer: pl.Trainer | None
    flavour: Flavour

    @property
    def fitting(self) -> bool:
        return self.trainer is not None and self.trainer.state.fn == FITTING

    @property
    def model(self) -> Any:
        return self.args[0] if self.args else self.kwargs.get("model")

    @property
    def datamodule(self) -> Any:
        """The call's datamodule, if one was passed."""
        values = [*self.args, *self.kwargs.values()]
        return next((a for a in values if isinstance(a, self.flavour.datamodule)), None)


def _check_call(call: _Call, strategy: StrategyView) -> None:
    """Driver side, before Ray is touched: raises for a Trainer, model or storage the strategy
    cannot run."""
    bare = datasets.bare_dataset([*call.args, *call.kwargs.values()])
    if bare is not None:
        raise ConfigurationError(
            f"a ray.data.Dataset was passed where Lightning takes a DataLoader ({bare!r}): wrap "
            "it, RayDataLoader(dataset, batch_size=...) (from ray_lightning_sgd.data), so that "
            "each worker streams its share"
        )
    if call.trainer is None:
        return
    check_trainer(call.trainer, strategy)
    if call.fitting:
        check_global_batch(call.trainer, call.model, strategy)
        config = strategy.run_config
        if config.checkpoint_storage is not None:
            # the driver's own reads and writes of the storage take its options too
            _files.use_storage_options(
                _storage.resolve(config.checkpoint_storage), config.storage_options
            )
            _storage.check_storage(config.checkpoint_storage, config.run_name)


def _storage_uris(trainer: pl.Trainer | None, checkpoint_storage: str | None) -> list[str]:
    """Driver side: where the call writes files: ``checkpoint_storage``, the Trainer's
    ``default_root_dir``, its checkpoint callbacks' and loggers' folders."""
    uris = [] if checkpoint_storage is None else [checkpoint_storage]
    if trainer is None:
        return uris
    uris.append(str(trainer.default_root_dir))
    places = [getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks]
    places += [getattr(logger, "save_dir", None) for logger in trainer.loggers]
    return uris + [str(place) for place in places if place is not None]


def _stored_resume_point(
    call: _Call, strategy: StrategyView, storage: str | None
) -> ResumePoint | None:
    """Driver side: where a named run's ``fit`` resumes: its latest stored resume point."""
    name = str(strategy.run_config.run_name)
    settings = runs.run_settings(strategy, call.model)
    point = runs.resume_named_run(str(storage), name, settings)
    if (
        point is not None
        and _compat.ckpt_path_of(call.function, call.args, call.kwargs) is not None
    ):
        log.warning(
            "fit(ckpt_path=...) is ignored: run %r resumes from its own latest resume "
            "checkpoint (%s); pass another run_name to start from ckpt_path",
            name,
            point.uri,
        )
    return point


def _inbox_for(call: _Call, strategy: StrategyView, run: Run, run_id: str) -> RunInbox | None:
    """Driver side: where the workers' output, events, progress and resume points arrive; None
    for a call without a Trainer (a plain function has no callbacks to report through)."""
    if call.trainer is None:
        return None
    replay = DriverReplay(call.trainer, _driver_callbacks(call.trainer, strategy))
    config = strategy.run_config
    folder = None
    if strategy.debug:  # each rank's output in a file of its own, for a post-mortem
        folder = os.path.join(call.trainer.default_root_dir, "rank_logs", run_id)
        log.info("Each rank's output goes to %s/rank-<R>.log too", folder)
    return RunInbox(replay, config.progress_timeout_s, run, config.hang_report_after_s, folder)


def _want_stacks(inbox: RunInbox | None) -> None:
    """Driver side, in the SIGUSR1 handler: a thread of its own prints every rank's stack (the
    main thread may be blocked in a driver callback: no pump would print it)."""
    if inbox is not None:
        name = "ray_lightning_sgd-stacks"
        threading.Thread(target=inbox.print_stacks, name=name, daemon=True).start()


def _driver_code() -> code.DriverCode:
    """Driver side: the driver's own code now, shipped through Ray when workers may run on
    another node (the cluster has several, or the driver is a Ray Client, on none of them)."""
    if _compat.ray.driver_is_a_client():
        return code.snapshot(None, ship=True)
    node_id = ray.get_runtime_context().get_node_id()
    others = any(node["NodeID"] != node_id for node in ray.nodes() if node.get("Alive"))
    return code.snapshot(node_id, ship=others)


def _finish_artifacts(mirror: Any) -> None:
    """Driver side, on every path out of a launch: ends the artifacts' probe. What fails here is
    logged: it must not replace the call's own error."""
    try:
        artifacts.finish(mirror)
    except Exception:
        log.warning("Could not remove the artifacts' probe file", exc_info=True)


def _driver_callbacks(trainer: pl.Trainer | None, strategy: StrategyView) -> list[Callback]:
    """Driver side: the callbacks that run on the driver: the Trainer's progress bar (the workers
    run none) and the strategy's ``driver_callbacks``."""
    if trainer is None:
        return []
    bar = trainer.progress_bar_callback
    return ([] if bar is None else [bar]) + list(strategy.driver_callbacks)


def _log_restart(
    err: WorkerDiedError | Resize,
    failures: int,
    resume: ResumePoint | None,
    config: RunConfig,
    fitting: bool,
) -> None:
    if isinstance(err, Resize):
        log.info("Regroup %d: %s", failures, err)
        return
    name, budget = ("max_failures", config.max_failures)
    if err.preempted:
        name, budget = ("max_preemptions", config.max_preemptions)
    limit = "no limit" if budget == -1 else f"of {name}={budget}"
    if not fitting:
        where = "running the call again"
    elif resume is None:
        where = "fit starts over: no resume checkpoint was written yet"
    else:
        where = f"fit resumes {resume.describe()}"
    cause = "a preemption" if err.preempted else "a worker failure"
    log.warning("Restart %d (%s) after %s: %s; %s", failures, limit, cause, err, where)
