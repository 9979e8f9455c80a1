"""The worker actor: runs the functions the driver sends, and notes where their errors came from."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import ray

from ray_lightning_sgd._worker_group.context import current_context
from ray_lightning_sgd._worker_group.outbox import Mail, get_outbox
from ray_lightning_sgd._worker_group.ranks import WorkerMetadata, rank_on_node
from ray_lightning_sgd._worker_group.stacks import ThreadStack, stack_of
from ray_lightning_sgd.exceptions import WorkerError

T = TypeVar("T")


#: The attribute a worker sets on an exception raised inside ``torch.distributed``.
IN_COLLECTIVE = "_ray_lightning_sgd_in_collective"


#: The actor's second thread: polls are answered while a function runs in the first.
POLL_GROUP = "poll"
#: The actor's third thread: the driver's standing question whether to poll this worker now
#: (:meth:`_Worker.news`), held while a function runs.
NEWS_GROUP = "news"

#: The outbox channel that tells the driver this worker received SIGTERM while running a call.
SIGTERM_NOTICE = "sigterm"
#: The outbox channel of the run's latest resume point (rank 0's), which the driver takes at once:
#: until it holds the point, a lost rank restarts the run from an older one.
RESUME_POINT = "resume"
#: How long a worker that received SIGTERM during a call lives on, at most, for the driver to
#: take the notice (a spot node's or a draining node's warning: the process is about to go).
_SIGTERM_GRACE_S = 3.0
#: How long a worker whose call ended well after its SIGTERM lives on, at most, for its reply to
#: reach the driver (which stops the group, never kept warm with such a worker, once it holds
#: every reply).
_REPLY_WAIT_S = 5.0


class PreemptionNotice:
    """Runs on each worker: whether this process received SIGTERM during a call, for the code
    that acts on it before the process ends (see :mod:`ray_lightning_sgd._worker.resume`)."""

    def __init__(self) -> None:
        self.received = threading.Event()
        #: How long the running call asks to go on after a notice, at most, once the driver
        #: holds it (0: the worker ends at once); the call's own policy (a ``fit`` that
        #: checkpoints at its next step boundary, see :mod:`ray_lightning_sgd._worker.resume`).
        self.grace_s = 0.0


#: This process's notice (a worker process runs one call at a time).
preemption = PreemptionNotice()


class _Worker:
    """Runs on each worker. The Ray actor that executes the functions the driver sends.

    Functions run one at a time, in a thread of the actor's own (Ray's default concurrency group
    of one); :meth:`poll` runs in a second thread, so that the driver reads the worker's outbox
    while a function runs (the pattern of Ray Train v2's workers).

    A SIGTERM that reaches the worker while it runs a function is a preemption notice: the
    worker tells the driver (:data:`SIGTERM_NOTICE`), which counts the loss of this worker as a
    preemption, then ends (the signal's default action) once the driver has the notice, within
    a few seconds; a ``fit`` that acts on the notice (:data:`preemption`) trains on, once the
    driver has the notice, to the step boundary where the ranks exchange notices, rank 0 writes
    a resume checkpoint and the call ends, within the grace the call asked for
    (``preemption.grace_s``). An idle worker ends at once, as Ray's own handler ends it.
    """

    def __init__(self) -> None:
        self._running = False
        #: The thread that runs the driver's functions (the training thread), once one ran.
        self._thread: int | None = None
        self._call_ended = threading.Event()
        self._call_ok = False
        # an actor is created in its process's main thread, the only one that installs handlers
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous is None:  # installed outside Python: its action is the default's
                previous = signal.SIG_DFL
            signal.signal(
                signal.SIGTERM, lambda signum, frame: self._on_sigterm(previous, signum, frame)
            )

    def _on_sigterm(self, previous: Any, signum: int, frame: Any) -> None:
        """Runs in the worker's main thread on SIGTERM: notifies the driver while a function
        runs, and ends the process once the driver has the notice; an idle worker ends as it
        did before (Ray's handler)."""
        if not self._running:
            signal.signal(signal.SIGTERM, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                os.kill(os.getpid(), signal.SIGTERM)
            return
        # Ray's handler would wait for the running function; the signal's own action does not
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
        outbox = get_outbox()
        sequence = outbox.put_latest(SIGTERM_NOTICE, os.getpid())
        preemption.received.set()
        # a fit that checkpoints at its next step end ends the call there
        train_on_s = preemption.grace_s

        def end_once_delivered() -> None:
            # a driver that takes no notice is gone (Ray ends its workers): nobody restarts
            delivered = outbox.wait_delivered(SIGTERM_NOTICE, sequence, _SIGTERM_GRACE_S)
            if delivered and train_on_s and self._call_ended.wait(train_on_s) and self._call_ok:
                # the call ended well after the notice (the fit finished before the ranks
                # exchanged it): its reply goes to the driver, which then stops this worker
                time.sleep(_REPLY_WAIT_S)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=end_once_delivered, daemon=True).start()

    def metadata(self) -> WorkerMetadata:
        context = ray.get_runtime_context()
        return WorkerMetadata(
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            actor_id=context.get_actor_id() or "",
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
        )

    @ray.method(concurrency_group=POLL_GROUP)
    def poll(self, acknowledged: dict[str, int] | None = None) -> Mail:
        """What the running (or last) function left for the driver since the previous poll;
        ``acknowledged``: the numbers of the latest values the driver holds."""
        return get_outbox().take(acknowledged)

    @ray.method(concurrency_group=NEWS_GROUP)
    def news(self, call_id: str, items_after_s: float) -> bool:
        """Returns once call ``call_id`` has something the driver should poll for now: True at
        once for a SIGTERM notice or a new resume point, after ``items_after_s`` for output lines or sent functions;
        False once that call ended, or once another call began here (see
        :meth:`Outbox.wait_news`). The driver holds one such
        question per worker, so it can poll the workers of a large group seldom."""
        return get_outbox().wait_news(call_id, (SIGTERM_NOTICE, RESUME_POINT), items_after_s)

    @ray.method(concurrency_group=POLL_GROUP)
    def stack(self) -> ThreadStack | None:
        """The stack of the thread that runs the driver's function, read while it runs; None
        when no function runs."""
        if not self._running or self._thread is None:
            return None
        return stack_of(self._thread)

    def execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._thread = threading.get_ident()
        self._call_ended.clear()
        self._call_ok = False
        # a call that ended abnormally (a fit killed by its thread's end, a callback that never
        # ran) must not leave a warm worker training on after a later call's SIGTERM
        preemption.grace_s = 0.0
        self._running = True
        try:
            result = fn(*args, **kwargs)
            self._call_ok = True
            return result
        except BaseException as err:
            # the driver re-raises this very exception; say where it came from
            where = f"pid {os.getpid()} on {ray.util.get_node_ip_address()}"
            context = current_context()
            if context is not None:
                rank = context.rank
                where = rank_on_node(rank.global_rank, context.metadata, rank.world_size)
            err.add_note(f"Raised on {where}. Worker traceback:\n{traceback.format_exc()}")
            if _raised_inside_torch(err):
                # travels with the exception (its __dict__ is pickled): the driver may blame a
                # lost peer for it, never for an error of user code that reads alike
                setattr(err, IN_COLLECTIVE, True)
            stand_in = _as_travelling(err)
            if stand_in is not err:
                raise stand_in from None
            raise
        finally:
            self._running = False
            preemption.grace_s = 0.0
            get_outbox().close()  # the driver's standing question about this call is answered
            self._call_ended.set()


def _as_travelling(err: BaseException) -> BaseException:
    """Runs on each worker. ``err`` if it reaches the driver as itself; else a
    :class:`WorkerError` that names it. One that does not unpickle (an ``__init__`` with other
    arguments than its ``args``) would reach the driver as Ray's ``UnserializableException``,
    and a ``SystemExit`` (user code that called ``sys.exit``) would end the worker's process
    (Ray's way with it): both would read as a lost worker, which a restart retries, every time
    alike."""
    from ray import cloudpickle

    if isinstance(err, SystemExit):
        stand_in = WorkerError(
            f"SystemExit({err.code!r}): code on the worker called sys.exit({err.code!r}) "
            "(or exit()); a rank cannot end its process on its own. Raise an exception to "
            "stop the call, or set trainer.should_stop = True to end a fit early"
        )
    else:
        try:
            cloudpickle.loads(cloudpickle.dumps(err))
            return err
        except Exception as problem:  # noqa: BLE001 - whatever pickling raises
            kind = type(err)
            stand_in = WorkerError(
                f"{kind.__module__}.{kind.__qualname__}: {err} (the exception itself cannot "
                f"reach the driver: {type(problem).__name__}: {problem})"
            )
    for note in getattr(err, "__notes__", ()):
        stand_in.add_note(note)
    if getattr(err, IN_COLLECTIVE, False):
        setattr(stand_in, IN_COLLECTIVE, True)
    return stand_in


def _raised_inside_torch(err: BaseException) -> bool:
    """Runs on each worker. Whether ``err`` came out of torch itself: its innermost Python frame
    is in the torch package (``torch.distributed``, or the autograd engine whose backward runs
    DDP's all-reduce in C++), not in user code."""
    torch = sys.modules.get("torch")
    frames = traceback.extract_tb(err.__traceback__)
    if torch is None or torch.__file__ is None or not frames:
        return False
    package = os.path.dirname(torch.__file__) + os.sep
    return frames[-1].filename.startswith(package)
