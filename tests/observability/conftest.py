"""Fixtures for the tracing and metrics tests: a shard daemon whose spans go to an in-memory exporter."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shardrouter.core.tracing import new_tracer_provider
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2_grpc
from tests.helpers import make_settings
from tests.observability.traced import SERVICE, Traced


@pytest.fixture
def traced(database: str) -> Iterator[Traced]:
    """A shard daemon with tracing on, its spans in memory (exported synchronously)."""
    exporter = InMemorySpanExporter()
    provider = new_tracer_provider(SERVICE, [exporter], batch=False)
    daemon = start_shard(make_settings(database, shard_id="shard-obs"), tracer_provider=provider)
    channel = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
    try:
        yield Traced(daemon, transfer_pb2_grpc.TransferServiceStub(channel), channel, provider, exporter)
    finally:
        channel.close()
        daemon.stop(0.5)
        provider.shutdown()
