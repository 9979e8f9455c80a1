"""The worker's outbox, alone (no Ray): what a poll takes, and when a value counts as delivered."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from ray_lightning_sgd._worker_group.outbox import Outbox


def test_a_poll_takes_items_once_and_new_latest_values_once():
    outbox = Outbox()
    outbox.open("call-1")
    outbox.append("lines", ["a", "b"])
    outbox.append("lines", ["c"])
    outbox.put_latest("where", ("training", 3))
    mail = outbox.take()
    assert mail.call_id == "call-1"
    assert mail.items == {"lines": ["a", "b", "c"]}
    assert mail.latest == {"where": ("training", 3)}
    again = outbox.take()
    assert again.items == {} and again.latest == {}, "a second poll takes nothing twice"
    assert again.ages["where"] >= mail.ages["where"], "but still says how old the value is"


def test_opening_for_a_new_call_empties_the_outbox():
    outbox = Outbox()
    outbox.open("call-1")
    outbox.append("lines", ["old"])
    outbox.put_latest("where", ("training", 1))
    outbox.open("call-2")
    mail = outbox.take()
    assert mail == ("call-2", {}, {}, {}, {}, True, ())
    outbox.close()
    assert outbox.take().running is False, "the driver learns that the call ended"


def test_a_value_is_delivered_once_the_driver_acknowledges_it():
    outbox = Outbox()
    outbox.open("call")
    sequence = outbox.put_latest("resume", b"checkpoint")
    assert not outbox.wait_delivered("resume", sequence, timeout_s=0.05), "nobody polled yet"
    mail = outbox.take()
    assert mail.latest == {"resume": b"checkpoint"} and mail.sequences == {"resume": sequence}
    # taken is not held: the answer may never reach the driver; only its acknowledgement counts
    assert not outbox.wait_delivered("resume", sequence, timeout_s=0.05)
    outbox.take()
    assert not outbox.wait_delivered("resume", sequence, timeout_s=0.05)
    outbox.take(acknowledged={"resume": sequence})
    assert outbox.wait_delivered("resume", sequence, timeout_s=0.05)


def _writer_waiting_for(
    channel: str, value: bytes
) -> tuple[Outbox, int, threading.Thread, list[bool]]:
    """An outbox holding ``value`` and a started thread that waits (10 s at most) until it is
    delivered; the list gets what the wait returned."""
    outbox = Outbox()
    outbox.open("call")
    sequence = outbox.put_latest(channel, value)
    delivered: list[bool] = []
    writer = threading.Thread(
        target=lambda: delivered.append(outbox.wait_delivered(channel, sequence, timeout_s=10))
    )
    writer.start()
    return outbox, sequence, writer, delivered


def test_a_waiting_writer_wakes_when_the_driver_polls_again():
    outbox, sequence, writer, delivered = _writer_waiting_for("resume", b"checkpoint")
    started = time.monotonic()
    outbox.take()
    outbox.take(acknowledged={"resume": sequence})
    writer.join(timeout=10)
    assert delivered == [True]
    assert time.monotonic() - started < 5


def test_a_writer_waiting_for_a_value_wakes_when_a_later_one_replaces_it():
    outbox, _, writer, delivered = _writer_waiting_for("resume", b"epoch 0")
    time.sleep(0.1)  # the writer waits
    started = time.monotonic()
    outbox.put_latest("resume", b"epoch 1")  # no poll: only the replacement can wake it
    writer.join(timeout=10)
    assert delivered == [True]  # the value it waited for is no longer the one to deliver
    assert time.monotonic() - started < 2


def test_rank_0s_events_and_output_reach_the_driver_in_the_order_they_happened(monkeypatch):
    """Lines rank 0 prints and its callback events travel in two channels; the driver printed a
    poll's lines first, then replayed its events. Now the events before a line go first once
    one at a boundary waits (or the flush interval passed): all of them between two hooks, as
    Lightning prints "`Trainer.fit` stopped" after the last epoch's end, all but the running
    hook's inside one; from the thread whose hooks make them only. The driver takes the two
    channels in the order the worker added them, and a sent function that raises still lets
    the rank's later lines show."""
    from ray import cloudpickle

    from ray_lightning_sgd._boundary.channels import EVENTS, OUTPUT
    from ray_lightning_sgd._driver.inbox import RunInbox, in_order
    from ray_lightning_sgd._driver.run import Run
    from ray_lightning_sgd._worker import events, output

    outbox = Outbox()
    outbox.open("call")
    for module in (events, output):
        monkeypatch.setattr(module, "get_outbox", lambda: outbox)
    monkeypatch.setattr(events, "_state", lambda trainer: {})
    # reading the metrics warns (a line of its own): no second flush inside the first
    monkeypatch.setattr(
        events,
        "_metrics",
        lambda trainer: output.OutputForwarder().add("stderr", ["warned while flushing"]) or {},
    )
    forwarder = events.EventForwarderBase()
    forwarder._last_flush = time.monotonic() + 3600  # nothing due by time: all stay pending
    module = SimpleNamespace(_current_fx_name="training_step")
    trainer = SimpleNamespace(lightning_module=module)
    events.open_channel(forwarder)
    try:
        forwarder._event(trainer, "on_train_batch_start")  # type: ignore[arg-type]
        output.OutputForwarder().add("stdout", ["a print in a step"])  # no boundary waits
        forwarder._event(trainer, "on_train_batch_end")  # type: ignore[arg-type]
        forwarder._event(trainer, "on_train_epoch_end", boundary=True)  # type: ignore[arg-type]
        elsewhere = threading.Thread(
            target=output.OutputForwarder().add, args=("stderr", ["from another thread"])
        )
        elsewhere.start()
        elsewhere.join()
        module._current_fx_name = None  # between hooks: Lightning's fit loop says it stopped
        output.OutputForwarder().add("stdout", ["`Trainer.fit` stopped: `max_epochs=1` reached."])
        forwarder._event(trainer, "on_train_end")  # type: ignore[arg-type]
        module._current_fx_name = "on_train_end"  # inside a hook: its own event stays
        forwarder._due = True
        output.OutputForwarder().add("stdout", ["a print in on_train_end"])
    finally:
        events.close_channel()
    mail = outbox.take()
    assert mail.order == ((OUTPUT, 3), (EVENTS, 1), (OUTPUT, 2))
    sent = [hook for blob in mail.items[EVENTS] for hook, *_ in cloudpickle.loads(blob)]
    assert sent == ["on_train_batch_start", "on_train_batch_end", "on_train_epoch_end"]
    assert forwarder._due, "the event held back still goes at the next hook"
    assert [channel for channel, _ in in_order(mail, (OUTPUT, EVENTS))] == [OUTPUT, EVENTS, OUTPUT]
    assert [len(chunk) for _, chunk in in_order(mail, (OUTPUT, EVENTS))] == [3, 1, 2]
    # the driver prints and replays in that order
    shown: list[str] = []
    inbox = RunInbox(None, None, Run())
    monkeypatch.setattr(inbox, "_ask_news", lambda rank: None)  # no worker to ask
    inbox.attach([0], "call")  # type: ignore[list-item]  (only its length)
    monkeypatch.setattr(
        inbox._printer, "write", lambda rank, lines: shown.extend(line for _, line in lines)
    )
    inbox.replay = type(  # type: ignore[assignment]
        "Replay", (), {"replay": lambda self, blobs, run_calls: shown.append("events")}
    )()
    inbox._deliver(0, mail, run_calls=False)
    assert shown == [
        "a print in a step", "from another thread", "warned while flushing", "events",
        "`Trainer.fit` stopped: `max_epochs=1` reached.", "a print in on_train_end",
    ]  # fmt: skip

    def raises(blobs, run_calls):
        raise RuntimeError("a function sent to the driver failed")

    shown.clear()
    inbox.replay.replay = raises  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="sent to the driver failed"):
        inbox._deliver(0, mail, run_calls=True)
    assert shown[-2:] == [
        "`Trainer.fit` stopped: `max_epochs=1` reached.", "a print in on_train_end",
    ]  # fmt: skip
