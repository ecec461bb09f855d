"""Signals that wake the threads of this process waiting for something a commit decides.

One pattern for every such wait (a `GetTransfer` that waits for its transfer, a duplicate that
waits for its key's original): a waiter registers a `Watch` on a key before its first read, clears
the watch's flag before each read (`before_read`), reads, and sleeps on the watch (`wait`) until a
signal or its own step. Whoever learns of a commit (this process after its own commit, or a
`LISTEN`er hearing another daemon's `pg_notify`) calls `Waits.notify` for the key.

A signal only says "read again": the database stays the only truth. Because the flag is cleared
before each read and set by a signal at any later time, a signal that arrives between a read and the
following wait is kept, never lost. Without a listener (`listening` false) waiters poll at a short
step, since nothing would tell them of another daemon's commit.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Watch(Generic[K]):
    """One waiter's interest in one key (from `Waits.watch`)."""

    def __init__(self, waits: Waits[K], key: K) -> None:
        self.key = key
        self._waits = waits
        self._signal = threading.Event()

    def before_read(self) -> None:
        """Forget earlier signals: call right before each read (a later signal is kept for `wait`)."""
        self._signal.clear()

    def wait(self, timeout_s: float) -> bool:
        """Block until a signal since `before_read`, or `timeout_s`; True if signalled."""
        self._waits._sleeping(+1)
        try:
            woken = self._signal.wait(max(0.0, timeout_s))
        finally:
            self._waits._sleeping(-1)
        self._waits._count(woken)
        return woken

    def interrupt(self) -> None:
        """Wake this waiter only (its call ended): it reads once more and sees why."""
        self._signal.set()

    def _wake(self) -> None:
        self._signal.set()


class Waits(Generic[K]):
    """The waiters of one process, by key.

    Counters (for tests and curiosity): `woken`, waits that ended by a signal; `timed_out`, waits
    that ended at their timeout; `notified`, signals that found at least one watcher.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[K, set[Watch[K]]] = {}
        self._asleep = 0
        self._listening = False
        self.woken = 0
        self.timed_out = 0
        self.notified = 0

    @property
    def listening(self) -> bool:
        """Whether a listener in this process hears the other daemons' notifications now."""
        return self._listening

    def set_listening(self, listening: bool) -> None:
        """Called by the listener when its `LISTEN` starts or its connection is lost."""
        self._listening = listening

    @property
    def asleep(self) -> int:
        """How many waiters are blocked in `Watch.wait` right now."""
        return self._asleep

    def watching(self, key: K) -> bool:
        """Whether anyone in this process watches `key` now."""
        with self._lock:
            return key in self._watchers

    @contextmanager
    def watch(self, key: K) -> Iterator[Watch[K]]:
        """Register interest in `key` for the duration of the block (before the first read)."""
        watcher = Watch(self, key)
        with self._lock:
            self._watchers.setdefault(key, set()).add(watcher)
        try:
            yield watcher
        finally:
            with self._lock:
                others = self._watchers.get(key)
                if others is not None:
                    others.discard(watcher)
                    if not others:
                        del self._watchers[key]

    def notify(self, keys: Iterable[K]) -> None:
        """A commit decided these keys: wake everyone waiting for one of them."""
        with self._lock:
            for key in keys:
                watchers = self._watchers.get(key)
                if not watchers:
                    continue
                self.notified += 1
                for watcher in watchers:
                    watcher._wake()

    def _sleeping(self, delta: int) -> None:
        with self._lock:
            self._asleep += delta

    def _count(self, woken: bool) -> None:
        with self._lock:
            if woken:
                self.woken += 1
            else:
                self.timed_out += 1


__all__ = ["Waits", "Watch"]
