"""The router's one RPC handler: forward a call's bytes to the owning shard and relay its answer.

Per call: read the routing account from a decoded copy of the request -> pick the shard from the
current map -> send the caller's original bytes with the caller's metadata and remaining deadline ->
return the shard's response bytes, status, message, details and trailers untouched.

The router has no state to protect, so its only decisions are about reaching the shard. A call the
shard answered - whatever the status - is passed through as is. A call that never reached the shard
is the router's own UNAVAILABLE (SHARD_UNAVAILABLE, with RetryInfo); it is retried here first, but
only when it carries an idempotency key, because only then does the shard make a repeat harmless.

The handler is a `grpc.aio` coroutine and the shard call goes out on a `grpc.aio` channel: a call
waiting for its shard is a suspended coroutine, not a blocked worker thread. Measured with
`python -m tests.router.bench_forwarding` (unary GetBalance to a loopback echo shard, 32 calls in
flight): a sync `grpc.server` + sync-channel forwarder did ~1,100 rps, this asyncio one ~1,550 rps
(+40%). A caller's cancellation (or expired deadline) cancels the handler's task, and with it the
shard call it is awaiting.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from opentelemetry import trace

from shardrouter.core.errors import (
    ERROR_DOMAIN,
    Internal,
    Reason,
    ShardRouterError,
    Unavailable,
    to_grpc_status,
)
from shardrouter.core.keys import KEY_METADATA
from shardrouter.core.metrics import RouterMetrics
from shardrouter.core.shardmap import Shard
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.router.channels import ChannelPool
from shardrouter.router.metadata import CallerPolicy, MetadataEntry, forwardable
from shardrouter.router.routing import METHODS_BY_PATH, RoutedMethod, routing_account
from shardrouter.router.tracing import record_forwarded_status, router_span

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    from shardrouter.router.metadata import ServicerContext

    _GenericHandler = grpc.GenericRpcHandler[bytes, bytes]
else:
    _GenericHandler = grpc.GenericRpcHandler

log = logging.getLogger(__name__)

DETAILS_TRAILER = "grpc-status-details-bin"
#: RetryInfo delay the router advises when a shard cannot be reached.
SHARD_UNAVAILABLE_RETRY_MS = 500
#: First backoff between attempts to reach a shard; doubled per attempt, with jitter.
RETRY_BACKOFF_S = 0.05


@dataclass(frozen=True)
class Outcome:
    """How the shard's call ended: everything the caller gets back."""

    code: grpc.StatusCode
    details: str
    initial_metadata: tuple[MetadataEntry, ...]
    trailing_metadata: tuple[MetadataEntry, ...]
    response: bytes | None  # None unless OK


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
        tracer_provider: trace.TracerProvider | None = None,
        traced: bool = False,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._maps = shard_maps
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

    def _behaviour(self, method: RoutedMethod) -> Callable[[bytes, ServicerContext], Awaitable[bytes]]:
        # A plain coroutine function: what grpc.aio's server runs on its event loop.
        async def serve(raw: bytes, context: ServicerContext) -> bytes:
            return await self._serve(method, raw, context)

        return serve

    async def _serve(self, method: RoutedMethod, raw: bytes, context: ServicerContext) -> bytes:
        if self._metrics is None:
            return await self._answer(method, raw, context)
        with self._metrics.timed(method.full_name) as record:
            try:
                response = await self._answer(method, raw, context)
            except BaseException:
                # An abort (the shard's answer or the router's own error) has set the call's code.
                code = context.code()
                record(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.CANCELLED)
                raise
            record(grpc.StatusCode.OK)
            return response

    async def _answer(self, method: RoutedMethod, raw: bytes, context: ServicerContext) -> bytes:
        # abort raises; it is kept outside every try block so nothing can swallow it.
        try:
            outcome = await self._forward(method, raw, context)
        except ShardRouterError as error:
            status = to_grpc_status(error)
            await context.abort(status.code, status.details, status.trailing_metadata)
        except Exception:
            log.exception("unexpected failure forwarding %s", method.name)
            status = to_grpc_status(
                Internal("the router failed unexpectedly forwarding the call", reason=Reason.INTERNAL)
            )
            await context.abort(status.code, status.details, status.trailing_metadata)
        initial = forwardable(outcome.initial_metadata)
        if initial:
            await context.send_initial_metadata(tuple(initial))
        if outcome.code is not grpc.StatusCode.OK or outcome.response is None:
            await context.abort(outcome.code, outcome.details, outcome.trailing_metadata)
        context.set_trailing_metadata(outcome.trailing_metadata)
        return outcome.response

    async def _forward(self, method: RoutedMethod, raw: bytes, context: ServicerContext) -> Outcome:
        """How the shard's call ended (OK or not); raises the router's own errors."""
        metadata = tuple(self._callers.outgoing(context))  # who is calling comes first
        account = routing_account(method, raw)
        shard = self._maps.current.shard_for(account)
        keyed = any(k == KEY_METADATA for k, _ in metadata)
        # Calls spread over a shard's daemons in turn; an attempt that cannot reach one goes on to
        # the next at once (any daemon of a shard answers for it: the claim protocol decides between
        # them), and only once every address was tried does a keyed call back off and go round again.
        # A keyless call is a read, or refused by the shard for want of a key: trying each daemon once
        # is safe for it too, but it gets no backoff rounds.
        addresses = shard.addresses
        first = next(self._turns) % len(addresses)
        attempt = 0
        while True:
            address = addresses[(first + attempt) % len(addresses)]
            outcome = await self._attempt(shard, address, method, raw, metadata, context)
            if not unreached(outcome.code, outcome.trailing_metadata):
                return outcome
            untried = attempt + 1 < len(addresses)
            if not untried and (not keyed or attempt >= self._retries + len(addresses) - 1):
                raise self._shard_unavailable(shard, method, outcome, attempt + 1)
            rounds = (attempt + 1) // len(addresses)
            delay = 0.0 if untried else RETRY_BACKOFF_S * (2 ** (rounds - 1)) * random.uniform(0.5, 1.5)
            if self._timeout(context) <= delay:
                raise self._shard_unavailable(shard, method, outcome, attempt + 1)
            if delay:
                await asyncio.sleep(delay)
            attempt += 1

    async def _attempt(
        self,
        shard: Shard,
        address: str,
        method: RoutedMethod,
        raw: bytes,
        metadata: tuple[MetadataEntry, ...],
        context: ServicerContext,
    ) -> Outcome:
        if not self._traced:
            return await self._send(address, method, raw, metadata, context)
        with router_span(
            method.full_name, metadata, tracer_provider=self._tracer_provider, shard_id=shard.id
        ) as traced_metadata:
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
        method: RoutedMethod,
        raw: bytes,
        metadata: tuple[MetadataEntry, ...],
        context: ServicerContext,
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

    def _timeout(self, context: ServicerContext) -> float:
        # grpc reports "no deadline" as None: cap it, so a shard call never outlives every caller's
        # patience.
        remaining: float | None = context.time_remaining()
        if remaining is None or remaining > self._max_deadline_s:
            return self._max_deadline_s
        return max(remaining, 0.0)

    def _shard_unavailable(
        self, shard: Shard, method: RoutedMethod, outcome: Outcome, attempts: int
    ) -> Unavailable:
        log.warning(
            "shard %s unreachable for %s after %d attempt(s): %s",
            shard.id,
            method.name,
            attempts,
            outcome.details,
            extra={"shard_id": shard.id, "addresses": ",".join(shard.addresses)},
        )
        return Unavailable(
            f"shard {shard.id} cannot be reached right now; retry in {SHARD_UNAVAILABLE_RETRY_MS} ms "
            "(a mutating call with the same idempotency key, so that it applies at most once)",
            reason=Reason.SHARD_UNAVAILABLE,
            retry_after_ms=SHARD_UNAVAILABLE_RETRY_MS,
            metadata={"shard_id": shard.id},
        )


def _entries(metadata: object) -> tuple[MetadataEntry, ...]:
    """Metadata (a `grpc.aio.Metadata`, a tuple of pairs, or None) as a tuple of (key, value)."""
    # The type stubs say the sync API's `_Metadatum` for AioRpcError; at run time it is aio Metadata.
    return tuple(cast("Iterable[MetadataEntry]", metadata or ()))


def unreached(code: grpc.StatusCode, trailers: tuple[MetadataEntry, ...]) -> bool:
    """Whether a failed call never got an answer from the shard (the channel could not reach it).

    Every status a shard sends carries `google.rpc.ErrorInfo` of our domain in the details trailer,
    an UNAVAILABLE of its own (database down) included - that one must reach the caller as sent.
    An UNAVAILABLE without it was made by the transport: connection refused, reset, or TLS failure.
    """
    if code is not grpc.StatusCode.UNAVAILABLE:
        return False
    return not has_our_error_info(trailers)


def has_our_error_info(trailers: tuple[MetadataEntry, ...]) -> bool:
    """Whether the trailers hold a `google.rpc.Status` with an ErrorInfo of the shardrouter domain."""
    for key, value in trailers:
        if key != DETAILS_TRAILER or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            continue
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                return True
    return False


__all__ = [
    "DETAILS_TRAILER",
    "RETRY_BACKOFF_S",
    "SHARD_UNAVAILABLE_RETRY_MS",
    "Forwarder",
    "Outcome",
    "has_our_error_info",
    "unreached",
]
