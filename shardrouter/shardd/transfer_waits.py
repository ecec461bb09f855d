"""Wakes the `GetTransfer` calls that wait for a transfer as soon as its state changes.

A caller that asks `GetTransfer` to wait (`wait_for_completion_ms`) holds a `TransferWaits.watch` on
the transfer while it re-reads it. Whoever commits a transfer's state change signals the watchers:

- in this process, the outbox relay calls `TransferWaits.notify` right after its commit (a
  transfer completed) or after the refund it sent was confirmed (a transfer refunded);
- in the other daemons of the shard (which share its database), the relay's `pg_notify` on
  `TRANSFER_CHANNEL` (`notify_in_transaction`, sent in the transaction that changes the state, so it
  is heard only after the commit) is heard by each daemon's relay listener, which calls `notify`.

A signal only says "read again": the database stays the only truth. A watcher is registered before
its first read and its flag is cleared before each read, so a signal that arrives between a read
and the following wait is kept, never lost. Without a listener (`listening` false: no relay in this
process, or its connection is down) a waiter polls at the short step.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from shardrouter.shardd.db import Connection

#: The channel a committed state change of a transfer notifies, with the transfer's id as payload.
TRANSFER_CHANNEL = "shardrouter_transfer"


class TransferWatch:
    """One waiter's interest in one transfer (from `TransferWaits.watch`)."""

    def __init__(self, waits: TransferWaits, transfer_id: uuid.UUID) -> None:
        self.transfer_id = transfer_id
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


class TransferWaits:
    """The `GetTransfer` calls of one daemon process waiting for transfers, by transfer id.

    Counters (for tests and curiosity): `woken`, waits that ended by a signal; `timed_out`, waits
    that ended at their timeout; `notified`, signals that found at least one watcher.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[uuid.UUID, set[TransferWatch]] = {}
        self._asleep = 0
        self._listening = False
        self.woken = 0
        self.timed_out = 0
        self.notified = 0

    @property
    def listening(self) -> bool:
        """Whether a listener in this process hears `TRANSFER_CHANNEL` now."""
        return self._listening

    def set_listening(self, listening: bool) -> None:
        """Called by the relay's listener when its `LISTEN` starts or its connection is lost."""
        self._listening = listening

    @property
    def asleep(self) -> int:
        """How many waiters are blocked in `TransferWatch.wait` right now."""
        return self._asleep

    @contextmanager
    def watch(self, transfer_id: uuid.UUID) -> Iterator[TransferWatch]:
        """Register interest in a transfer for the duration of the block (before the first read)."""
        watcher = TransferWatch(self, transfer_id)
        with self._lock:
            self._watchers.setdefault(transfer_id, set()).add(watcher)
        try:
            yield watcher
        finally:
            with self._lock:
                others = self._watchers.get(transfer_id)
                if others is not None:
                    others.discard(watcher)
                    if not others:
                        del self._watchers[transfer_id]

    def notify(self, transfer_ids: Iterable[uuid.UUID]) -> None:
        """A committed state change of these transfers: wake everyone waiting for one of them."""
        with self._lock:
            for transfer_id in transfer_ids:
                watchers = self._watchers.get(transfer_id)
                if not watchers:
                    continue
                self.notified += 1
                for watcher in watchers:
                    watcher._wake()

    def notify_payload(self, payload: str) -> None:
        """A `TRANSFER_CHANNEL` notification heard by a listener (its payload is a transfer id)."""
        try:
            transfer_id = uuid.UUID(payload)
        except ValueError:
            return  # not ours to understand: nobody waits for it
        self.notify([transfer_id])

    def _sleeping(self, delta: int) -> None:
        with self._lock:
            self._asleep += delta

    def _count(self, woken: bool) -> None:
        with self._lock:
            if woken:
                self.woken += 1
            else:
                self.timed_out += 1


def notify_in_transaction(conn: Connection, transfer_ids: list[uuid.UUID]) -> None:
    """Queue `pg_notify(TRANSFER_CHANNEL, id)` for each transfer, in the connection's transaction
    (one statement): the other daemons of the shard hear it when, and only if, it commits."""
    if transfer_ids:
        conn.execute(
            "SELECT pg_notify(%s, t) FROM unnest(%s::text[]) AS t",
            (TRANSFER_CHANNEL, [str(t) for t in transfer_ids]),
        )


__all__ = ["TRANSFER_CHANNEL", "TransferWaits", "TransferWatch", "notify_in_transaction"]
