"""Rank 0's background sends of resume checkpoints (:mod:`ray_lightning_sgd._worker.uploads`), as
pure logic: sends that block until the test lets them go, one at a time, newer ones replacing
the one that waits, failures kept and reported, a failed call's sends never handed over."""

from __future__ import annotations

import threading

import pytest

from ray_lightning_sgd._worker.uploads import Upload, Uploads


class _Gate:
    """A send that waits until the test opens it, and records what happened."""

    def __init__(self, log: list[str], label: str, fails: bool = False) -> None:
        self.log, self.label, self.fails = log, label, fails
        self.started = threading.Event()
        self.go = threading.Event()

    def upload(self, kept: bool = False) -> Upload:
        return Upload(
            self.label, self.send, lambda: self.log.append(f"discard {self.label}"), kept=kept
        )

    def send(self, cancelled) -> None:
        self.started.set()
        assert self.go.wait(10), "the test never let the send go"
        if self.fails:
            raise OSError(f"refused {self.label}")
        self.log.append(f"{'dropped' if cancelled() else 'handed over'} {self.label}")


def test_one_send_at_a_time_and_a_newer_checkpoint_replaces_the_waiting_one():
    log: list[str] = []
    uploads = Uploads()
    first, second, third = (_Gate(log, name) for name in ("epoch 0", "epoch 1", "epoch 2"))
    uploads.submit(first.upload())
    assert first.started.wait(5)
    uploads.submit(second.upload())  # waits behind the first
    uploads.submit(third.upload())  # replaces the second, which never starts
    assert log == ["discard epoch 1"] and not second.started.is_set()
    assert uploads.busy() and not uploads.wait(0.05)
    first.go.set()
    assert third.started.wait(5)
    third.go.set()
    assert uploads.wait(5) and not uploads.busy()
    assert log == [
        "discard epoch 1",
        "handed over epoch 0",
        "discard epoch 0",
        "handed over epoch 2",
        "discard epoch 2",
    ]
    assert uploads.failure() is None and len(uploads.durations) == 2


def test_a_failed_send_is_reported_and_a_later_success_clears_it(caplog):
    log: list[str] = []
    uploads = Uploads()
    refused = _Gate(log, "epoch 0", fails=True)
    refused.go.set()
    uploads.submit(refused.upload())
    assert uploads.wait(5)
    failure = uploads.failure()
    assert failure is not None and failure[0] == "epoch 0"
    assert isinstance(failure[1], OSError) and "refused epoch 0" in str(failure[1])
    assert "could not be sent" in caplog.text and "stays the previous one" in caplog.text
    assert log == ["discard epoch 0"]  # its local copy goes all the same
    later = _Gate(log, "epoch 1")
    later.go.set()
    uploads.submit(later.upload())
    assert uploads.wait(5) and uploads.failure() is None


def test_a_failed_call_drops_the_waiting_send_and_never_hands_over_the_one_in_flight():
    log: list[str] = []
    uploads = Uploads()
    running, waiting = _Gate(log, "epoch 3"), _Gate(log, "epoch 4")
    uploads.submit(running.upload())
    assert running.started.wait(5)
    uploads.submit(waiting.upload())
    uploads.abandon()  # returns at once, the send in flight still blocked
    assert log == ["discard epoch 4"] and uploads.busy()
    running.go.set()
    assert uploads.wait(5)
    assert log == ["discard epoch 4", "dropped epoch 3", "discard epoch 3"]
    assert not waiting.started.is_set()


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_a_send_that_raises_any_exception_never_leaves_a_waiter_hanging(error):
    uploads = Uploads()

    def send(cancelled) -> None:
        raise error()

    uploads.submit(Upload("epoch 0", send, lambda: None))
    assert uploads.wait(5)
    failure = uploads.failure()
    assert failure is not None and isinstance(failure[1], error)


def test_an_epochs_end_that_waits_is_never_replaced_by_an_in_epoch_checkpoint():
    """An elastic run grows only from an epoch end's point: an in-epoch checkpoint made while
    the epoch's end waits is dropped instead (and room is made for it only where it replaces)."""
    log: list[str] = []
    uploads = Uploads()
    running, epoch_end = _Gate(log, "step 4"), _Gate(log, "epoch 0")
    inside, later_end = _Gate(log, "step 8"), _Gate(log, "epoch 1")
    uploads.submit(running.upload())
    assert running.started.wait(5)
    uploads.submit(epoch_end.upload(kept=True))
    uploads.make_room(kept=False)  # before step 8's save: epoch 0's stays
    uploads.submit(inside.upload())
    assert log == ["discard step 8"]
    uploads.make_room(kept=True)  # before epoch 1's save: epoch 0's goes now, not after it
    assert log == ["discard step 8", "discard epoch 0"]
    uploads.submit(later_end.upload(kept=True))
    for gate in (running, later_end):
        gate.go.set()
    assert uploads.wait(5)
    assert log[2:] == ["handed over step 4", "discard step 4", "handed over epoch 1",
                       "discard epoch 1"]  # fmt: skip
    assert not epoch_end.started.is_set() and not inside.started.is_set()
