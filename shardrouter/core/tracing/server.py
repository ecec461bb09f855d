"""The SERVER span of every unary call, for the thread-pool server and the asyncio server alike.

Both interceptors share `_CallSpan`: the span is a child of the caller's `traceparent`, tagged with
the call's idempotency key, and its final status is read from the servicer context after the call,
which also sees `abort_with_status` (the OpenTelemetry gRPC instrumentation's interceptor misses that
one and reports every aborted call as OK). Put the interceptor first in the server's list, so the
spans the other interceptors make (idempotency, database) are its children.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from shardrouter.core.interceptors import MethodHandler, UnaryInterceptor, with_behaviour
from shardrouter.core.keys import KEY_METADATA
from shardrouter.core.tracing.propagation import MetadataEntry, extract_trace_context
from shardrouter.core.tracing.provider import get_tracer
from shardrouter.core.tracing.spans import rpc_attributes, set_rpc_status, span_name
from shardrouter.core.wire_names import KEY_ATTRIBUTE

if TYPE_CHECKING:
    AioServerInterceptorBase = grpc.aio.ServerInterceptor[Any, Any]
else:
    AioServerInterceptorBase = grpc.aio.ServerInterceptor

#: Methods the server interceptors do not trace by default (probes would flood the UI).
UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class _CallSpan:
    """How one traced method's calls get their SERVER span (shared by the sync and asyncio servers)."""

    def __init__(self, tracer: trace.Tracer, method: str) -> None:
        self._tracer = tracer
        self._name = span_name(method)
        self._attributes = rpc_attributes(method)

    @contextmanager
    def opened(self, metadata: Sequence[MetadataEntry]) -> Iterator[trace.Span]:
        """The call's span, current inside the block; its status is set by `finish`, never from an
        exception."""
        with self._tracer.start_as_current_span(
            self._name,
            context=extract_trace_context(metadata),
            kind=SpanKind.SERVER,
            attributes=self._attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            key = next((v for k, v in metadata if k == KEY_METADATA and isinstance(v, str)), None)
            if key is not None:
                span.set_attribute(KEY_ATTRIBUTE, key)
            yield span

    @staticmethod
    def finish(span: trace.Span, context: Any, error: BaseException | None = None) -> None:
        """The call's final status on `span`: the context's code (an abort), else OK, or for an
        exception that escaped the handler UNKNOWN (CANCELLED for a cancelled asyncio call)."""
        code = _context_code(context)
        if error is None:
            set_rpc_status(span, code or grpc.StatusCode.OK, server=True)
            return
        if code is None:  # not an abort
            if isinstance(error, Exception):
                span.record_exception(error)
                code = grpc.StatusCode.UNKNOWN
            else:
                code = grpc.StatusCode.CANCELLED
        set_rpc_status(span, code, server=True, message=_context_details(context))


class TracingServerInterceptor(UnaryInterceptor):
    """The SERVER span of every traced unary call of a `grpc.server`."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        untraced_prefixes: Sequence[str] = UNTRACED_PREFIXES,
    ) -> None:
        super().__init__()
        self._tracer = get_tracer(tracer_provider)
        self._untraced = tuple(untraced_prefixes)

    def applies_to(self, method: str) -> bool:
        """Every method but the untraced ones (health, reflection)."""
        return not method.startswith(self._untraced)

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The handler inside its SERVER span."""
        behaviour = handler.unary_unary
        assert behaviour is not None
        call_span = _CallSpan(self._tracer, method)

        def traced(request: Any, context: grpc.ServicerContext) -> Any:
            with call_span.opened(tuple(context.invocation_metadata())) as span:
                try:
                    response = behaviour(request, context)
                except BaseException as exc:
                    call_span.finish(span, context, exc)
                    raise
                call_span.finish(span, context)
                return response

        return with_behaviour(handler, traced)


class AioTracingServerInterceptor(AioServerInterceptorBase):
    """`TracingServerInterceptor` for `grpc.aio.server` (the router)."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        untraced_prefixes: Sequence[str] = UNTRACED_PREFIXES,
    ) -> None:
        self._tracer = get_tracer(tracer_provider)
        self._untraced = tuple(untraced_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[MethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler:
        """Wrap unary-unary handlers of traced methods; leave everything else alone."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or method.startswith(self._untraced):
            return handler
        behaviour = handler.unary_unary
        call_span = _CallSpan(self._tracer, method)

        async def traced(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with call_span.opened(tuple(context.invocation_metadata() or ())) as span:
                try:
                    response = behaviour(request, context)  # type: ignore[arg-type]
                    if inspect.isawaitable(response):
                        response = await response
                except BaseException as exc:
                    call_span.finish(span, context, exc)
                    raise
                call_span.finish(span, context)
                return response

        return with_behaviour(handler, traced)


def _context_code(context: Any) -> grpc.StatusCode | None:
    code = getattr(context, "code", None)
    value = code() if callable(code) else None
    return value if isinstance(value, grpc.StatusCode) else None


def _context_details(context: Any) -> str:
    details = getattr(context, "details", None)
    value = details() if callable(details) else None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else ""


def server_interceptor(tracer_provider: trace.TracerProvider | None = None) -> TracingServerInterceptor:
    """The tracing interceptor for a `grpc.server` (first in its interceptor list)."""
    return TracingServerInterceptor(tracer_provider)


def aio_server_interceptor(
    tracer_provider: trace.TracerProvider | None = None,
) -> AioTracingServerInterceptor:
    """The tracing interceptor for a `grpc.aio.server(interceptors=[...])` (the router)."""
    return AioTracingServerInterceptor(tracer_provider)


__all__ = [
    "UNTRACED_PREFIXES",
    "AioTracingServerInterceptor",
    "TracingServerInterceptor",
    "aio_server_interceptor",
    "server_interceptor",
]
