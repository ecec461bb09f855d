"""The router's one RPC handler: forward a call's bytes to the owning shard and relay its answer.

Per call: read the routing account from a decoded copy of the request -> pick the shard from the
current map -> send the caller's original bytes with the caller's metadata and remaining deadline ->
return the shard's response bytes, status, message, details and trailers untouched.

The router has no state to protect, so its only decisions are about reaching the shard. A call the
shard answered - whatever the status - is passed through as is. A call that never reached the shard
is the router's own UNAVAILABLE (SHARD_UNAVAILABLE, with RetryInfo); it is retried here first, but
only when it carries an idempotency key, because only then does the shard make a repeat harmless.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from router.channels import ChannelPool
from router.metadata import CallerPolicy, MetadataEntry, forwardable
from router.routing import METHODS_BY_PATH, RoutedMethod, ShardMapHolder, routing_account
from shardrouter.errors import ERROR_DOMAIN, Internal, Reason, ShardRouterError, Unavailable, to_grpc_status
from shardrouter.keys import KEY_METADATA
from shardrouter.shardmap import Shard

log = logging.getLogger(__name__)

DETAILS_TRAILER = "grpc-status-details-bin"
#: RetryInfo delay the router advises when a shard cannot be reached.
SHARD_UNAVAILABLE_RETRY_MS = 500
#: First backoff between attempts to reach a shard; doubled per attempt, with jitter.
RETRY_BACKOFF_S = 0.05


@dataclass(frozen=True)
class _RelayedStatus(grpc.Status):
    """A shard's final status, handed to `abort_with_status` unchanged."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[MetadataEntry, ...]


if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    _GenericHandler = grpc.GenericRpcHandler[bytes, bytes]
else:
    _GenericHandler = grpc.GenericRpcHandler


class Forwarder(_GenericHandler):
    """Serves every routed method as bytes in, bytes out; other methods are not its business."""

    def __init__(
        self,
        *,
        shard_maps: ShardMapHolder,
        pool: ChannelPool,
        callers: CallerPolicy,
        forward_retries: int,
        max_deadline_s: float,
    ) -> None:
        self._maps = shard_maps
        self._pool = pool
        self._callers = callers
        self._retries = forward_retries
        self._max_deadline_s = max_deadline_s
        # No (de)serialisers: the behaviour receives the request bytes and returns response bytes.
        self._handlers = {
            path: grpc.unary_unary_rpc_method_handler(functools.partial(self._serve, method))
            for path, method in METHODS_BY_PATH.items()
        }

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        """The handler of a routed method, or None (the server answers UNIMPLEMENTED)."""
        return self._handlers.get(handler_call_details.method)

    def _serve(self, method: RoutedMethod, raw: bytes, context: grpc.ServicerContext) -> bytes:
        # abort_with_status raises; it is kept outside every try block so nothing can swallow it.
        try:
            outcome = self._forward(method, raw, context)
        except ShardRouterError as error:
            context.abort_with_status(to_grpc_status(error))
        except Exception:
            log.exception("unexpected failure forwarding %s", method.name)
            context.abort_with_status(
                to_grpc_status(
                    Internal("the router failed unexpectedly forwarding the call", reason=Reason.INTERNAL)
                )
            )
        initial = forwardable(outcome.initial_metadata() or ())
        if initial:
            context.send_initial_metadata(tuple(initial))
        code = outcome.code()
        if code is not grpc.StatusCode.OK:
            context.abort_with_status(
                _RelayedStatus(code, outcome.details() or "", tuple(outcome.trailing_metadata() or ()))
            )
        context.set_trailing_metadata(tuple(outcome.trailing_metadata() or ()))
        response: bytes = outcome.result()
        return response

    def _forward(
        self, method: RoutedMethod, raw: bytes, context: grpc.ServicerContext
    ) -> grpc.CallFuture[bytes]:
        """The shard's finished call (OK or not); raises the router's own errors."""
        metadata = tuple(self._callers.outgoing(context))  # who is calling comes first
        account = routing_account(method, raw)
        shard = self._maps.current.shard_for(account)
        keyed = any(k == KEY_METADATA for k, _ in metadata)
        attempt = 0
        while True:
            call = self._pool.unary_bytes(shard.address, method.full_name).future(
                raw, timeout=self._timeout(context), metadata=metadata
            )
            # A caller that goes away (cancel, deadline) cancels the shard's work too; if it went
            # away before the callback could be registered, cancel now.
            if not context.add_callback(call.cancel):
                call.cancel()  # type: ignore[no-untyped-call]
            with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
                call.result()  # wait; the call's status says what happened
            if not unreached(call):
                return call
            delay = RETRY_BACKOFF_S * (2**attempt) * random.uniform(0.5, 1.5)
            if not keyed or attempt >= self._retries or self._timeout(context) <= delay:
                raise self._shard_unavailable(shard, method, call, attempt + 1)
            time.sleep(delay)
            attempt += 1

    def _timeout(self, context: grpc.ServicerContext) -> float:
        # grpc reports "no deadline" as an enormous number of seconds: cap it, so a shard call never
        # outlives every caller's patience.
        remaining = context.time_remaining()
        if remaining is None or remaining > self._max_deadline_s:
            return self._max_deadline_s
        return max(remaining, 0.0)

    def _shard_unavailable(
        self, shard: Shard, method: RoutedMethod, call: grpc.CallFuture[bytes], attempts: int
    ) -> Unavailable:
        log.warning(
            "shard %s unreachable for %s after %d attempt(s): %s",
            shard.id,
            method.name,
            attempts,
            call.details(),
            extra={"shard_id": shard.id, "address": shard.address},
        )
        return Unavailable(
            f"shard {shard.id} cannot be reached right now; retry in {SHARD_UNAVAILABLE_RETRY_MS} ms "
            "(a mutating call with the same idempotency key, so that it applies at most once)",
            reason=Reason.SHARD_UNAVAILABLE,
            retry_after_ms=SHARD_UNAVAILABLE_RETRY_MS,
            metadata={"shard_id": shard.id},
        )


def unreached(call: grpc.Call) -> bool:
    """Whether a failed call never got an answer from the shard (the channel could not reach it).

    Every status a shard sends carries `google.rpc.ErrorInfo` of our domain in the details trailer,
    an UNAVAILABLE of its own (database down) included - that one must reach the caller as sent.
    An UNAVAILABLE without it was made by the transport: connection refused, reset, or TLS failure.
    """
    if call.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    return not has_our_error_info(call.trailing_metadata() or ())


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
