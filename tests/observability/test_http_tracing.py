"""An HTTP call is the root of its trace: HTTP SERVER span -> router CLIENT span -> shard spans, with the
replay and the in-flight conflict tagged on the HTTP span as on the shard's."""

from __future__ import annotations

import http.client
import json

import yaml
from opentelemetry.trace import SpanKind

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings
from tests.observability.traced import Traced


def _post(port: int, path: str, body: dict, key: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", "Idempotency-Key": key}
        )
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_http_request_is_the_root_span_and_replays_are_tagged(traced: Traced, tmp_path) -> None:
    path = tmp_path / "shard-map.yaml"
    path.write_text(
        yaml.safe_dump(shard_map_document(even_shard_map({"shard-obs": f"127.0.0.1:{traced.daemon.port}"})))
    )
    settings = RouterSettings(
        listen="127.0.0.1:0", http_listen="127.0.0.1:0", shard_map=str(path), dev_mode=True, metrics_port=0
    )
    router = start_router_thread(settings, tracer_provider=traced.provider)
    try:
        key = str(new_key())
        body = {"accountId": "tia", "amount": {"amountMinor": "40", "currency": "EUR"}}
        assert _post(router.http_port, "/v1/deposits", body, key) == 201
        assert _post(router.http_port, "/v1/deposits", body, key) == 201
    finally:
        router.stop(1.0)
    https = traced.wait_for(lambda: traced.spans("POST /v1/deposits"), count=2)
    assert len(https) == 2
    by_id = {s.context.span_id: s for s in traced.exporter.get_finished_spans()}
    for span in https:
        assert span.kind is SpanKind.SERVER
        assert span.parent is None  # the root of its trace
        assert dict(span.attributes or {})["http.response.status_code"] == 201
    first, second = sorted(https, key=lambda s: s.start_time or 0)
    assert dict(first.attributes or {})["idempotency.outcome"] == "new"
    assert dict(second.attributes or {})["idempotency.outcome"] == "replay"
    assert [e.name for e in second.events] == ["idempotency.replay"]
    # The shard's idempotency span of the replay sits in the HTTP span's trace.
    shard_spans = [
        s
        for s in traced.wait_for(lambda: traced.spans(where={"idempotency.outcome": "replay"}), count=2)
        if s.context.trace_id == second.context.trace_id and s is not second
    ]
    assert shard_spans, "the shard's replay span is not in the HTTP request's trace"
    chain = shard_spans[0]
    while chain.parent is not None and chain.parent.span_id in by_id:
        chain = by_id[chain.parent.span_id]
    assert chain.context.span_id == second.context.span_id
