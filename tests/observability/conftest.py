"""Fixtures for the tracing and metrics tests: a shard daemon whose spans go to an in-memory exporter."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shardrouter.core.tracing import new_tracer_provider
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2_grpc
from tests.conftest import make_settings

SERVICE = "shardd/obs-test"


@dataclass
class Traced:
    """A traced shard: its daemon, a stub, the provider and the exporter holding finished spans."""

    daemon: ShardDaemon
    stub: transfer_pb2_grpc.TransferServiceStub
    channel: grpc.Channel
    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self, name: str | None = None, where: dict[str, object] | None = None) -> list[ReadableSpan]:
        """Finished spans, optionally by name and attribute values."""
        found = []
        for span in self.exporter.get_finished_spans():
            if name is not None and span.name != name:
                continue
            attrs = dict(span.attributes or {})
            if all(attrs.get(k) == v for k, v in (where or {}).items()):
                found.append(span)
        return found

    def wait_for(self, predicate: Callable[[], list[ReadableSpan]], count: int = 1) -> list[ReadableSpan]:
        """Poll until `predicate` returns at least `count` spans (server spans end on server threads)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            got = predicate()
            if len(got) >= count:
                return got
            time.sleep(0.01)
        return predicate()


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
