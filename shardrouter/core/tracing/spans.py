"""Span conventions every process shares: the gRPC status on a span, RPC attributes and names,
untraced background polls and the one span of a background job that found work.

Background loops (the shard's outbox relay, metrics refresh, partition keeper) poll in `untraced()`,
so an idle poll leaves no span; a poll that finds work runs the job in one `background_job_span()`
(an INTERNAL root span) with its statements and calls beneath it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from shardrouter.core.tracing.provider import get_tracer

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


def rpc_attributes(full_method: str) -> dict[str, str]:
    """The semantic-convention attributes of a call to `full_method` (/package.Service/Method)."""
    service, _, method = full_method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def span_name(full_method: str) -> str:
    """The span name of a call to `full_method`: package.Service/Method."""
    return full_method.lstrip("/")


__all__ = [
    "SERVER_ERROR_CODES",
    "background_job_span",
    "rpc_attributes",
    "set_rpc_status",
    "span_name",
    "untraced",
]
