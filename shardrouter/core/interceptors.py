"""The base of our synchronous server interceptors: wrap the unary-unary handlers of chosen methods.

The idempotency, admission, error-mapping and tracing interceptors of the shard daemon all build on
`UnaryInterceptor`; streaming and unknown methods pass through them untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    # grpc-stubs makes these generic; at run time they are plain classes.
    ServerInterceptorBase = grpc.ServerInterceptor[Any, Any]
    MethodHandler = grpc.RpcMethodHandler[Any, Any]
else:
    ServerInterceptorBase = grpc.ServerInterceptor
    MethodHandler = grpc.RpcMethodHandler


class UnaryInterceptor(ServerInterceptorBase):
    """A server interceptor that wraps the unary-unary handlers of the methods it `applies_to`.

    Subclasses give `wrap` (the new handler, a function of the method and the handler alone);
    streaming methods, unknown methods and methods it does not apply to pass through untouched.
    """

    def __init__(self) -> None:
        #: method -> (the handler wrapped, its wrapper). grpc asks every interceptor for the handler
        #: on every call, and the handler below is the same object each time: its wrapper is made once.
        self._wrapped: dict[str, tuple[MethodHandler, MethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], MethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        """The wrapped handler, or the original one where this interceptor does not apply."""
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or not self.applies_to(method):
            return handler
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        # Two threads may both get here for a new method; each wrapper is as good as the other.
        wrapper = self.wrap(method, handler)
        self._wrapped[method] = (handler, wrapper)
        return wrapper

    def applies_to(self, method: str) -> bool:
        """Whether to wrap `method` (a full path such as /shardrouter.v1.TransferService/Transfer)."""
        return True

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The handler that replaces `handler` (a unary-unary handler of `method`)."""
        raise NotImplementedError


def with_behaviour(handler: MethodHandler, behaviour: Callable[[Any, Any], Any]) -> MethodHandler:
    """`handler`'s request decoding and response encoding around a new unary behaviour."""
    return grpc.unary_unary_rpc_method_handler(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


__all__ = ["MethodHandler", "ServerInterceptorBase", "UnaryInterceptor", "with_behaviour"]
