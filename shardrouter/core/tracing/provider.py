"""The process's tracer provider, from the standard `OTEL_*` environment variables; off unless asked.

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
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import Sampler

log = logging.getLogger(__name__)

#: Phoenix groups traces into projects by this resource attribute; one project holds every service,
#: so a trace that crosses caller, router and shard is found in one place.
PROJECT_ATTRIBUTE = "openinference.project.name"
TRACE_PROJECT = "shard-router"
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


__all__ = [
    "TRACE_PROJECT",
    "ServiceNameSpanProcessor",
    "configure_tracing",
    "exporters_from_env",
    "force_flush",
    "get_tracer",
    "new_tracer_provider",
    "shutdown_tracing",
    "tracing_active",
]
