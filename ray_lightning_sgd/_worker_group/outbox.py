"""Runs on each worker: what a running function leaves for the driver, taken by the driver's polls.

A worker actor runs the driver's functions in one thread and answers polls in another (see
:class:`~ray_lightning_sgd._worker_group.worker._Worker`), so the driver can read a worker while it
trains, with no process in between. A function writes to this worker's :class:`Outbox`:

- :meth:`Outbox.append` adds items to a channel (events, output lines); each poll takes them all;
- :meth:`Outbox.put_latest` replaces a channel's value (where the rank is, the latest resume
  checkpoint); a poll takes a new value once, and reports every value's age at each poll;
- :meth:`Outbox.wait_delivered` waits until the driver holds a value: each poll carries the
  numbers of the values the driver has taken into its own memory (an acknowledgement);
- :meth:`Outbox.wait_news` answers the driver's standing question "is there anything I should
  ask you for now?": at once for an urgent value (a SIGTERM notice), after a while for items
  (output lines, functions sent to the driver), so that the driver, which asks the ranks of a
  large group seldom, asks a rank at once when it has something to say.

Each call opens the outbox under its own id; the driver ignores mail of any other call (a warm
worker's previous one).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Collection
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
    #: Whether the call ``call_id`` still runs (False: it ended, its result waits or went).
    running: bool = True
    #: The order in which ``items`` were added across channels: (channel, how many) runs.
    order: tuple[tuple[str, int], ...] = ()


class Outbox:
    """Runs on each worker. A mailbox for the driver: written by the running function, read by
    polls (from another thread)."""

    def __init__(self) -> None:
        mutex = threading.RLock()
        self._lock = threading.Condition(mutex)
        # the news question waits on its own condition (same lock), woken only by what it asks
        # about: never at each step's progress or event
        self._news = threading.Condition(mutex)
        self._urgent: Collection[str] = ()  # the channels the waiting news question names
        self._call_id = ""
        # how many calls opened the outbox so far, and whether the latest is still running
        self._opened = 0
        self._running = False
        # the ids of the latest calls that ended here: a question about one of them is late
        self._ended: collections.deque[str] = collections.deque(maxlen=16)
        self._items: dict[str, list[Any]] = {}
        # [channel, how many] runs: the order of the items across channels
        self._order: list[list[Any]] = []
        # channel -> (value, put at, sequence number, whether a poll took it)
        self._latest: dict[str, tuple[Any, float, int, bool]] = {}
        self._sequence = 0
        # channel -> the highest number the driver acknowledged holding
        self._acknowledged: dict[str, int] = {}

    def open(self, call_id: str) -> None:
        """Empties the outbox for a new call."""
        with self._lock:
            self._call_id = call_id
            self._opened += 1
            self._running = True
            self._items, self._order = {}, []
            self._latest = {}
            self._lock.notify_all()
            self._news.notify_all()

    def close(self) -> None:
        """The call ended (its mail stays for the driver's last polls)."""
        with self._lock:
            if self._running:
                self._ended.append(self._call_id)
            self._running = False
            self._news.notify_all()

    def append(self, channel: str, items: list[Any]) -> None:
        """Adds ``items`` to ``channel``; the next poll takes them."""
        with self._lock:
            had_items = any(self._items.values())
            self._items.setdefault(channel, []).extend(items)
            if items:
                if self._order and self._order[-1][0] == channel:
                    self._order[-1][1] += len(items)
                else:
                    self._order.append([channel, len(items)])
            if not had_items and items:
                self._news.notify_all()  # items now wait

    def put_latest(self, channel: str, value: Any) -> int:
        """Makes ``value`` the channel's latest; returns its number for :meth:`wait_delivered`."""
        with self._lock:
            self._sequence += 1
            self._latest[channel] = (value, time.monotonic(), self._sequence, False)
            self._lock.notify_all()  # a writer waiting for the value this one replaces
            if channel in self._urgent:
                self._news.notify_all()
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

    def wait_news(self, call_id: str, urgent: Collection[str], items_after_s: float) -> bool:
        """Waits until call ``call_id`` has something the driver should ask for now: True at
        once when a channel in ``urgent`` holds a value no poll took yet, or when items wait
        and ``items_after_s`` have passed since this wait began (so a rank that prints all
        the time is asked at most that often this way); False when that call ended, or when
        another call opened the outbox after this wait began (``call_id`` never ran here), or
        at once when ``call_id`` ended before this wait began (a question that came late).
        A wait that begins before its call opens the outbox waits for it."""
        items_from = time.monotonic() + items_after_s
        with self._lock:
            opened = self._opened
            self._urgent = urgent
            if call_id in self._ended:
                return False
            while True:
                if self._call_id != call_id:
                    if self._opened != opened:
                        return False  # another call began: this one will not
                    timeout = None
                else:
                    if any(
                        channel in self._latest and not self._latest[channel][3]
                        for channel in urgent
                    ):
                        return True
                    if not self._running:
                        return False
                    timeout = None
                    if any(self._items.values()):
                        timeout = items_from - time.monotonic()
                        if timeout <= 0:
                            return True
                self._news.wait(timeout)

    def take(self, acknowledged: dict[str, int] | None = None) -> Mail:
        """Answers a poll: the items added and the values put since the previous poll.

        ``acknowledged`` maps channels to the highest value number the driver holds.
        """
        with self._lock:
            for channel, sequence in (acknowledged or {}).items():
                self._acknowledged[channel] = max(self._acknowledged.get(channel, 0), sequence)
            now = time.monotonic()
            items, self._items = self._items, {}
            order, self._order = tuple((c, n) for c, n in self._order), []
            latest, ages, sequences = {}, {}, {}
            for channel, (value, put_at, sequence, taken) in list(self._latest.items()):
                ages[channel] = now - put_at
                if not taken:
                    latest[channel], sequences[channel] = value, sequence
                    self._latest[channel] = (None, put_at, sequence, True)
            self._lock.notify_all()  # a waiting writer checks the acknowledgements
            return Mail(self._call_id, items, latest, ages, sequences, self._running, order)


_outbox = Outbox()


def get_outbox() -> Outbox:
    """Runs on each worker. This worker's outbox (one per process)."""
    return _outbox
