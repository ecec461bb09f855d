"""The router's one RPC handler: forward a call's bytes to the owning shard and relay its answer.

Per call: read the routing account from a decoded copy of the request -> pick the shard from the
current map -> send the caller's original bytes with the caller's metadata and remaining deadline ->
return the shard's response bytes, status, message, details and trailers untouched.

The router has no state to protect, so its only decisions are about reaching the shard. A call the
shard answered is passed through as is, with one exception below. A call that never reached the shard
is the router's own UNAVAILABLE (SHARD_UNAVAILABLE, with RetryInfo); it is retried here first, but
only when it carries an idempotency key, because only then does the shard make a repeat harmless.
So is a call a daemon cut off before answering (CANCELLED without our details: a daemon stopping
past its grace period), keyed calls and reads only, since it may have committed.

The exception: a shard that does not serve the account answers before anything is applied,
UNAVAILABLE with reason ACCOUNT_MOVED (another shard owns it in the daemon's map) or SLOT_RANGE_MOVING
(its slot range is cutting over to another shard). Resending such a call is safe, keyed or not. The
router re-reads its shard map file at once and sends the same bytes and metadata to the owner in the
newest map it knows of - its own, or the refusing daemon's when that one has a higher version - at
most MAX_REDIRECTS times per call, so daemons whose maps disagree cannot bounce a call for ever.
While a cut-over runs and no other owner is known, it waits in short steps, re-reading the map and
resending, for at most `RouterSettings.move_wait_s` and within the call's deadline. When none of this
helps, the shard's answer goes to the caller unchanged.

The handler is a `grpc.aio` coroutine and the shard call goes out on a `grpc.aio` channel: a call
waiting for its shard is a suspended coroutine, not a blocked worker thread. Measured with
`python -m bench.forwarding` (unary GetBalance to a loopback echo shard, 32 calls in
flight): a sync `grpc.server` + sync-channel forwarder did ~1,100 rps, this asyncio one ~1,550 rps
(+40%). A caller's cancellation (or expired deadline) cancels the handler's task, and with it the
shard call it is awaiting.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import grpc
import grpc.aio
from opentelemetry import trace

from shardrouter.core.channels import has_our_error_info, our_error_info, unreached
from shardrouter.core.errors import (
    Internal,
    Reason,
    ShardRouterError,
    Unavailable,
)
from shardrouter.core.keys import KEY_METADATA
from shardrouter.core.ownership import OWNER_KEY, VERSION_KEY, LearnedOwners, RangeOwner, owner_of_slot
from shardrouter.core.rpcs import RpcDeclaration
from shardrouter.core.shardmap import Shard, ShardMap
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.core.status import abort_with_error_async
from shardrouter.core.wire import DETAILS_TRAILER
from shardrouter.router.channels import ChannelPool
from shardrouter.router.hedging import HedgeBudget, SlowDaemons, first_decisive, with_wait
from shardrouter.router.metadata import CallContext, CallerPolicy, MetadataEntry, forwardable
from shardrouter.router.metrics import GRPC, HTTP, CallRecord, RouterMetrics
from shardrouter.router.routing import METHODS_BY_PATH, routing_account
from shardrouter.router.tracing import record_forwarded_status, record_move, router_span

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    from shardrouter.router.metadata import ServicerContext

    _GenericHandler = grpc.GenericRpcHandler[bytes, bytes]
else:
    _GenericHandler = grpc.GenericRpcHandler

log = logging.getLogger(__name__)

#: RetryInfo delay the router advises when a shard cannot be reached.
SHARD_UNAVAILABLE_RETRY_MS = 500
#: First backoff between attempts to reach a shard; doubled per attempt, with jitter.
RETRY_BACKOFF_S = 0.05
#: Most redirects of one call to another shard: two daemons whose maps disagree cannot bounce it for ever.
MAX_REDIRECTS = 4
#: Pause between two looks at a cut-over that has not ended (s): then the map is re-read and the call resent.
MOVE_WAIT_STEP_S = 0.025
#: Least deadline a resend after such a pause must still have (s); with less, the refusal is answered.
MOVE_RESEND_MIN_S = 0.05
#: Longest a call waits for a re-read of the shard map file (s): a stalled volume must not hold calls.
MAP_RECHECK_TIMEOUT_S = 0.25
#: How long new calls avoid a daemon a call was hedged past (s; at least ten hedge delays).
SLOW_DAEMON_AVOID_S = 0.5
#: What a hedge's wait for its twin leaves of the call's deadline (s), to send the answer back.
HEDGE_ANSWER_MARGIN_S = 0.1
#: Refusals meaning "not served here, nothing applied": another shard owns, or is taking over, the account.
MOVE_REASONS = frozenset({Reason.ACCOUNT_MOVED, Reason.SLOT_RANGE_MOVING})


@dataclass(frozen=True)
class Outcome:
    """How the shard's call ended: everything the caller gets back."""

    code: grpc.StatusCode
    details: str
    initial_metadata: tuple[MetadataEntry, ...]
    trailing_metadata: tuple[MetadataEntry, ...]
    response: bytes | None  # None unless OK


@dataclass(frozen=True)
class Ownership:
    """Who owns a call's account by the newest shard map the call has heard of, and that map's version."""

    shard_id: str
    map_version: int

    @classmethod
    def in_map(cls, shard_map: ShardMap, account_id: str) -> Ownership:
        """The account's owner in `shard_map`."""
        return cls(shard_map.shard_for(account_id).id, shard_map.version)

    def newer(self, other: Ownership | None, *, on_tie: bool) -> Ownership:
        """`other` if its map is newer (or as new, with `on_tie`), else this one.

        The router's own map wins a tie (an unversioned map, 0, replaces another of version 0); a
        daemon's word wins only with a strictly higher version, so two daemons whose maps share a
        version but disagree cannot send a call back and forth.
        """
        if other is None:
            return self
        if other.map_version > self.map_version or (on_tie and other.map_version == self.map_version):
            return other
        return self


@dataclass(frozen=True)
class MoveRefusal:
    """A shard's answer that it does not serve the call's account (nothing was applied)."""

    reason: str  # ACCOUNT_MOVED or SLOT_RANGE_MOVING
    #: The owner in the refusing daemon's map and that map's version (ACCOUNT_MOVED names them).
    owner: Ownership | None
    #: The range that owner holds, by the refusing daemon (its database or its map).
    fact: RangeOwner | None = None


@dataclass(frozen=True)
class MoveNote:
    """Why an attempt goes where it goes after an ownership refusal (recorded on its span)."""

    reason: str
    refused_by: str  # the shard that refused the previous attempt
    redirect: bool  # True: to another shard; False: to the same one after waiting for a cut-over
    waited_s: float


class MapRecheck:
    """Re-reads the router's shard map file on demand, one read at a time for the whole router.

    The read runs in a worker thread (`asyncio.to_thread`), not on the event loop. The file is tiny
    and an unchanged one costs a read and a hash (microseconds), but `ShardMapFile` reads under a
    lock that its polling thread holds while it reads and parses: on a stalled volume (a ConfigMap
    mount on a struggling node) a direct read would freeze every call of the router, not just those
    waiting for the map. The hop costs ~0.1 ms on a path that is already a redirect; calls refused
    meanwhile share one read, and `ShardMapFile.recheck` reads at most every RECHECK_INTERVAL_S.
    """

    def __init__(self, shard_maps: ShardMapFile) -> None:
        self._maps = shard_maps
        self._reading: asyncio.Future[ShardMap] | None = None

    async def current(self) -> ShardMap:
        """The map in force after a fresh look at the file (the map in force if the look is slow)."""
        reading = self._reading
        if reading is None:
            reading = asyncio.ensure_future(asyncio.to_thread(self._maps.recheck))
            reading.add_done_callback(self._finished)
            self._reading = reading
        try:
            # Shielded: a caller that goes away (or times out) must not cancel the others' read.
            return await asyncio.wait_for(asyncio.shield(reading), MAP_RECHECK_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "shard map file read took over %.2f s; going on with the map in force", MAP_RECHECK_TIMEOUT_S
            )
        except Exception:
            log.exception("shard map file read failed; going on with the map in force")
        return self._maps.current

    def _finished(self, reading: asyncio.Future[ShardMap]) -> None:
        if self._reading is reading:
            self._reading = None
        if not reading.cancelled():
            reading.exception()  # retrieved: a failure is logged by the callers that awaited it


class _CutOverWait:
    """The time one call may still spend waiting for cut-overs to end."""

    def __init__(self, budget_s: float) -> None:
        self._budget_s = budget_s
        self._started: float | None = None

    @property
    def waited_s(self) -> float:
        """Time since the call's first wait (0 before it)."""
        return 0.0 if self._started is None else time.monotonic() - self._started

    async def step(self, deadline_s: float) -> bool:
        """Pause one step; False (no pause) when the budget or the call's deadline leaves no room."""
        if self._started is None:
            self._started = time.monotonic()
        pause = min(MOVE_WAIT_STEP_S, self._budget_s - self.waited_s)
        if pause <= 0 or deadline_s - pause < MOVE_RESEND_MIN_S:
            return False
        await asyncio.sleep(pause)
        return True


class Forwarder(_GenericHandler):
    """Serves every routed method as bytes in, bytes out; other methods are not its business."""

    def __init__(
        self,
        *,
        shard_maps: ShardMapFile,
        pool: ChannelPool,
        callers: CallerPolicy,
        forward_retries: int,
        max_deadline_s: float,
        move_wait_s: float = 2.0,
        hedge_after_s: float = 0.0,
        hedge_budget: float = 0.1,
        tracer_provider: trace.TracerProvider | None = None,
        traced: bool = False,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._maps = shard_maps
        self._recheck = MapRecheck(shard_maps)
        #: Ranges shards named with a newer owner than this router's map (ACCOUNT_MOVED).
        self._learned = LearnedOwners()
        self._move_wait_s = move_wait_s
        #: Hedged forwarding (`hedging`): off at 0.
        self._hedge_after_s = hedge_after_s
        self._hedges = HedgeBudget(hedge_budget)
        self._slow = SlowDaemons(avoid_s=max(SLOW_DAEMON_AVOID_S, 10 * hedge_after_s))
        self._metrics = metrics
        # With tracing on, each forwarding attempt is a CLIENT span whose traceparent the shard sees.
        self._traced = traced
        self._tracer_provider = tracer_provider
        self._pool = pool
        self._callers = callers
        self._retries = forward_retries
        self._max_deadline_s = max_deadline_s
        self._turns = itertools.count()  # which of a shard's daemons a call tries first
        # No (de)serialisers: the behaviour receives the request bytes and returns response bytes.
        self._handlers = {
            path: grpc.unary_unary_rpc_method_handler(self._behaviour(method))
            for path, method in METHODS_BY_PATH.items()
        }

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        """The handler of a routed method, or None (the server answers UNIMPLEMENTED)."""
        return self._handlers.get(handler_call_details.method)

    def _behaviour(self, method: RpcDeclaration) -> Callable[[bytes, ServicerContext], Awaitable[bytes]]:
        # A plain coroutine function: what grpc.aio's server runs on its event loop.
        async def serve(raw: bytes, context: ServicerContext) -> bytes:
            return await self._serve(method, raw, context)

        return serve

    async def _serve(self, method: RpcDeclaration, raw: bytes, context: ServicerContext) -> bytes:
        if self._metrics is None:
            return await self._answer(method, raw, context, None)
        # One record per call, counted once with the shard `_forward` last sent the call to.
        record = self._metrics.start(method.full_name, GRPC)
        try:
            response = await self._answer(method, raw, context, record)
        except BaseException:
            # An abort (the shard's answer or the router's own error) has set the call's code.
            code = context.code()
            record.finish(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.CANCELLED)
            raise
        record.finish(grpc.StatusCode.OK)
        return response

    async def _answer(
        self, method: RpcDeclaration, raw: bytes, context: ServicerContext, record: CallRecord | None
    ) -> bytes:
        # abort raises; it is kept outside every try block so nothing can swallow it.
        try:
            outcome = await self._forward(method, raw, context, record)
        except ShardRouterError as error:
            await abort_with_error_async(context, error)
        except Exception:
            log.exception("unexpected failure forwarding %s", method.name)
            await abort_with_error_async(
                context,
                Internal("the router failed unexpectedly forwarding the call", reason=Reason.INTERNAL),
            )
        initial = forwardable(outcome.initial_metadata)
        if initial:
            await context.send_initial_metadata(tuple(initial))
        if outcome.code is not grpc.StatusCode.OK or outcome.response is None:
            await context.abort(outcome.code, outcome.details, outcome.trailing_metadata)
        context.set_trailing_metadata(outcome.trailing_metadata)
        return outcome.response

    async def forward(self, method: RpcDeclaration, raw: bytes, call: CallContext) -> Outcome:
        """Forward a call received other than over gRPC (the HTTP front): how the shard answered.

        Raises the router's own refusals (`ShardRouterError`: a malformed routing account, a shard that
        cannot be reached) for the caller to answer in its own protocol.
        """
        if self._metrics is None:
            return await self._forward(method, raw, call, None)
        record = self._metrics.start(method.full_name, HTTP)
        try:
            outcome = await self._forward(method, raw, call, record)
        except ShardRouterError as error:
            record.finish(error.code)
            raise
        except BaseException:
            record.finish(grpc.StatusCode.CANCELLED)
            raise
        record.finish(outcome.code)
        return outcome

    async def _forward(
        self, method: RpcDeclaration, raw: bytes, context: CallContext, record: CallRecord | None
    ) -> Outcome:
        """How the shard's call ended (OK or not); raises the router's own errors.

        `record` (metrics on) learns the id of each shard the call is sent to, from the router's map;
        until then it keeps `NO_SHARD` (a routing account that cannot be read is refused first).
        """
        metadata = tuple(self._callers.outgoing(context))  # who is calling comes first
        account = routing_account(method, raw)
        # Resent over backoff rounds when not reached: a keyed call (the shard applies it at most
        # once) or a read (nothing to apply twice). A mutating call without a key is not: the shard
        # refuses it anyway, and a retry would only double the traffic of a broken caller.
        resendable = not method.keyed or any(k == KEY_METADATA for k, _ in metadata)
        shard_map = self._maps.current
        shard, owner = self._first_owner(shard_map, account)
        if record is not None:
            record.shard = shard.id
        cut_over = _CutOverWait(self._move_wait_s)
        note: MoveNote | None = None
        redirects = 0
        while True:
            outcome = await self._forward_to(shard, method, raw, metadata, resendable, context, note)
            refusal = move_refusal(outcome)
            if refusal is None:
                return outcome
            owner, next_shard = await self._owner_after(refusal, account, shard, owner, cut_over, context)
            if next_shard is None:
                return outcome
            redirect = next_shard.id != shard.id
            if redirect and redirects == MAX_REDIRECTS:
                log.warning(
                    "%s refused by %d shards in turn (%s); answering the last refusal",
                    method.name,
                    redirects + 1,
                    refusal.reason,
                    extra={"shard_id": shard.id},
                )
                return outcome
            if redirect:
                redirects += 1
                if self._metrics is not None:
                    self._metrics.redirected(refusal.reason, shard.id)
            note = MoveNote(refusal.reason, shard.id, redirect, cut_over.waited_s)
            shard = next_shard
            if record is not None:
                record.shard = shard.id

    def _first_owner(self, shard_map: ShardMap, account: str) -> tuple[Shard, Ownership]:
        """Where a call goes first: the owner by the map, or by a newer fact a shard named."""
        learned = self._learned.snapshot
        if learned:
            if min(f.map_version for f in learned) <= shard_map.version:
                self._learned.forget_upto(shard_map.version)  # the map has caught up with those
            word = owner_of_slot(shard_map, shard_map.slot_of(account), learned, at_least=False)
            shard = shard_map.shard_by_id(word.shard_id)
            if not word.from_map and shard is not None:
                return shard, Ownership(shard.id, word.map_version)
        shard = shard_map.shard_for(account)
        return shard, Ownership(shard.id, shard_map.version)

    async def _owner_after(
        self,
        refusal: MoveRefusal,
        account: str,
        refused_by: Shard,
        owner: Ownership,
        cut_over: _CutOverWait,
        context: CallContext,
    ) -> tuple[Ownership, Shard | None]:
        """The newest ownership known after a refusal, and the shard to resend to (None: answer it)."""
        owner = owner.newer(refusal.owner, on_tie=False)
        shard_map = await self._recheck.current()
        if refusal.fact is not None and self._learned.learn(refusal.fact, shard_map.version):
            # Calls on the range now go straight to its owner until this router's map catches up.
            log.info(
                "slots %d-%d belong to %s as of map version %d (this router's map: version %d)",
                refusal.fact.first_slot,
                refusal.fact.last_slot,
                refusal.fact.shard_id,
                refusal.fact.map_version,
                shard_map.version,
                extra={"shard_id": refused_by.id},
            )
        owner = owner.newer(Ownership.in_map(shard_map, account), on_tie=True)
        if owner.shard_id == refused_by.id:
            if refusal.reason != Reason.SLOT_RANGE_MOVING:
                return owner, None  # nobody newer names another owner: the caller retries later
            # The cut-over still runs (or is being called off): pause, look at the map again, and
            # resend to whichever shard owns the account then.
            if not await cut_over.step(self._timeout(context)):
                return owner, None
            shard_map = await self._recheck.current()
            owner = owner.newer(Ownership.in_map(shard_map, account), on_tie=True)
        # Addresses come from the router's own map only, never from a shard's answer.
        return owner, shard_map.shard_by_id(owner.shard_id)

    async def _forward_to(
        self,
        shard: Shard,
        method: RpcDeclaration,
        raw: bytes,
        metadata: tuple[MetadataEntry, ...],
        resendable: bool,
        context: CallContext,
        note: MoveNote | None,
    ) -> Outcome:
        """How one shard answered the call; raises SHARD_UNAVAILABLE when none of its daemons could."""
        # Calls spread over a shard's daemons in turn; an attempt that cannot reach one goes on to
        # the next at once (any daemon of a shard answers for it: the claim protocol decides between
        # them), and only once every address was tried does a resendable call (keyed, or a read) back
        # off and go round again: a shard's daemons restarted a moment ago may still be reconnecting
        # (the channels' backoff, up to a second), and a read then fails as needlessly as a write. A
        # mutating call without a key, refused by the shard for want of one, tries each daemon once.
        addresses = shard.addresses
        first = next(self._turns) % len(addresses)
        attempt = 0
        hedged = resendable and self._hedge_after_s > 0 and len(addresses) > 1
        if hedged:
            self._hedges.earn()
        while True:
            turn = first + attempt
            if hedged:
                outcome = await self._hedged_attempt(shard, turn, method, raw, metadata, context, note)
            else:
                address = addresses[turn % len(addresses)]
                sent = metadata
                if attempt and method.keyed:
                    # The attempt before may have reached a daemon that died with the key claimed:
                    # its database session lets the claim go only once it has exited, so the resend
                    # waits for a twin in flight (as a hedge does) instead of being answered in
                    # flight for its own earlier attempt.
                    sent = with_wait(metadata, self._twin_wait_ms(context))
                outcome = await self._attempt(shard, address, method, raw, sent, context, note)
            if not unreached(outcome.code, outcome.trailing_metadata) and not (
                resendable and interrupted(outcome)
            ):
                return outcome
            untried = attempt + 1 < len(addresses)
            if not untried and (not resendable or attempt >= self._retries + len(addresses) - 1):
                raise self._shard_unavailable(shard, method, outcome, attempt + 1)
            rounds = (attempt + 1) // len(addresses)
            delay = 0.0 if untried else RETRY_BACKOFF_S * (2 ** (rounds - 1)) * random.uniform(0.5, 1.5)
            if self._timeout(context) <= delay:
                raise self._shard_unavailable(shard, method, outcome, attempt + 1)
            if delay:
                await asyncio.sleep(delay)
            attempt += 1

    def _twin_wait_ms(self, context: CallContext) -> int:
        """How long a second attempt of a keyed call asks the daemon to wait for a twin in flight
        (`idempotency-wait-ms`): the call's deadline less a margin to answer in."""
        return int((self._timeout(context) - HEDGE_ANSWER_MARGIN_S) * 1000)

    async def _hedged_attempt(
        self,
        shard: Shard,
        turn: int,
        method: RpcDeclaration,
        raw: bytes,
        metadata: tuple[MetadataEntry, ...],
        context: CallContext,
        note: MoveNote | None,
    ) -> Outcome:
        """An attempt at the shard's daemon of this `turn`, hedged at the next one when it is slow."""
        first, second = self._slow.order(shard.addresses, turn)

        async def attempt_at(address: str, sent: tuple[MetadataEntry, ...]) -> Outcome:
            outcome = await self._attempt(shard, address, method, raw, sent, context, note)
            if not unreached(outcome.code, outcome.trailing_metadata):
                self._slow.answered(address)
            return outcome

        def hedge() -> Awaitable[Outcome] | None:
            if not self._hedges.take(past_a_stall=self._slow.stalled(first, second)):
                return None
            self._slow.mark(first)
            if self._metrics is not None:
                self._metrics.hedged(shard.id, won=False)
            # The hedge waits for a twin in flight (the call's deadline less a margin to answer).
            return attempt_at(second, with_wait(metadata, self._twin_wait_ms(context) if method.keyed else 0))

        primary = attempt_at(first, metadata)
        outcome, hedge_won = await first_decisive(
            primary, hedge, hedge_after_s=self._hedge_after_s, decisive=decisive
        )
        if hedge_won and self._metrics is not None:
            self._metrics.hedged(shard.id, won=True)
        return outcome

    async def _attempt(
        self,
        shard: Shard,
        address: str,
        method: RpcDeclaration,
        raw: bytes,
        metadata: tuple[MetadataEntry, ...],
        context: CallContext,
        note: MoveNote | None,
    ) -> Outcome:
        if not self._traced:
            return await self._send(address, method, raw, metadata, context)
        with router_span(
            method.full_name, metadata, tracer_provider=self._tracer_provider, shard_id=shard.id
        ) as traced_metadata:
            if note is not None:
                record_move(
                    reason=note.reason,
                    refused_by=note.refused_by,
                    redirect=note.redirect,
                    waited_s=note.waited_s,
                )
            outcome = await self._send(address, method, raw, tuple(traced_metadata), context)
            span = trace.get_current_span()
            span.set_attribute("server.address", address)
            if unreached(outcome.code, outcome.trailing_metadata):
                span.set_attribute("router.shard_unreached", True)
            record_forwarded_status(outcome.code, outcome.details)
            return outcome

    async def _send(
        self,
        address: str,
        method: RpcDeclaration,
        raw: bytes,
        metadata: tuple[MetadataEntry, ...],
        context: CallContext,
    ) -> Outcome:
        call = self._pool.unary_bytes(address, method.full_name)(
            raw, timeout=self._timeout(context), metadata=metadata
        )
        try:
            response = await call
        except grpc.aio.AioRpcError as error:  # an answer like any other: its status says what happened
            return Outcome(
                code=error.code(),
                details=error.details() or "",
                initial_metadata=_entries(error.initial_metadata()),
                trailing_metadata=_entries(error.trailing_metadata()),
                response=None,
            )
        except asyncio.CancelledError:
            # The caller went away (cancel, deadline): the shard's work is cancelled too.
            call.cancel()
            raise
        return Outcome(
            code=grpc.StatusCode.OK,
            details="",
            initial_metadata=_entries(await call.initial_metadata()),
            trailing_metadata=_entries(await call.trailing_metadata()),
            response=response,
        )

    def _timeout(self, context: CallContext) -> float:
        # grpc reports "no deadline" as None: cap it, so a shard call never outlives every caller's
        # patience.
        remaining: float | None = context.time_remaining()
        if remaining is None or remaining > self._max_deadline_s:
            return self._max_deadline_s
        return max(remaining, 0.0)

    def _shard_unavailable(
        self, shard: Shard, method: RpcDeclaration, outcome: Outcome, attempts: int
    ) -> Unavailable:
        log.warning(
            "shard %s unreachable for %s after %d attempt(s): %s",
            shard.id,
            method.name,
            attempts,
            outcome.details,
            extra={"shard_id": shard.id, "addresses": ",".join(shard.addresses)},
        )
        resend = " with the same idempotency key, so that it applies at most once" if method.keyed else ""
        return Unavailable(
            f"shard {shard.id} cannot be reached right now; retry in {SHARD_UNAVAILABLE_RETRY_MS} ms{resend}",
            reason=Reason.SHARD_UNAVAILABLE,
            retry_after_ms=SHARD_UNAVAILABLE_RETRY_MS,
            metadata={"shard_id": shard.id},
        )


def _entries(metadata: object) -> tuple[MetadataEntry, ...]:
    """Metadata (a `grpc.aio.Metadata`, a tuple of pairs, or None) as a tuple of (key, value)."""
    # The type stubs say the sync API's `_Metadatum` for AioRpcError; at run time it is aio Metadata.
    return tuple(cast("Iterable[MetadataEntry]", metadata or ()))


#: Answers of one daemon that another daemon of the shard may better: its database lost (a session
#: a hedge's waiter ended as stalled, a failover) or its admission full.
_TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def decisive(outcome: Outcome) -> bool:
    """Whether a hedged attempt's outcome is the caller's answer, without waiting for the other:
    anything but a daemon not reached, a call cut off, a twin found in flight (the other attempt holds
    the key: its answer comes), or a transient refusal the other daemon may not share. When neither
    attempt is decisive, the caller gets the last to end."""
    if unreached(outcome.code, outcome.trailing_metadata) or interrupted(outcome):
        return False
    if outcome.code in _TRANSIENT_CODES:
        return False
    if outcome.code is not grpc.StatusCode.ABORTED:
        return True
    info = our_error_info(outcome.trailing_metadata)
    return info is None or info.reason != Reason.IDEMPOTENCY_KEY_IN_FLIGHT


def interrupted(outcome: Outcome) -> bool:
    """Whether the daemon's side of the call was cut off before it answered: CANCELLED without our
    ErrorInfo, while this call's own caller is still waiting (a caller's cancellation ends the
    handler's task before an outcome is read). A daemon stopping past its grace period cancels the
    calls it still runs; one of them may have committed, so only a resendable call (keyed: the key
    replays it; or a read) is sent again."""
    return outcome.code is grpc.StatusCode.CANCELLED and not has_our_error_info(outcome.trailing_metadata)


def move_refusal(outcome: Outcome) -> MoveRefusal | None:
    """The shard's refusal of the account as not served there (ACCOUNT_MOVED, SLOT_RANGE_MOVING), if
    that is what `outcome` is."""
    if outcome.code is not grpc.StatusCode.UNAVAILABLE:
        return None
    info = our_error_info(outcome.trailing_metadata)
    if info is None or info.reason not in MOVE_REASONS:
        return None
    owner_id = info.metadata.get(OWNER_KEY, "")
    version = info.metadata.get(VERSION_KEY, "")
    known = bool(owner_id) and version.isascii() and version.isdigit()
    return MoveRefusal(
        info.reason,
        Ownership(owner_id, int(version)) if known else None,
        RangeOwner.from_metadata(info.metadata) if known else None,
    )


__all__ = [
    "DETAILS_TRAILER",
    "HEDGE_ANSWER_MARGIN_S",
    "MAP_RECHECK_TIMEOUT_S",
    "MAX_REDIRECTS",
    "MOVE_REASONS",
    "MOVE_RESEND_MIN_S",
    "MOVE_WAIT_STEP_S",
    "RETRY_BACKOFF_S",
    "SHARD_UNAVAILABLE_RETRY_MS",
    "SLOW_DAEMON_AVOID_S",
    "Forwarder",
    "MapRecheck",
    "MoveNote",
    "MoveRefusal",
    "Outcome",
    "Ownership",
    "decisive",
    "has_our_error_info",
    "interrupted",
    "move_refusal",
    "our_error_info",
    "unreached",
]
