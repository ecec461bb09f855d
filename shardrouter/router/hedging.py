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

What hedging cannot do: a call the stalled daemon had already claimed holds its key (the claim's
lock lives in the database session of the stalled process), so its hedge waits for that daemon to
go on, or to die, like any duplicate. Hedging helps the calls the stalled daemon had not claimed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
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


__all__ = ["HEDGE_BURST", "HedgeBudget", "first_decisive", "with_wait"]
