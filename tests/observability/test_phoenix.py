"""The local tracing UI end to end: a traced shard exports over OTLP/gRPC to a real Phoenix.

Slow (Phoenix takes ~20 s to start and needs the `tracing-ui` extra): run with --run-slow.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

from shardd.server import start_shard
from shardrouter import telemetry
from shardrouter.devcluster import tracing_ui
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.conftest import key_metadata, make_settings, money

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not tracing_ui.phoenix_installed(), reason="needs the tracing-ui extra (arize-phoenix)")
def test_phoenix_receives_the_replay_span(database: str, tmp_path: Path) -> None:
    phoenix = tracing_ui.launch_phoenix(tmp_path / "phoenix")
    try:
        assert phoenix.ui_url.startswith("http://127.0.0.1:")
        provider = telemetry.new_tracer_provider(
            "shardd/phoenix-test", [OTLPSpanExporter(endpoint=phoenix.otlp_endpoint, insecure=True)]
        )
        daemon = start_shard(make_settings(database, shard_id="shard-px"), tracer_provider=provider)
        md = key_metadata()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
                stub = transfer_pb2_grpc.TransferServiceStub(channel)
                request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
                stub.Deposit(request, metadata=md)
                stub.Deposit(request, metadata=md)
        finally:
            daemon.stop(0.5)
        provider.shutdown()  # flush the batch to Phoenix
        deadline = time.monotonic() + 30
        spans: list[dict[str, object]] = []
        while time.monotonic() < deadline and not spans:
            spans = tracing_ui.phoenix_spans(
                phoenix.ui_url, telemetry.TRACE_PROJECT, attributes={"idempotency.outcome": "replay"}
            )
            time.sleep(0.5)
        assert len(spans) == 1, spans
        span = spans[0]
        attrs = span["attributes"]
        assert isinstance(attrs, dict)
        assert attrs["idempotency.key"] == md[0][1]
        assert attrs["shard.id"] == "shard-px"
        assert attrs["service.name"] == "shardd/phoenix-test"
        assert span["status_code"] == "UNSET"
        events = span["events"]
        assert isinstance(events, list) and [e["name"] for e in events] == ["idempotency.replay"]
        first = tracing_ui.phoenix_spans(
            phoenix.ui_url, telemetry.TRACE_PROJECT, attributes={"idempotency.outcome": "new"}
        )
        assert [s["attributes"]["idempotency.key"] for s in first] == [md[0][1]]  # type: ignore[index]
    finally:
        phoenix.stop()
