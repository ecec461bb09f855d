"""Server interceptor that turns domain errors raised by handlers into their gRPC status.

Servicers raise `shardrouter.core.errors` types and never call `abort`; this maps them (through
`core.status`) for methods the idempotency interceptor does not already guard. An unexpected exception becomes
INTERNAL with a message that leaks nothing of the server's internals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shardrouter.core.errors import Internal, InvalidArgument, Reason, ShardRouterError
from shardrouter.core.interceptors import MethodHandler, UnaryInterceptor
from shardrouter.core.status import abort_with_error

log = logging.getLogger(__name__)


class DomainErrorInterceptor(UnaryInterceptor):
    """Maps `ShardRouterError` to status + rich details for every unary method not in `skip`."""

    def __init__(self, skip: Collection[str] = ()) -> None:
        super().__init__()
        self._skip = frozenset(skip)

    def applies_to(self, method: str) -> bool:
        """Every method but the skipped ones."""
        return method not in self._skip

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """Decode the request here and map the handler's domain errors."""
        behaviour = handler.unary_unary
        assert behaviour is not None
        deserialize = handler.request_deserializer

        def mapped(raw: Any, context: grpc.ServicerContext) -> Any:
            try:
                # Decoding here, not in grpc, so garbage bytes are INVALID_ARGUMENT rather than INTERNAL.
                request = decode_request(deserialize, raw, method)
                return behaviour(request, context)
            except ShardRouterError as error:
                abort_with_error(context, error)
            except Exception:
                if context.code() not in (None, grpc.StatusCode.OK):  # type: ignore[attr-defined]
                    raise  # the handler aborted on purpose (health, reflection)
                log.exception("unexpected failure in %s", method)
                abort_with_error(
                    context, Internal("the server failed unexpectedly; retry later", reason=Reason.INTERNAL)
                )

        return grpc.unary_unary_rpc_method_handler(mapped, response_serializer=handler.response_serializer)


def decode_request(deserialize: Callable[[bytes], Any] | None, raw: Any, method: str) -> Any:
    """`raw` decoded by `deserialize` (as is without one); INVALID_ARGUMENT when it is no such message."""
    if deserialize is None:
        return raw
    try:
        return deserialize(raw)
    except DecodeError as exc:
        raise InvalidArgument(
            f"the request body is not a valid {method} request message (protobuf)",
            reason=Reason.INVALID_REQUEST,
        ) from exc


__all__ = [
    "DomainErrorInterceptor",
    "decode_request",
]
