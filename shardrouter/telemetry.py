"""Tracing (OpenTelemetry, OTLP over gRPC) and metrics (Prometheus) shared by every process.

Tracing is driven by the standard `OTEL_*` environment variables and is off unless asked for:

- `OTEL_SDK_DISABLED=true` turns it off whatever else is set;
- `OTEL_TRACES_EXPORTER` is `otlp`, `console` or `none` (a comma list is allowed); unset, it is
  `otlp` when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, else `none`;
- `OTEL_EXPORTER_OTLP_ENDPOINT` (e.g. `http://127.0.0.1:4317`), `OTEL_EXPORTER_OTLP_HEADERS`, ... are
  read by the OTLP gRPC exporter itself, `OTEL_BSP_*` by the batch processor, `OTEL_TRACES_SAMPLER`
  by the provider;
- `OTEL_SERVICE_NAME` overrides the service name a process passes in.

With tracing off no SDK provider is installed: the API's no-op tracer answers, and the daemons do
not even add the tracing interceptor, so a call costs nothing extra.

Every span also carries `service.name` as a span attribute (`ServiceNameSpanProcessor`): Phoenix,
the local tracing UI, shows span attributes but not resource attributes.

Propagation is W3C trace context (`traceparent`, `tracestate`) in gRPC metadata:
`server_interceptor()` extracts it and opens the SERVER span of each call; `client_interceptor()`,
`inject_trace_context()` and `router_span()` put it on outgoing calls.

Background loops (the shard's outbox relay, metrics refresh, partition keeper) poll in `untraced()`,
so an idle poll leaves no span; a poll that finds work runs the job in one `background_job_span()`
(an INTERNAL root span) with its statements and calls beneath it.

Metrics are in `shardrouter.metrics` (OpenTelemetry instruments read by the Prometheus reader).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from shardrouter.grpcserver import MethodHandler, UnaryInterceptor, with_behaviour

if TYPE_CHECKING:
    ClientInterceptorBase = grpc.UnaryUnaryClientInterceptor[Any, Any]
    AioServerInterceptorBase = grpc.aio.ServerInterceptor[Any, Any]
else:
    ClientInterceptorBase = grpc.UnaryUnaryClientInterceptor
    AioServerInterceptorBase = grpc.aio.ServerInterceptor

log = logging.getLogger(__name__)

MetadataEntry = tuple[str, str | bytes]

#: Phoenix groups traces into projects by this resource attribute; one project holds every service,
#: so a trace that crosses caller, router and shard is found in one place.
PROJECT_ATTRIBUTE = "openinference.project.name"
TRACE_PROJECT = "shard-router"
TRACE_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})
#: A SERVER span is an error only for these codes (OpenTelemetry semantic conventions for gRPC):
#: ABORTED, FAILED_PRECONDITION, INVALID_ARGUMENT ... are the caller's business, not a failure here.
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
#: Methods the server interceptor does not trace by default (probes would flood the UI).
UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
TRACER_NAME = "shardrouter"

_TRUE = ("1", "true", "yes", "on")


class ServiceNameSpanProcessor(SpanProcessor):
    """Copies the service name onto every span as the `service.name` attribute."""

    def __init__(self, service_name: str) -> None:
        self._service_name = service_name

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Tag the span as it starts."""
        span.set_attribute(SERVICE_NAME, self._service_name)

    def on_end(self, span: ReadableSpan) -> None:
        """Nothing to do when a span ends."""

    def shutdown(self) -> None:
        """Nothing to release."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered."""
        return True


def exporters_from_env(env: Mapping[str, str] | None = None) -> list[str]:
    """The trace exporters the environment asks for: a subset of `otlp`, `console`; [] = tracing off."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return []
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        raw = "otlp" if endpoint else "none"
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in ("otlp", "console", "none")]
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER={raw!r}: unknown exporter(s) {', '.join(unknown)}; use otlp, console or none"
        )
    return [n for n in names if n != "none"]


def new_tracer_provider(
    service_name: str,
    exporters: Sequence[SpanExporter],
    *,
    batch: bool = True,
    sampler: Sampler | None = None,
) -> TracerProvider:
    """A tracer provider for `service_name` sending to `exporters` (not installed globally).

    Tests use this with an in-memory exporter and `batch=False`, and hand the provider to the code
    under test explicitly (the global provider can be set only once per process).
    """
    resource = Resource.create({SERVICE_NAME: service_name, PROJECT_ATTRIBUTE: TRACE_PROJECT})
    # No sampler given: the SDK's default, which reads OTEL_TRACES_SAMPLER(_ARG).
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(ServiceNameSpanProcessor(service_name))
    for exporter in exporters:
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
    return provider


def configure_tracing(service_name: str, *, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install the process's tracer provider as the environment asks; None when tracing is off.

    Safe to call twice: a provider installed before is returned as it is.
    """
    env = os.environ if env is None else env
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    names = exporters_from_env(env)
    if not names:
        return None
    exporters: list[SpanExporter] = []
    if "otlp" in names:
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol and protocol != "grpc":
            log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported here; exporting over gRPC", protocol)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if "console" in names:
        # stderr: stdout is the program's own output (the CLI's --json, say).
        exporters.append(ConsoleSpanExporter(out=sys.stderr))
    name = env.get("OTEL_SERVICE_NAME") or service_name
    provider = new_tracer_provider(name, exporters)
    trace.set_tracer_provider(provider)
    log.info("tracing on: service %s, exporters %s", name, ",".join(names))
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the global provider, if one is installed (call on graceful stop)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def force_flush(timeout_ms: int = 5000) -> None:
    """Export the spans still queued in the global provider, if one is installed."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(timeout_ms)


def tracing_active(tracer_provider: trace.TracerProvider | None = None) -> bool:
    """Whether spans would be recorded: a provider is given, or an SDK provider is installed."""
    if tracer_provider is not None:
        return True
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """Our tracer, from `tracer_provider` or the global one (a no-op while tracing is off)."""
    return trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)


def set_rpc_status(span: trace.Span, code: grpc.StatusCode, *, server: bool, message: str = "") -> None:
    """Record a call's final gRPC status on `span` (ERROR as the gRPC semantic conventions say)."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is grpc.StatusCode.OK:
        return
    if not server or code in SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, message or code.name))


@contextmanager
def untraced() -> Iterator[None]:
    """Run the block with instrumentation suppressed: no psycopg statement spans inside it.

    For the idle polls of background loops (the outbox relay, the metrics refresh, the partition
    keeper): a poll that finds nothing to do must not leave a root span per statement, which would
    bury the traces of real calls. Spans started explicitly with a tracer are not affected.
    """
    with suppress_instrumentation():
        yield


@contextmanager
def background_job_span(
    name: str,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Iterator[trace.Span]:
    """The one INTERNAL span of a background job that found work (a delivery, a partition creation).

    Current while the block runs, so the job's statement spans and the calls it makes (with
    `inject_trace_context`) are its children. An exception escaping the block marks it ERROR.
    """
    with get_tracer(tracer_provider).start_as_current_span(
        name, kind=SpanKind.INTERNAL, attributes=attributes
    ) as span:
        yield span


def _rpc_attributes(full_method: str) -> dict[str, str]:
    service, _, method = full_method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _span_name(full_method: str) -> str:
    return full_method.lstrip("/")


class _TextGetter:
    """Reads W3C trace headers from gRPC metadata (a sequence of pairs)."""

    def get(self, carrier: Sequence[MetadataEntry], key: str) -> list[str] | None:
        values = [v for k, v in carrier if k == key and isinstance(v, str)]
        return values or None

    def keys(self, carrier: Sequence[MetadataEntry]) -> list[str]:
        return [k for k, _ in carrier]


_GETTER = _TextGetter()
_W3C = TraceContextTextMapPropagator()


def extract_trace_context(metadata: Iterable[MetadataEntry]) -> Context:
    """The trace context a caller sent in `metadata` (an empty context when none)."""
    return propagate.extract(list(metadata), getter=_GETTER)  # type: ignore[arg-type]


def inject_trace_context(
    metadata: Iterable[MetadataEntry], context: Context | None = None
) -> list[MetadataEntry]:
    """`metadata` with the trace headers replaced by those of `context` (default: the current one).

    Every other entry keeps its place and value (duplicates included): the shard checks them.
    With no active span the old trace headers are kept as they are.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    entries = list(metadata)
    if not carrier:
        return entries
    kept = [(k, v) for k, v in entries if k not in TRACE_HEADERS]
    return kept + [(k.lower(), v) for k, v in carrier.items()]


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C traceparent naming `span` (None for a span that is not recording)."""
    context = span.get_span_context()
    if not span.is_recording() or not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def span_context_of_traceparent(value: str | None) -> trace.SpanContext | None:
    """The span a W3C traceparent names (None if absent or malformed)."""
    if not value:
        return None
    extracted = _W3C.extract({"traceparent": value})
    context = trace.get_current_span(extracted).get_span_context()
    return context if context.is_valid else None


@contextmanager
def _server_span(
    tracer: trace.Tracer, name: str, attributes: Mapping[str, str], metadata: Sequence[MetadataEntry]
) -> Iterator[trace.Span]:
    """The SERVER span of one call: a child of the caller's traceparent, tagged with its key.

    Its status is set by the caller of this (from the call's final code), never from an exception.
    """
    with tracer.start_as_current_span(
        name,
        context=extract_trace_context(metadata),
        kind=SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        key = next((v for k, v in metadata if k == "idempotency-key" and isinstance(v, str)), None)
        if key is not None:
            span.set_attribute("idempotency.key", key)
        yield span


class TracingServerInterceptor(UnaryInterceptor):
    """Opens the SERVER span of every unary call, as a child of the caller's `traceparent`.

    Put it first in the server's interceptor list, so the spans other interceptors make (the
    idempotency span, the database span) are its children. The final status is read from the
    servicer context after the call, which also sees `abort_with_status` (the OpenTelemetry gRPC
    instrumentation's interceptor misses that one and reports every aborted call as OK).
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        untraced_prefixes: Sequence[str] = UNTRACED_PREFIXES,
    ) -> None:
        self._tracer = get_tracer(tracer_provider)
        self._untraced = tuple(untraced_prefixes)

    def applies_to(self, method: str) -> bool:
        """Every method but the untraced ones (health, reflection)."""
        return not method.startswith(self._untraced)

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The handler inside its SERVER span."""
        behaviour = handler.unary_unary
        assert behaviour is not None
        tracer = self._tracer
        name = _span_name(method)
        attributes = _rpc_attributes(method)

        def traced(request: Any, context: grpc.ServicerContext) -> Any:
            with _server_span(tracer, name, attributes, tuple(context.invocation_metadata())) as span:
                try:
                    response = behaviour(request, context)
                except Exception as exc:
                    code = _context_code(context)
                    if code is None:  # not an abort: an exception escaped the handler
                        span.record_exception(exc)
                        code = grpc.StatusCode.UNKNOWN
                    set_rpc_status(span, code, server=True, message=_context_details(context))
                    raise
                set_rpc_status(span, _context_code(context) or grpc.StatusCode.OK, server=True)
                return response

        return with_behaviour(handler, traced)


def _context_code(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    code = getattr(context, "code", None)
    value = code() if callable(code) else None
    return value if isinstance(value, grpc.StatusCode) else None


def _context_details(context: grpc.ServicerContext) -> str:
    details = getattr(context, "details", None)
    value = details() if callable(details) else None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else ""


def server_interceptor(tracer_provider: trace.TracerProvider | None = None) -> TracingServerInterceptor:
    """The tracing interceptor for a `grpc.server` (first in its interceptor list)."""
    return TracingServerInterceptor(tracer_provider)


class AioTracingServerInterceptor(AioServerInterceptorBase):
    """`TracingServerInterceptor` for `grpc.aio.server`: the SERVER span of every unary call."""

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
        full_method = handler_call_details.method
        if handler is None or handler.unary_unary is None or full_method.startswith(self._untraced):
            return handler
        behaviour = handler.unary_unary
        tracer = self._tracer
        name = _span_name(full_method)
        attributes = _rpc_attributes(full_method)

        async def traced(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with _server_span(tracer, name, attributes, tuple(context.invocation_metadata() or ())) as span:
                try:
                    response = behaviour(request, context)  # type: ignore[arg-type]
                    if inspect.isawaitable(response):
                        response = await response
                except BaseException as exc:
                    code = _context_code(context)  # type: ignore[arg-type]
                    if code is None:  # not an abort: cancelled, or an exception escaped the handler
                        code = grpc.StatusCode.UNKNOWN
                        if isinstance(exc, Exception):
                            span.record_exception(exc)
                        else:
                            code = grpc.StatusCode.CANCELLED
                    set_rpc_status(span, code, server=True, message=_context_details(context))  # type: ignore[arg-type]
                    raise
                set_rpc_status(span, _context_code(context) or grpc.StatusCode.OK, server=True)  # type: ignore[arg-type]
                return response

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def aio_server_interceptor(
    tracer_provider: trace.TracerProvider | None = None,
) -> AioTracingServerInterceptor:
    """The tracing interceptor for a `grpc.aio.server(interceptors=[...])` (the router)."""
    return AioTracingServerInterceptor(tracer_provider)


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
            _span_name(method_text), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method_text)
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


@contextmanager
def router_span(
    method: str,
    metadata: Iterable[MetadataEntry],
    *,
    tracer_provider: trace.TracerProvider | None = None,
    shard_id: str = "",
) -> Iterator[list[MetadataEntry]]:
    """The router's CLIENT span for one forwarding attempt; yields the metadata to send on.

    The span is a child of the current span (the router's SERVER span when `server_interceptor()`
    serves the router) or, without one, of the `traceparent` in `metadata`. The yielded metadata
    carries this span's `traceparent`, so the shard's spans become its children. Record the
    shard's answer with `set_rpc_status(trace.get_current_span(), code, server=False)` or
    `record_forwarded_status(code)` inside the block.
    """
    entries = list(metadata)
    parent = None if trace.get_current_span().get_span_context().is_valid else extract_trace_context(entries)
    attributes: dict[str, str] = _rpc_attributes(method)
    if shard_id:
        attributes["shard.id"] = shard_id
    with get_tracer(tracer_provider).start_as_current_span(
        _span_name(method), context=parent, kind=SpanKind.CLIENT, attributes=attributes
    ):
        yield inject_trace_context(entries)


def record_forwarded_status(code: grpc.StatusCode, message: str = "") -> None:
    """Record a forwarded call's status on the current (router) span."""
    set_rpc_status(trace.get_current_span(), code, server=False, message=message)


__all__ = [
    "SERVER_ERROR_CODES",
    "TRACE_PROJECT",
    "AioTracingServerInterceptor",
    "ServiceNameSpanProcessor",
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
    "record_forwarded_status",
    "router_span",
    "server_interceptor",
    "set_rpc_status",
    "shutdown_tracing",
    "span_context_of_traceparent",
    "traceparent_of",
    "tracing_active",
    "untraced",
]
