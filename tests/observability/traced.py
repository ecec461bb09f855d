"""A shard daemon traced into memory (the `traced` fixture of `tests/observability/conftest.py`):
its service name, and the `Traced` bundle tests look spans up in."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shardrouter.shardd.server import ShardDaemon
from shardrouter.v1 import transfer_pb2_grpc

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


__all__ = ["SERVICE", "Traced"]
