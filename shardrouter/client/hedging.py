"""Hedged keyed calls: a second attempt of a slow one, under the same key, so it cannot apply twice.

When a keyed call has not been answered after a delay (e.g. the p95 of its latency), a hedged send
sends the same request again, with the same idempotency key, to the same target or another one (a
second daemon of the shard, where the caller can name it); whichever answers first is the answer,
and the other attempt is cancelled. Both attempts ask the shard to wait for each other
(`idempotency-wait-ms`, as long as an attempt's deadline): the one that lands second finds the key in
flight and waits for the first one's outcome instead of being answered ABORTED, or, if the first one
never started its work (its daemon stalled before claiming the key), claims the key and runs. The key
makes the pair safe: the shard applies the operation once, whichever attempt ran it.

`Race` collects the answers of attempts in flight at once, in the order they arrive.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = ["Hedge", "Race"]


@dataclass(frozen=True, slots=True)
class Hedge:
    """When and where a hedged send sends its second attempt."""

    #: Seconds without an answer to the first attempt before the second is sent.
    after_s: float
    #: Where the second attempt goes (None: the client's own channel, where the router may choose
    #: another daemon of the shard).
    channel: grpc.Channel | None = None

    def __post_init__(self) -> None:
        if self.after_s < 0:
            raise ValueError("after_s must not be negative")


class Race:
    """Attempts in flight at once (grpc futures), and their answers in the order they arrive."""

    def __init__(self) -> None:
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.futures: list[grpc.Future[Any]] = []

    def add(self, future: grpc.Future[Any]) -> int:
        """Follow one more attempt; its index."""
        index = len(self.futures)
        self.futures.append(future)
        future.add_done_callback(lambda _: self._done.put(index))
        return index

    def next(self, timeout_s: float | None = None) -> int | None:
        """The index of the next attempt that ended, or None if none ends within `timeout_s`."""
        try:
            return self._done.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def cancel_all_but(self, winner: int) -> list[int]:
        """Cancel every attempt still in flight but `winner`; the indices cancelled."""
        cancelled = []
        for index, future in enumerate(self.futures):
            if index != winner and future.cancel():
                cancelled.append(index)
        return cancelled
