"""What this daemon process knows about keys without asking the database.

Two answers need no database round trip, no pool connection and no admission slot:
- a duplicate of a key that a worker thread of this process is working on right now joins that
  call's flight (`KeyFlights`): if the key turns out completed it gets the same record (one database
  read for any number of concurrent replays); if the first call claimed it, the duplicate is in flight
  and answered ABORTED at once, however many duplicates arrive;
- a key this process completed (or replayed) recently has an immutable outcome (`CompletedKeys`):
  answered from memory, byte for byte the stored one.

A duplicate that waits for its original (`waiting`) asks every daemon of the shard to tell it when the
original ends; `KeyFlights.answer_wait_request` and `KeyFlights.land` decide, under the flights' one
lock, who tells it (the argument that no wake-up is lost is in `waiting`'s docstring).

Neither decides anything the database would decide differently: the database still settles every
claim, between processes too. A completed record never changes until its partition is dropped, and
the interceptor refuses a key older than the retention window before it looks here, so a cached
outcome is never stale.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from shardrouter.shardd.idempotency.record import IdempotencyRecord

ScopedKey = tuple[str, str]  # (scope, key)

__all__ = ["CompletedKeys", "KeyFlight", "KeyFlights", "ScopedKey"]


class KeyFlight:
    """One call's work on a key, as its duplicates in this process see it.

    Most flights never have a duplicate, so the event a duplicate waits on is made only when one
    joins (under the flights' lock, which also guards the settled flag, so no wake-up is missed).
    """

    __slots__ = ("_event", "_lock", "_settled", "claimed", "record", "waited")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._event: threading.Event | None = None
        self._settled = False
        #: A duplicate somewhere in the shard waits for this call to end (set under the flights' lock).
        self.waited = False
        #: The call claimed the key: it is the key's original, whose end changes what a duplicate finds.
        self.claimed = False
        #: The key's completed record, once this call has seen or made it.
        self.record: IdempotencyRecord | None = None

    def mark_claimed(self) -> None:
        """The call claimed the key; its duplicates need not wait any longer."""
        self.claimed = True
        self._settle()

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until the call claimed the key or ended; False on time-out."""
        event = self._event
        assert event is not None, "only a duplicate that joined the flight waits for it"
        return event.wait(timeout_s)

    def _follow(self) -> None:
        """A duplicate joins (called under the flights' lock): it will wait on the event."""
        if self._event is None:
            self._event = threading.Event()
            if self._settled:
                self._event.set()

    def _settle(self) -> None:
        with self._lock:
            self._settled = True
            event = self._event
        if event is not None:
            event.set()

    def _end(self, record: IdempotencyRecord | None) -> None:
        self.record = record
        self._settle()


#: How many ended flights a process remembers for the wait requests that arrive after the end.
ENDED_KEPT = 4096


class KeyFlights:
    """The keys this process's worker threads are working on, each led by one call, and the last
    `ENDED_KEPT` keys whose flight ended here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[ScopedKey, KeyFlight] = {}
        self._ended: OrderedDict[ScopedKey, None] = OrderedDict()

    def join(self, scoped: ScopedKey) -> tuple[KeyFlight, bool]:
        """The flight of `scoped`, and whether the caller leads it (no other call was on the key)."""
        with self._lock:
            flight = self._flights.get(scoped)
            if flight is not None:
                flight._follow()
                return flight, False
            flight = self._flights[scoped] = KeyFlight(self._lock)
            return flight, True

    def land(self, scoped: ScopedKey, flight: KeyFlight, record: IdempotencyRecord | None) -> bool:
        """The leading call of `flight` ended (after its commit, if it made one), with the key's
        completed record if it has one; whether a duplicate waits to be told.

        Only a flight that claimed the key or saw its record ends something a waiter cares about; a
        flight that found the key in flight elsewhere (a waiter's own look, say) changes nothing."""
        decisive = flight.claimed or record is not None
        with self._lock:
            if self._flights.get(scoped) is flight:
                del self._flights[scoped]
            if decisive:
                ended = self._ended
                ended[scoped] = None
                ended.move_to_end(scoped)
                if len(ended) > ENDED_KEPT:
                    ended.popitem(last=False)
            waited = flight.waited and decisive
        flight._end(record)
        return waited

    def answer_wait_request(self, scoped: ScopedKey, completed: CompletedKeys) -> bool:
        """A duplicate somewhere asks to be told when `scoped`'s original ends: True if a flight that
        claimed the key or saw its record has ended here (tell it now); a flight here is marked to
        tell it when it lands (False); a key this process knows nothing of is not its to answer."""
        with self._lock:
            flight = self._flights.get(scoped)
            if flight is not None:
                flight.waited = True
                return False
            if self._ended.pop(scoped, 0) is None:
                # Forgotten once told: a retry that claimed the key elsewhere since must not be
                # answered "ended" again (a waiter would spin), and a request sent after this
                # answer reads after the end anyway.
                return True
            return completed.get(scoped) is not None

    def __len__(self) -> int:
        return len(self._flights)


@dataclass(frozen=True)
class _Entry:
    record: IdempotencyRecord
    size: int


class CompletedKeys:
    """A bounded LRU of completed records, by entries and by bytes of stored responses and details."""

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must not be negative")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[ScopedKey, _Entry] = OrderedDict()
        self._bytes = 0

    def get(self, scoped: ScopedKey) -> IdempotencyRecord | None:
        """The completed record of `scoped`, if this process has it."""
        with self._lock:
            entry = self._entries.get(scoped)
            if entry is None:
                return None
            self._entries.move_to_end(scoped)
            return entry.record

    def put(self, scoped: ScopedKey, record: IdempotencyRecord) -> None:
        """Remember a completed record (an in-progress one is never cached)."""
        assert record.outcome is not None, "only completed records are cached"
        size = _size_of(record)
        if self.max_entries == 0 or size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(scoped, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[scoped] = _Entry(record, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes held, as counted for `max_bytes`."""
        return self._bytes


def _size_of(record: IdempotencyRecord) -> int:
    outcome = record.outcome
    assert outcome is not None
    trailers = sum(len(k) + len(v) for k, v in outcome.trailers)
    # A fixed 512 for the record's own fields and the dictionary's bookkeeping.
    return 512 + len(outcome.response or b"") + len(outcome.details or b"") + len(outcome.message) + trailers
