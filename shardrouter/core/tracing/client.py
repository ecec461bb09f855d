"""The CLIENT span of each outgoing unary call, its `traceparent` injected into the call's metadata."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shardrouter.core.tracing.propagation import MetadataEntry, inject_trace_context
from shardrouter.core.tracing.provider import get_tracer
from shardrouter.core.tracing.spans import rpc_attributes, set_rpc_status, span_name

if TYPE_CHECKING:
    ClientInterceptorBase = grpc.UnaryUnaryClientInterceptor[Any, Any]
else:
    ClientInterceptorBase = grpc.UnaryUnaryClientInterceptor


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[MetadataEntry] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class TracingClientInterceptor(ClientInterceptorBase):
    """A CLIENT span per unary call, with its `traceparent` injected into the call's metadata.

    Use with `grpc.intercept_channel(channel, client_interceptor())`. Unlike the OpenTelemetry gRPC
    instrumentation's client interceptor, it keeps repeated metadata entries as they are.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = get_tracer(tracer_provider)

    def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Any],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        """Start the span, inject its context, end it when the call completes."""
        method = client_call_details.method
        method_text = method.decode() if isinstance(method, bytes) else str(method)
        span = self._tracer.start_span(
            span_name(method_text), kind=SpanKind.CLIENT, attributes=rpc_attributes(method_text)
        )
        metadata = inject_trace_context(
            client_call_details.metadata or (), context=trace.set_span_in_context(span)
        )
        details = _CallDetails(
            method_text,
            client_call_details.timeout,
            metadata,
            client_call_details.credentials,
            getattr(client_call_details, "wait_for_ready", None),
            getattr(client_call_details, "compression", None),
        )
        try:
            call = continuation(details, request)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise

        def done(finished: Any) -> None:
            code = finished.code()
            set_rpc_status(span, code, server=False, message=finished.details() or "")
            span.end()

        call.add_done_callback(done)
        return call


def client_interceptor(tracer_provider: trace.TracerProvider | None = None) -> TracingClientInterceptor:
    """The tracing interceptor for callers' channels: `grpc.intercept_channel(ch, client_interceptor())`."""
    return TracingClientInterceptor(tracer_provider)


__all__ = ["TracingClientInterceptor", "client_interceptor"]
