"""W3C trace context (`traceparent`, `tracestate`) carried in gRPC metadata, in and out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shardrouter.core.wire import MetadataEntry

TRACE_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})


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


__all__ = [
    "TRACE_HEADERS",
    "MetadataEntry",
    "extract_trace_context",
    "inject_trace_context",
    "span_context_of_traceparent",
    "traceparent_of",
]
