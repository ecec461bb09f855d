"""A duplicate that asked to wait for its key's original in flight, and returns its stored outcome.

By default a duplicate that finds its key in flight is answered at once (ABORTED + RetryInfo; 409 +
Retry-After over HTTP). A call that sends `idempotency-wait-ms: N` (HTTP `Prefer: wait=N`, in
seconds, which the router's front maps to it) may instead wait, at most the least of N, the call's
remaining deadline (less a margin to answer in) and the daemon's `max_duplicate_wait_ms`, and then:

- the original committed (in this daemon or any other of the shard): its stored outcome, replayed
  byte for byte with the replay marker, as any replay;
- the original ended without storing an outcome (its handler failed, its process was killed: the
  session advisory lock that was its claim went away): the waiter claims the key and runs the
  handler itself, once, as any first attempt;
- neither within the bound: today's answer, ABORTED in flight.

A look the shard's admission sheds while the call waits (the shard full, or the caller over its
share) ends nothing: the call looks again at its next wake-up, within the same bound.

`WaitForOriginal` is the first step of the chain (before `answer_from_memory`). It holds no database
connection and no admission slot while it sleeps: each look is the whole chain again, which takes
and returns both.

Woken by the end, not by polling, and at no cost to a call nobody waits for: the original's commit
sends nothing, since a `pg_notify` in every guarded commit would serialise the shard's commits
(PostgreSQL takes a global lock for a transaction that notified). Instead:

    waiter   W: register a local watch on the key -> pg_notify(WAIT_CHANNEL, key) (autocommit, its
                connection returned at once) -> the chain again (a record now there: replay it; the
                key free: claim it) -> sleep on the watch until signalled, a backstop step or the
                bound -> again.
    listener of every daemon process, on a wait request, under the `KeyFlights` lock: a flight of
                the key here is marked "waited"; a flight that claimed the key (or saw its record)
                ended here, or the key's record is in `CompletedKeys`: pg_notify(DONE_CHANNEL, key)
                now; else nothing (the key is not this process's).
    original O: when its flight lands (after its commit, or its rollback), under the same lock: if
                marked, pg_notify(DONE_CHANNEL, key).
    listener of every daemon process, on a done notification: wakes the local watches of the key.

No wake-up is lost. W's watch exists before W sends its request R, and its flag is cleared before
each look, so any done notification sent after R was sent wakes W, however it races with W's look.
The listener of O's process handles R (in the order notifications commit) either before O's flight
lands or after: both under the `KeyFlights` lock, and O's flight leaves the flights in the same
critical section that reads its mark. Before: the flight is marked, and its landing, which follows
O's commit or rollback, sends the done notification. After: the listener finds the ended flight
(or the key's record) and sends the done notification itself. Either way a done notification is
sent after R, or W's look, which starts after R was sent, starts after O's end and sees it: the
record (a replay), or a free key (W claims it).

What the notifications cannot tell, a backstop step covers (`BACKSTOP_S`): an original whose process
died without a word (SIGKILL: its session's lock is gone, nobody says so), a listener that was down
or that lagged by more than `process_keys.ENDED_KEPT` ended flights, and a process that has no
listener at all (it looks every `POLL_S` instead).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

from shardrouter.core import tracing
from shardrouter.core.errors import Aborted, InvalidArgument, Reason, ShardRouterError
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency import store
from shardrouter.shardd.idempotency.call import Answered, CallStep, GuardedCall
from shardrouter.shardd.idempotency.outcomes import OutcomeKind
from shardrouter.shardd.idempotency.process_keys import CompletedKeys, KeyFlights, ScopedKey
from shardrouter.shardd.listener import ShardListener
from shardrouter.shardd.waits import Waits

log = logging.getLogger(__name__)

#: A waiting duplicate asks every daemon process of the shard to tell it when its key's original
#: ends; the payload is the scoped key (`payload_of`).
WAIT_CHANNEL = "shardrouter_key_wait"
#: A key's original, marked as waited for, ended (committed, refused, or failed without a record).
DONE_CHANNEL = "shardrouter_key_done"
#: Longest sleep between looks while a listener hears the shard (s): for an original that died
#: without a word, or a notification the listener missed.
BACKSTOP_S = 1.0
#: Longest sleep between looks in a process with no listener (s).
POLL_S = 0.05
#: How many times per `stalled_claim_s` a waiter looks for its original's session stalled: a claim
#: stalled past the threshold is ended within a quarter of it.
STALLED_LOOKS = 4
#: Kept of the call's deadline to answer in, when the deadline bounds the wait (s).
ANSWER_MARGIN_S = 0.1
#: grpc reports "no deadline" as an enormous time remaining.
_NO_DEADLINE_S = 24 * 3600
#: Digits of an `idempotency-wait-ms` value beyond which it is surely over any maximum.
_MAX_DIGITS = 18


class WaitEnd(StrEnum):
    """How a duplicate's wait ended (the `idempotency.wait.end` span attribute and the counters)."""

    REPLAYED = "replayed"  # the original committed: its stored outcome
    RAN_ITSELF = "ran_itself"  # the original ended without an outcome: this call claimed the key
    BOUND_REACHED = "bound_reached"  # still in flight at the bound: ABORTED, as without waiting
    REFUSED = "refused"  # another answer (the key reused for another request, shed, a failure)


def read_wait(metadata: Sequence[tuple[str, str | bytes]], max_wait_ms: int) -> int:
    """The wait the call asks for (ms), capped at `max_wait_ms`; 0 when it asks none.

    INVALID_ARGUMENT (before any claim, never stored) for a value that is not a non-negative whole
    number of milliseconds, or for the entry sent twice. A larger ask than the maximum is capped, and
    the answer's `idempotency-wait-applied-ms` trailer says what was granted."""
    values = [v for k, v in metadata if k == WAIT_METADATA]
    if not values:
        return 0
    if len(values) > 1:
        raise InvalidArgument(
            f"the {WAIT_METADATA} metadata entry was sent {len(values)} times; send it at most once",
            reason=Reason.INVALID_REQUEST,
        )
    value = values[0]
    if not isinstance(value, str) or not value.isascii() or not value.isdigit():
        shown = value[:40] if isinstance(value, str) else "binary"
        raise InvalidArgument(
            f"{WAIT_METADATA} must be a whole number of milliseconds, 0 or more (got {shown!r}): how long "
            "a duplicate may wait for its original in flight to end",
            reason=Reason.INVALID_REQUEST,
        )
    if len(value) > _MAX_DIGITS:
        return max_wait_ms
    return min(int(value), max_wait_ms)


def payload_of(scoped: ScopedKey) -> str:
    """The notification payload naming a scoped key (JSON: scope and key hold any printable text)."""
    return json.dumps(scoped, separators=(",", ":"))


def scoped_of(payload: str) -> ScopedKey | None:
    """The scoped key a payload names; None for a payload not ours."""
    try:
        scope, key = json.loads(payload)
    except (ValueError, TypeError):
        return None
    if not isinstance(scope, str) or not isinstance(key, str):
        return None
    return (scope, key)


class KeyWaits:
    """One daemon process's side of waiting: its waiters' watches, the wait requests it answers for
    its flights, and the done notifications it sends and hears.

    Counters: `waits`, duplicates that started waiting; `ends`, how their waits ended (`WaitEnd`);
    `requests_sent`, `done_sent`, the notifications this process sent."""

    def __init__(
        self,
        database: Database,
        flights: KeyFlights,
        completed: CompletedKeys,
        *,
        stalled_claim_s: float = 0.0,
    ) -> None:
        self._database = database
        #: Past this wait on its own daemon (s), an original's session is ended by a waiter; 0: never.
        self.stalled_claim_s = stalled_claim_s
        self.claims_ended = 0
        self._flights = flights
        self._completed = completed
        self.watches: Waits[ScopedKey] = Waits()
        self.waits = 0
        self.ends: Counter[WaitEnd] = Counter()
        self.requests_sent = 0
        self.done_sent = 0

    def subscribe(self, listener: ShardListener) -> None:
        """Hear wait requests and done notifications through the process's listener."""
        listener.subscribe(WAIT_CHANNEL, self.on_wait_request)
        listener.subscribe(DONE_CHANNEL, self.on_done)
        listener.on_connection(self.watches.set_listening)

    @property
    def listening(self) -> bool:
        """Whether this process hears the shard's notifications now."""
        return self.watches.listening

    def request(self, scoped: ScopedKey) -> None:
        """Ask every daemon process of the shard to tell this one when `scoped`'s original ends."""
        if self._notify(WAIT_CHANNEL, scoped):
            self.requests_sent += 1

    def announce(self, scoped: ScopedKey) -> None:
        """`scoped`'s original, waited for, ended here (after its commit): tell the waiters."""
        if self._notify(DONE_CHANNEL, scoped):
            self.done_sent += 1

    def on_wait_request(self, payload: str) -> None:
        """The listener heard a wait request (the lock ordering is in the module's docstring)."""
        scoped = scoped_of(payload)
        if scoped is not None and self._flights.answer_wait_request(scoped, self._completed):
            self.announce(scoped)

    def on_done(self, payload: str) -> None:
        """The listener heard that a waited-for original ended: wake this process's waiters."""
        scoped = scoped_of(payload)
        if scoped is not None:
            self.watches.notify([scoped])

    def end_stalled_claim(self, scoped: ScopedKey) -> bool:
        """End the session holding `scoped`'s claim if it has waited on its own daemon for longer than
        `stalled_claim_s`: True when one was told to end (its transaction rolls back, its key and row
        locks go with the session). A failure to look is False: the waiter goes on waiting."""
        try:
            with tracing.untraced(), self._database.connection() as conn:
                ended = store.end_stalled_claim(
                    conn, scope=scoped[0], key=scoped[1], stalled_ms=int(self.stalled_claim_s * 1000)
                )
        except Exception as exc:
            log.info("a stalled claim could not be looked for: %s", exc)
            return False
        if ended:
            self.claims_ended += 1
            log.warning(
                "ended the session of a claim stalled on its daemon for over %.2f s", self.stalled_claim_s
            )
        return ended

    def started(self) -> None:
        """A duplicate started waiting."""
        self.waits += 1

    def ended(self, end: WaitEnd) -> None:
        """A duplicate's wait ended so."""
        self.ends[end] += 1

    def _notify(self, channel: str, scoped: ScopedKey) -> bool:
        """pg_notify on a pool connection (autocommit: sent at once, the connection returned at once);
        False if it could not be sent (the backstop step covers it)."""
        try:
            with tracing.untraced(), self._database.connection() as conn:
                conn.execute("SELECT pg_notify(%s, %s)", (channel, payload_of(scoped)))
        except Exception as exc:  # never fails the call: the waiter still looks at its backstop step
            log.info("%s notification for a waited key not sent: %s", channel, exc)
            return False
        return True


def wait_bound_s(call: GuardedCall) -> float:
    """How long the call may wait (s): its granted wait, within its deadline less `ANSWER_MARGIN_S`."""
    bound = call.wait_ms / 1000
    remaining = call.context.time_remaining()
    if remaining is not None and remaining < _NO_DEADLINE_S:
        bound = min(bound, remaining - ANSWER_MARGIN_S)
    return bound


def _waits_out(error: Aborted) -> bool:
    return error.reason == Reason.IDEMPOTENCY_KEY_IN_FLIGHT


#: What the shard's admission answers a look it cannot make now (full, or the caller over its share).
_SHED_REASONS = frozenset({Reason.SHARD_SATURATED, Reason.RATE_LIMITED})


class WaitForOriginal:
    """wait_for_original: a duplicate in flight that asked to wait looks again (the whole chain)
    whenever its original may have ended, until it gets another answer or reaches its bound."""

    __slots__ = ("_next", "_waits")

    def __init__(self, next_step: CallStep, waits: KeyWaits) -> None:
        self._next = next_step
        self._waits = waits

    def __call__(self, call: GuardedCall) -> Answered:
        """The next step's answer, waited for when the call asked and its key is in flight."""
        try:
            return self._next(call)
        except Aborted as error:
            if call.wait_ms <= 0 or not _waits_out(error):
                raise
            bound_s = wait_bound_s(call)
            if bound_s <= 0:
                raise
            return self._wait(call, bound_s, error)

    def _wait(self, call: GuardedCall, bound_s: float, in_flight: Aborted) -> Answered:
        waits, span, scoped = self._waits, call.span, call.scoped_key
        started = time.monotonic()
        deadline = started + bound_s
        span.set_attribute("idempotency.wait.bound_ms", int(bound_s * 1000))
        waits.started()
        end = WaitEnd.REFUSED
        try:
            with waits.watches.watch(scoped) as watch:
                while True:
                    watch.before_read()  # a done notification from here on is kept for the sleep
                    waits.request(scoped)
                    try:
                        answered = self._next(call)
                    except Aborted as error:
                        if not _waits_out(error):
                            raise
                        in_flight = error
                    except ShardRouterError as error:
                        # A look the full shard shed: the wait holds no slot, so the next look, at
                        # the next wake-up, may be admitted. Past the bound: in flight, as before.
                        if error.reason not in _SHED_REASONS:
                            raise
                    else:
                        end = WaitEnd.REPLAYED if answered[1] is OutcomeKind.REPLAY else WaitEnd.RAN_ITSELF
                        return answered
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        end = WaitEnd.BOUND_REACHED
                        raise in_flight
                    step = BACKSTOP_S if waits.listening else POLL_S
                    if waits.stalled_claim_s > 0:
                        if waits.end_stalled_claim(scoped):
                            continue  # its session has exited: the key is free, look again now
                        # Not stalled long enough yet: look a few times per threshold.
                        step = min(step, waits.stalled_claim_s / STALLED_LOOKS)
                    watch.wait(min(step, remaining))
        finally:
            waits.ended(end)
            span.set_attribute("idempotency.wait.end", end.value)
            span.set_attribute("idempotency.wait.ms", int((time.monotonic() - started) * 1000))


__all__ = [
    "BACKSTOP_S",
    "DONE_CHANNEL",
    "POLL_S",
    "WAIT_CHANNEL",
    "KeyWaits",
    "WaitEnd",
    "WaitForOriginal",
    "payload_of",
    "read_wait",
    "scoped_of",
    "wait_bound_s",
]
