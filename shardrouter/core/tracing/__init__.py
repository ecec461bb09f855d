"""Tracing (OpenTelemetry, OTLP over gRPC) shared by every process, one module per concern:

- `provider`: the tracer provider from the `OTEL_*` environment (off unless asked for);
- `propagation`: W3C trace context in gRPC metadata;
- `spans`: span conventions (gRPC status, RPC attributes, background jobs, untraced polls);
- `server`: the SERVER span of every call, for the thread-pool and the asyncio servers;
- `client`: the CLIENT span of every outgoing call.

The names most callers need are importable from here (`from shardrouter.core import tracing`).
Metrics are in `shardrouter.core.metrics` (OpenTelemetry instruments read by the Prometheus reader).
"""

from shardrouter.core.tracing.client import TracingClientInterceptor, client_interceptor
from shardrouter.core.tracing.propagation import (
    MetadataEntry,
    extract_trace_context,
    inject_trace_context,
    span_context_of_traceparent,
    traceparent_of,
)
from shardrouter.core.tracing.provider import (
    TRACE_PROJECT,
    configure_tracing,
    exporters_from_env,
    force_flush,
    get_tracer,
    new_tracer_provider,
    shutdown_tracing,
    tracing_active,
)
from shardrouter.core.tracing.server import (
    AioTracingServerInterceptor,
    TracingServerInterceptor,
    aio_server_interceptor,
    server_interceptor,
)
from shardrouter.core.tracing.spans import (
    SERVER_ERROR_CODES,
    background_job_span,
    rpc_attributes,
    set_rpc_status,
    span_name,
    untraced,
)

__all__ = [
    "SERVER_ERROR_CODES",
    "TRACE_PROJECT",
    "AioTracingServerInterceptor",
    "MetadataEntry",
    "TracingClientInterceptor",
    "TracingServerInterceptor",
    "aio_server_interceptor",
    "background_job_span",
    "client_interceptor",
    "configure_tracing",
    "exporters_from_env",
    "extract_trace_context",
    "force_flush",
    "get_tracer",
    "inject_trace_context",
    "new_tracer_provider",
    "rpc_attributes",
    "server_interceptor",
    "set_rpc_status",
    "shutdown_tracing",
    "span_context_of_traceparent",
    "span_name",
    "traceparent_of",
    "tracing_active",
    "untraced",
]
