"""The router's limit on a gRPC request's size, enforced by the router rather than by grpc-core.

grpc-core refuses a message over `grpc.max_receive_message_length` before any handler or interceptor
runs: the caller gets a bare RESOURCE_EXHAUSTED and nothing is counted. So grpc-core is given a
larger hard cap (`grpc_receive_cap`) and this interceptor, first in the server's chain, refuses a
routed call over `max_message_bytes` itself: RESOURCE_EXHAUSTED with a message naming the limit,
the ErrorInfo reason `REQUEST_TOO_LARGE` (what the HTTP front's 413 says), counted in
`router_requests_total` under the method (shard "none"). Above the hard cap grpc-core still refuses
on its own, uncounted; so do health and reflection calls over it (they are not routed).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from shardrouter.core.errors import ResourceExhausted
from shardrouter.core.interceptors import MethodHandler
from shardrouter.core.status import abort_with_error_async
from shardrouter.router.metrics import GRPC, NO_SHARD, RouterMetrics
from shardrouter.router.routing import METHODS_BY_PATH

#: The ErrorInfo reason of a request over the limit: the HTTP front's reason for its 413.
REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"

if TYPE_CHECKING:
    # grpc-stubs makes it generic; at run time it is a plain class.
    AioServerInterceptorBase = grpc.aio.ServerInterceptor[Any, Any]
else:
    AioServerInterceptorBase = grpc.aio.ServerInterceptor


def grpc_receive_cap(max_message_bytes: int) -> int:
    """What grpc-core is let receive: 4x the router's limit, at least 1 MiB. Requests between the
    two are read whole (bounded memory per call) so that the router can refuse and count them."""
    return max(4 * max_message_bytes, 1024 * 1024)


class MessageLimit(AioServerInterceptorBase):
    """Refuses a routed unary call whose request is over `limit` bytes, before any other
    interceptor or the forwarder sees it (see the module's docstring)."""

    def __init__(self, limit: int, metrics: RouterMetrics | None) -> None:
        self._limit = limit
        self._metrics = metrics
        #: method path -> (the handler wrapped, its wrapper): the forwarder's handlers never change.
        self._wrapped: dict[str, tuple[MethodHandler, MethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[MethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler:
        """The next handler, wrapped in the size check when it serves a routed unary method."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or method not in METHODS_BY_PATH:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapper = self._limited(method, handler)
        self._wrapped[method] = (handler, wrapper)
        return wrapper

    def _limited(self, method: str, handler: MethodHandler) -> MethodHandler:
        inner: Callable[[Any, Any], Any] | None = handler.unary_unary
        assert inner is not None  # intercept_service wraps unary-unary handlers only
        deserialize = handler.request_deserializer

        async def serve(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if len(raw) > self._limit:
                await self._refuse(method, len(raw), context, time.perf_counter())
            answer = inner(deserialize(raw) if deserialize is not None else raw, context)
            return await answer if inspect.isawaitable(answer) else answer

        # The request arrives as bytes (no deserializer) so that its size is known; the wrapped
        # handler's own deserializer runs after the check.
        return grpc.unary_unary_rpc_method_handler(serve, response_serializer=handler.response_serializer)

    async def _refuse(
        self, method: str, size: int, context: grpc.aio.ServicerContext[Any, Any], started: float
    ) -> None:
        # Timed from the behaviour's start, as the forwarder times a call: the message is in by then.
        if self._metrics is not None:
            self._metrics.observe(
                method,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                time.perf_counter() - started,
                shard=NO_SHARD,
                protocol=GRPC,
            )
        await abort_with_error_async(
            context,
            ResourceExhausted(
                f"the request message is {size} bytes, over the router's limit of {self._limit} bytes "
                "(max_message_bytes); send a smaller request",
                reason=REQUEST_TOO_LARGE,
            ),
        )


__all__ = ["REQUEST_TOO_LARGE", "MessageLimit", "grpc_receive_cap"]
