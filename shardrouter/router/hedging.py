"""Hedged forwarding: a keyed call or a read whose daemon is slow to answer also goes to the next
daemon of the same shard, and the first decisive answer is the caller's.

What makes a hedged write safe is the idempotency key: both attempts carry it, so the shard applies
the call once whichever daemon claims it. The second attempt also carries the wait preference
(`WAIT_METADATA`, as long as the call's deadline allows): a daemon that finds its twin in flight
waits for the twin's outcome and replays it, instead of answering "in flight" at once. Reads have
nothing to apply. A mutating call without a key is never hedged.

A hedge is sent only after `hedge_after_s` without an answer, and only while the budget allows: a
token bucket in the manner of gRPC's retry throttling, earning `ratio` of a token per hedgeable
call, so a shard that is slow for everyone (not one stalled daemon) cannot double the router's load.
A daemon a call was hedged past is avoided by new calls for a moment (`SlowDaemons`): a stalled
daemon would otherwise take its share of calls, and spend a hedge on each, for as long as it stalls.

What hedging cannot do: a call the stalled daemon had already claimed holds its key (the claim's
lock lives in the database session of the stalled process), so its hedge waits for that daemon to
go on, or to die, like any duplicate. Hedging helps the calls the stalled daemon had not claimed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from shardrouter.core.wire_names import WAIT_METADATA

Result = TypeVar("Result")

#: Most hedges the budget lets through in a burst.
HEDGE_BURST = 10.0


class HedgeBudget:
    """How many hedges may still be sent: `ratio` of a token per call that could be hedged, at most
    `HEDGE_BURST` saved, one spent per hedge."""

    def __init__(self, ratio: float) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError("the hedge budget is a share of calls, between 0 and 1")
        self._ratio = ratio
        self._tokens = HEDGE_BURST
        self._lock = threading.Lock()

    def earn(self) -> None:
        """One call that could be hedged was forwarded."""
        with self._lock:
            self._tokens = min(HEDGE_BURST, self._tokens + self._ratio)

    def take(self) -> bool:
        """Spend a token for a hedge; False when none is left."""
        with self._lock:
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True


class SlowDaemons:
    """Daemons a call was just hedged past: new calls of their shard start at another daemon for
    `avoid_s`, or until one of their calls is answered, so a stalled daemon does not spend the
    budget on every call that would have gone to it. Past `avoid_s` it gets calls again (one that
    stalls marks it again), so a daemon is never left out for good."""

    def __init__(self, avoid_s: float) -> None:
        self._avoid_s = avoid_s
        self._marked: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, address: str) -> None:
        """A call at `address` was hedged: it did not answer in time."""
        with self._lock:
            self._marked[address] = time.monotonic()

    def answered(self, address: str) -> None:
        """`address` answered a call."""
        if address in self._marked:
            with self._lock:
                self._marked.pop(address, None)

    def order(self, addresses: Sequence[str], turn: int) -> tuple[str, str]:
        """The daemons a call of this `turn` tries first and hedges at: its turn's, unless that one is
        marked slow and the next is not."""
        first, second = addresses[turn % len(addresses)], addresses[(turn + 1) % len(addresses)]
        if self._marked and self._slow(first) and not self._slow(second):
            return second, first
        return first, second

    def _slow(self, address: str) -> bool:
        marked = self._marked.get(address)
        return marked is not None and time.monotonic() - marked < self._avoid_s


def with_wait(
    metadata: tuple[tuple[str, str | bytes], ...], wait_ms: int
) -> tuple[tuple[str, str | bytes], ...]:
    """`metadata` asking the daemon to wait up to `wait_ms` for a twin in flight, unless the caller
    already said how long (its choice stands)."""
    if wait_ms <= 0 or any(key == WAIT_METADATA for key, _ in metadata):
        return metadata
    return (*metadata, (WAIT_METADATA, str(wait_ms)))


async def first_decisive(
    primary: Awaitable[Result],
    hedge: Callable[[], Awaitable[Result] | None],
    *,
    hedge_after_s: float,
    decisive: Callable[[Result], bool],
) -> tuple[Result, bool]:
    """The first decisive result of `primary` and, if it has not answered after `hedge_after_s`, of
    `hedge()` (None: no hedge, the budget said no); and whether it was the hedge's. When neither is
    decisive, the last one to end. The attempt that lost, or both when the caller goes away, is
    cancelled (which cancels its call to the daemon)."""
    tasks: dict[asyncio.Future[Result], bool] = {asyncio.ensure_future(primary): False}
    try:
        done, _ = await asyncio.wait(tasks, timeout=hedge_after_s)
        if not done:
            second = hedge()
            if second is not None:
                tasks[asyncio.ensure_future(second)] = True
        pending = set(tasks)
        last: tuple[Result, bool] | None = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                result = task.result()
                if decisive(result):
                    return result, tasks[task]
                last = (result, tasks[task])
        assert last is not None
        return last
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


__all__ = ["HEDGE_BURST", "HedgeBudget", "SlowDaemons", "first_decisive", "with_wait"]
