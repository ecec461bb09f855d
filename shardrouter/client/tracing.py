"""Spans of the caller library: one per operation sent, one CLIENT span per attempt.

A trace of one `send_with_retries` reads:

    shardrouter.client.operation   (INTERNAL: idempotency.key, operation.id, operation.kind, final outcome)
      TransferService/Transfer  attempt 1   (CLIENT: its traceparent goes to the router and shard)
      TransferService/Transfer  attempt 2   (linked to attempt 1: a retry of the same operation)

Every attempt carries the operation's `idempotency.key`, so a search by key finds every attempt of
one operation, across traces and restarts (`resume_pending` starts a new trace). Attempts after the
first carry a span link to the first, so a tracing UI can jump between the retries of one operation.

With no tracer provider given and none installed globally, `OperationTracer` does nothing at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from shardrouter.client.operation import Operation
from shardrouter.core import tracing
from shardrouter.core.wire_names import KEY_ATTRIBUTE

MetadataPairs = tuple[tuple[str, str], ...]


@dataclass
class AttemptSpans:
    """The spans of one operation being sent: the operation span and the attempts made so far."""

    tracer: trace.Tracer | None
    operation: Operation
    method: str
    _first_attempt: trace.SpanContext | None = field(default=None)
    _count: int = 0

    @contextmanager
    def attempt(self, metadata: MetadataPairs) -> Iterator[tuple[MetadataPairs, trace.Span]]:
        """A CLIENT span around one attempt; yields the metadata to send (with its traceparent)."""
        sent, span = self.start(metadata)
        with trace.use_span(span, end_on_exit=True):
            yield sent, span

    def start(self, metadata: MetadataPairs, *, hedge: bool = False) -> tuple[MetadataPairs, trace.Span]:
        """A CLIENT span for one attempt, started and not made current (the caller ends it: attempts
        of a hedged send run at once), and the metadata to send with its traceparent."""
        if self.tracer is None:
            return metadata, trace.INVALID_SPAN
        self._count += 1
        links: Sequence[Link] = (
            [Link(self._first_attempt, {"shardrouter.client.link": "first_attempt"})]
            if self._first_attempt is not None
            else []
        )
        span = self.tracer.start_span(
            self.method.lstrip("/"),
            kind=SpanKind.CLIENT,
            links=links,
            attributes={
                "rpc.system": "grpc",
                "rpc.method": self.method,
                KEY_ATTRIBUTE: self.operation.idempotency_key,
                "operation.id": self.operation.id,
                "shardrouter.client.attempt": self._count,
                "shardrouter.client.hedge": hedge,
            },
        )
        if self._first_attempt is None:
            self._first_attempt = span.get_span_context()
        context = trace.set_span_in_context(span)
        sent = tuple(
            (k, v) for k, v in tracing.inject_trace_context(metadata, context) if isinstance(v, str)
        )
        return sent, span


def record_attempt(span: trace.Span, code: grpc.StatusCode, message: str, *, replayed: bool) -> None:
    """The attempt's answer on its span: status code, and whether the shard replayed a stored answer."""
    tracing.set_rpc_status(span, code, server=False, message=message)
    span.set_attribute("idempotency.replayed", replayed)
    if replayed:
        span.add_event("idempotency.replay")


class OperationTracer:
    """Makes the spans of `send_with_retries`; a no-op while tracing is off."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        active = tracing.tracing_active(tracer_provider)
        self._tracer = tracing.get_tracer(tracer_provider) if active else None

    @contextmanager
    def operation(self, operation: Operation, method: str) -> Iterator[AttemptSpans]:
        """The operation span; attempts made through the yielded `AttemptSpans` are its children."""
        spans = AttemptSpans(self._tracer, operation, method)
        if self._tracer is None:
            yield spans
            return
        with self._tracer.start_as_current_span(
            "shardrouter.client.operation",
            kind=SpanKind.INTERNAL,
            attributes={
                KEY_ATTRIBUTE: operation.idempotency_key,
                "operation.id": operation.id,
                "operation.kind": str(operation.kind),
            },
        ):
            yield spans


def record_operation(state: str, attempts: int) -> None:
    """The operation's final state and attempt count on the current operation span."""
    span = trace.get_current_span()
    span.set_attribute("operation.state", state)
    span.set_attribute("shardrouter.client.attempts", attempts)


__all__ = ["AttemptSpans", "OperationTracer", "record_attempt", "record_operation"]
