"""Server interceptor that turns domain errors raised by handlers into their gRPC status.

Servicers raise `shardrouter.errors` types and never call `abort`; this is the one place that maps
them for methods the idempotency interceptor does not already guard. An unexpected exception becomes
INTERNAL with a message that leaks nothing of the server's internals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shardrouter.errors import Internal, InvalidArgument, Reason, ShardRouterError, to_grpc_status
from shardrouter.grpcserver import MethodHandler, ServerInterceptorBase

log = logging.getLogger(__name__)


class DomainErrorInterceptor(ServerInterceptorBase):
    """Maps `ShardRouterError` to status + rich details for every unary method not in `skip`."""

    def __init__(self, skip: Collection[str] = ()) -> None:
        self._skip = frozenset(skip)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], MethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        """Wrap unary-unary handlers; leave the rest alone."""
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler_call_details.method in self._skip:
            return handler
        behaviour = handler.unary_unary
        method = handler_call_details.method
        deserialize = handler.request_deserializer

        def mapped(raw: Any, context: grpc.ServicerContext) -> Any:
            try:
                # Decoding here, not in grpc, so garbage bytes are INVALID_ARGUMENT rather than INTERNAL.
                request = _decode(deserialize, raw, method)
                return behaviour(request, context)
            except ShardRouterError as error:
                context.abort_with_status(to_grpc_status(error))
            except Exception as exc:
                if context.code() not in (None, grpc.StatusCode.OK):  # type: ignore[attr-defined]
                    raise  # the handler aborted on purpose (health, reflection)
                log.exception("unexpected failure in %s", method)
                internal = Internal("the server failed unexpectedly; retry later", reason=Reason.INTERNAL)
                context.abort_with_status(to_grpc_status(internal))
                raise AssertionError("unreachable") from exc
            return None  # pragma: no cover

        return grpc.unary_unary_rpc_method_handler(mapped, response_serializer=handler.response_serializer)


def _decode(deserialize: Callable[[bytes], Any] | None, raw: Any, method: str) -> Any:
    if deserialize is None:
        return raw
    try:
        return deserialize(raw)
    except DecodeError as exc:
        raise InvalidArgument(
            f"the request body is not a valid {method} request message (protobuf)",
            reason=Reason.INVALID_REQUEST,
        ) from exc
