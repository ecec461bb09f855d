"""The router's span for each forwarding attempt, between the caller's call and the shard's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from shardrouter.core.tracing import (
    MetadataEntry,
    extract_trace_context,
    get_tracer,
    inject_trace_context,
    rpc_attributes,
    set_rpc_status,
    span_name,
)


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
    attributes: dict[str, str] = rpc_attributes(method)
    if shard_id:
        attributes["shard.id"] = shard_id
    with get_tracer(tracer_provider).start_as_current_span(
        span_name(method), context=parent, kind=SpanKind.CLIENT, attributes=attributes
    ):
        yield inject_trace_context(entries)


def record_forwarded_status(code: grpc.StatusCode, message: str = "") -> None:
    """Record a forwarded call's status on the current (router) span."""
    set_rpc_status(trace.get_current_span(), code, server=False, message=message)


def record_move(*, reason: str, refused_by: str, redirect: bool, waited_s: float) -> None:
    """Mark the current (router) span as an attempt a shard's ownership refusal led to.

    `reason` is that refusal (ACCOUNT_MOVED, SLOT_RANGE_MOVING), `refused_by` the shard that gave it,
    `redirect` whether this attempt goes to another shard (else: the same one, after waiting for a
    cut-over to end), `waited_s` how long the call has waited for cut-overs so far.
    """
    span = trace.get_current_span()
    span.set_attribute("router.move.reason", reason)
    span.set_attribute("router.move.refused_by", refused_by)
    span.set_attribute("router.move.redirect", redirect)
    if waited_s > 0:
        span.set_attribute("router.move.waited_s", round(waited_s, 3))


__all__ = ["record_forwarded_status", "record_move", "router_span"]
