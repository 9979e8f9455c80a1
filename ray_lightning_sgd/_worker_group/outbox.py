"""Runs on each worker: what a running function leaves for the driver, taken by the driver's polls.

A worker actor runs the driver's functions in one thread and answers polls in another (see
:class:`~ray_lightning_sgd._worker_group.worker._Worker`), so the driver can read a worker while it
trains, with no process in between. A function writes to this worker's :class:`Outbox`:

- :meth:`Outbox.append` adds items to a channel (events, output lines); each poll takes them all;
- :meth:`Outbox.put_latest` replaces a channel's value (where the rank is, the latest resume
  checkpoint); a poll takes a new value once, and reports every value's age at each poll;
- :meth:`Outbox.wait_delivered` waits until the driver holds a value: each poll carries the
  numbers of the values the driver has taken into its own memory (an acknowledgement).

Each call opens the outbox under its own id; the driver ignores mail of any other call (a warm
worker's previous one).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple


class Mail(NamedTuple):
    """One poll's answer: what the worker left since the previous poll."""

    #: The id of the call the worker is running (or ran last); "" before any.
    call_id: str
    #: Each channel's items, in the order they were added.
    items: dict[str, list[Any]]
    #: Each channel's latest value, when it changed since the previous poll.
    latest: dict[str, Any]
    #: Seconds since each channel's latest value was put, as the worker measured them.
    ages: dict[str, float]
    #: The number of each latest value in ``latest`` (to acknowledge it in a later poll).
    sequences: dict[str, int]


class Outbox:
    """Runs on each worker. A mailbox for the driver: written by the running function, read by
    polls (from another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._call_id = ""
        self._items: dict[str, list[Any]] = {}
        # channel -> (value, put at, sequence number, whether a poll took it)
        self._latest: dict[str, tuple[Any, float, int, bool]] = {}
        self._sequence = 0
        # channel -> the highest number the driver acknowledged holding
        self._acknowledged: dict[str, int] = {}

    def open(self, call_id: str) -> None:
        """Empties the outbox for a new call."""
        with self._lock:
            self._call_id = call_id
            self._items = {}
            self._latest = {}
            self._lock.notify_all()

    def append(self, channel: str, items: list[Any]) -> None:
        """Adds ``items`` to ``channel``; the next poll takes them."""
        with self._lock:
            self._items.setdefault(channel, []).extend(items)

    def put_latest(self, channel: str, value: Any) -> int:
        """Makes ``value`` the channel's latest; returns its number for :meth:`wait_delivered`."""
        with self._lock:
            self._sequence += 1
            self._latest[channel] = (value, time.monotonic(), self._sequence, False)
            return self._sequence

    def wait_delivered(self, channel: str, sequence: int, timeout_s: float) -> bool:
        """Waits until the driver holds value ``sequence`` of ``channel`` (or a later one was put
        or a new call opened); returns False if ``timeout_s`` passed first."""

        def delivered() -> bool:
            entry = self._latest.get(channel)
            if entry is None or entry[2] != sequence:
                return True  # replaced, or the outbox was opened for another call
            return self._acknowledged.get(channel, 0) >= sequence

        with self._lock:
            return self._lock.wait_for(delivered, timeout=timeout_s)

    def take(self, acknowledged: dict[str, int] | None = None) -> Mail:
        """Answers a poll: the items added and the values put since the previous poll.

        ``acknowledged`` maps channels to the highest value number the driver holds.
        """
        with self._lock:
            for channel, sequence in (acknowledged or {}).items():
                self._acknowledged[channel] = max(self._acknowledged.get(channel, 0), sequence)
            now = time.monotonic()
            items, self._items = self._items, {}
            latest, ages, sequences = {}, {}, {}
            for channel, (value, put_at, sequence, taken) in list(self._latest.items()):
                ages[channel] = now - put_at
                if not taken:
                    latest[channel], sequences[channel] = value, sequence
                    self._latest[channel] = (None, put_at, sequence, True)
            self._lock.notify_all()  # a waiting writer checks the acknowledgements
            return Mail(self._call_id, items, latest, ages, sequences)


_outbox = Outbox()


def get_outbox() -> Outbox:
    """Runs on each worker. This worker's outbox (one per process)."""
    return _outbox
