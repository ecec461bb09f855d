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
A call the budget refused asks again while it waits; one stuck on a daemon already seen stalling
may borrow a second burst.
A daemon a call was hedged past is avoided by new calls for a moment (`SlowDaemons`): a stalled
daemon would otherwise take its share of calls, and spend a hedge on each, for as long as it stalls.

A call the stalled daemon had already claimed holds its key (the claim's lock lives in the database
session of the stalled process), so its hedge waits like any duplicate: for that daemon to go on, or
to die, or, where the shard's daemons end stalled claims (`SHARDD_STALLED_CLAIM_MS`), for the
waiting daemon to end that session and run the call itself.
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
#: How often a call whose hedge the budget refused asks again while its primary has not answered (s).
HEDGE_ASK_AGAIN_S = 0.01


class HedgeBudget:
    """How many hedges may still be sent: `ratio` of a token per call that could be hedged, at most
    `HEDGE_BURST` saved, one spent per hedge.

    A hedge past a daemon already seen stalling (`SlowDaemons`) may borrow: the tokens go down to
    `-HEDGE_BURST`, and other hedges wait until the debt is earned back. A stalled daemon
    holds every caller whose call it took in the moment before it was marked (with N callers in a
    closed loop, up to N calls), and those are exactly the calls hedging is for; the borrowing keeps
    the long-run share at `ratio`, with at most two bursts on top."""

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

    def take(self, *, past_a_stall: bool = False) -> bool:
        """Spend a token for a hedge; False when none is left. `past_a_stall`: the hedge leaves a
        daemon marked slow for one that is not, and may borrow."""
        with self._lock:
            floor = 1 - HEDGE_BURST if past_a_stall else 1
            if self._tokens < floor:
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
        if self.stalled(first, second):
            return second, first
        return first, second

    def stalled(self, address: str, other: str) -> bool:
        """Whether `address` is marked slow and `other` is not: a hedge from one to the other leaves
        a daemon seen stalling for one that answers."""
        return bool(self._marked) and self._slow(address) and not self._slow(other)

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
    ask_again_s: float = HEDGE_ASK_AGAIN_S,
) -> tuple[Result, bool]:
    """The first decisive result of `primary` and, if it has not answered after `hedge_after_s`, of
    `hedge()`; and whether it was the hedge's. `hedge()` returns None when the budget says no: it is
    asked again every `ask_again_s` while the primary has not answered (tokens come back as other
    calls are forwarded, and a call stuck on a stalled daemon still needs its hedge). When neither
    is decisive, the last one to end. The attempt that lost, or both when the caller goes away, is
    cancelled (which cancels its call to the daemon)."""
    tasks: dict[asyncio.Future[Result], bool] = {asyncio.ensure_future(primary): False}
    try:
        wait_s = hedge_after_s
        while len(tasks) == 1:
            done, _ = await asyncio.wait(tasks, timeout=wait_s)
            if done:
                break
            second = hedge()
            if second is not None:
                tasks[asyncio.ensure_future(second)] = True
            wait_s = ask_again_s
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


__all__ = ["HEDGE_ASK_AGAIN_S", "HEDGE_BURST", "HedgeBudget", "SlowDaemons", "first_decisive", "with_wait"]
