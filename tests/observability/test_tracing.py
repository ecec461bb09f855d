"""Spans of the idempotency interceptor and trace propagation, against a real shard and PostgreSQL.

Each outcome (new, replay, in-flight conflict, key reuse, transient failure) must give the
`idempotency` span its attributes, events and status; caller, router and shard spans must share
one trace.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import grpc
import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from shardrouter.core import tracing
from shardrouter.router import tracing as router_tracing
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import deposit, key_metadata, money
from tests.observability.traced import SERVICE, Traced

DEPOSIT = "/shardrouter.v1.TransferService/Deposit"


def _deposit(amount: int = 5, account: str = "alice") -> transfer_pb2.DepositRequest:
    return transfer_pb2.DepositRequest(account_id=account, amount=money(amount))


def _idem(traced: Traced, key: str, count: int = 1) -> list[ReadableSpan]:
    spans = traced.wait_for(lambda: traced.spans("idempotency", {"idempotency.key": key}), count)
    assert len(spans) == count, [dict(s.attributes or {}) for s in traced.spans("idempotency")]
    return sorted(spans, key=lambda s: s.start_time or 0)


def _events(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


def _parent_of(traced: Traced, span: ReadableSpan) -> ReadableSpan:
    assert span.parent is not None, f"{span.name} has no parent"
    by_id = {s.context.span_id: s for s in traced.exporter.get_finished_spans()}
    return by_id[span.parent.span_id]


def test_first_call_then_replay(traced: Traced, db) -> None:
    md = key_metadata()
    key = md[0][1]
    traced.stub.Deposit(_deposit(), metadata=md)
    traced.stub.Deposit(_deposit(), metadata=md)
    first, replay = _idem(traced, key, 2)

    for span in (first, replay):
        attrs = dict(span.attributes or {})
        assert attrs["idempotency.scope"] == f"{DEPOSIT}|anonymous"
        assert attrs["rpc.method"] == DEPOSIT
        assert attrs["shard.id"] == "shard-obs"
        assert attrs["service.name"] == SERVICE
        assert attrs["rpc.grpc.status_code"] == 0
    assert first.attributes["idempotency.outcome"] == "new"  # type: ignore[index]
    assert replay.attributes["idempotency.outcome"] == "replay"  # type: ignore[index]
    assert _events(first) == []
    assert _events(replay) == ["idempotency.replay"]
    # The replay links to the span of the attempt that claimed the key (its traceparent is stored).
    assert first.links == ()
    assert [(link.context.trace_id, link.context.span_id) for link in replay.links] == [
        (first.context.trace_id, first.context.span_id)
    ]
    assert replay.attributes is not None
    assert replay.attributes["idempotency.first_trace_id"] == format(first.context.trace_id, "032x")
    (stored,) = db.execute(
        "SELECT first_traceparent FROM idempotency_record WHERE key = %s", (str(key),)
    ).fetchone()
    flags = int(first.context.trace_flags)
    assert stored == f"00-{first.context.trace_id:032x}-{first.context.span_id:016x}-{flags:02x}"
    event = replay.events[0]
    assert event.attributes is not None and event.attributes["idempotency.stored_status_code"] == 0
    # A replay is not an error.
    assert first.status.status_code is StatusCode.UNSET
    assert replay.status.status_code is StatusCode.UNSET

    # The idempotency span is the child of the gRPC SERVER span; the database span its child.
    for span in (first, replay):
        server = _parent_of(traced, span)
        assert server.kind is SpanKind.SERVER
        assert server.name == DEPOSIT.lstrip("/")
        assert server.attributes is not None and server.attributes["idempotency.key"] == key
        assert server.context.trace_id == span.context.trace_id
    db_spans = [
        s for s in traced.spans("db.transaction") if s.parent and s.parent.span_id == first.context.span_id
    ]
    assert len(db_spans) == 1
    assert db_spans[0].attributes is not None and db_spans[0].attributes["db.system"] == "postgresql"
    assert db_spans[0].status.status_code is StatusCode.UNSET

    # Statement spans from OpenTelemetry's psycopg instrumentation, under the transaction span: the SQL
    # text with its placeholders, never the values.
    def statements(transaction: ReadableSpan) -> list[str]:
        return [
            str((s.attributes or {}).get("db.statement", ""))
            for s in sorted(traced.exporter.get_finished_spans(), key=lambda s: s.start_time or 0)
            if s.parent is not None and s.parent.span_id == transaction.context.span_id
        ]

    first_sql = statements(db_spans[0])
    # A new key's claim goes ahead of the handler, in its pipeline: the claim with the bounds, the
    # statement that stops the pipeline unless the claim took the key, BEGIN, the handler (a Deposit is
    # one statement); then the completed record, stored by the statement that releases the key at the
    # COMMIT, and the COMMIT.
    assert first.attributes["idempotency.claim"] == "ahead"  # type: ignore[index]
    expected = [
        "SELECT c.*, set_config('shardrouter.key_claimed'",
        "SELECT CASE WHEN current_setting('shardrouter.key_claimed')",
        "BEGIN",
        "WITH account AS ( INSERT INTO accounts",
        "WITH stored AS (INSERT INTO idempotency_record",
        "COMMIT",
    ]
    assert len(first_sql) == len(expected), first_sql
    assert all(q.startswith(prefix) for q, prefix in zip(first_sql, expected, strict=True)), first_sql
    assert "pg_try_advisory_lock(" in first_sql[0] and "set_config('lock_timeout'" in first_sql[0], first_sql
    assert "INSERT INTO ledger_entries" in first_sql[3], first_sql
    assert all(q and key not in q for q in first_sql), first_sql
    # This process completed the key, so it replays from memory: no database transaction at all.
    assert replay.attributes["idempotency.record_source"] == "memory"
    assert not [
        s for s in traced.spans("db.transaction") if s.parent and s.parent.span_id == replay.context.span_id
    ]


def test_in_flight_duplicate_is_a_conflict_not_an_error(traced: Traced, database: str) -> None:
    deposit(traced.stub, "alice", 100)
    md = key_metadata()
    key = uuid.UUID(md[0][1])
    scope = f"{DEPOSIT}|anonymous"
    # Hold the key as an in-flight first attempt would (as in test_interceptor_outcomes).
    holder = psycopg.connect(database)
    try:
        holder.execute(
            "INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state)"
            " VALUES (%s, %s, %s, 'x', '\\x00', 'in_progress')",
            (scope, key, datetime.fromtimestamp((key.int >> 80) / 1000, UTC)),
        )
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{scope} {key}",))
        with pytest.raises(grpc.RpcError) as info:
            traced.stub.Deposit(_deposit(), metadata=md)
        assert info.value.code() is grpc.StatusCode.ABORTED
    finally:
        holder.rollback()
        holder.close()

    (span,) = _idem(traced, str(key))
    assert span.attributes is not None
    assert span.attributes["idempotency.outcome"] == "in_flight"
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.ABORTED.value[0]
    assert _events(span) == ["idempotency.conflict"]
    assert span.events[0].attributes is not None
    assert span.events[0].attributes["idempotency.retry_after_ms"] == 100
    assert span.status.status_code is StatusCode.UNSET
    server = _parent_of(traced, span)
    assert server.attributes is not None and server.attributes["rpc.grpc.status_code"] == 10
    assert server.status.status_code is StatusCode.UNSET  # ABORTED is the caller's to retry


def test_key_reused_for_a_different_request(traced: Traced) -> None:
    md = key_metadata()
    traced.stub.Deposit(_deposit(5), metadata=md)
    with pytest.raises(grpc.RpcError) as info:
        traced.stub.Deposit(_deposit(6), metadata=md)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    first, reused = _idem(traced, md[0][1], 2)
    assert first.attributes is not None and first.attributes["idempotency.outcome"] == "new"
    assert reused.attributes is not None and reused.attributes["idempotency.outcome"] == "key_reused"
    assert _events(reused) == ["idempotency.key_reused"]
    assert reused.events[0].attributes is not None
    assert reused.events[0].attributes["idempotency.first_method"] == DEPOSIT
    assert reused.status.status_code is StatusCode.UNSET


@pytest.mark.parametrize("placement", ["first", "ahead"])
def test_replay_from_the_database_is_one_read_only_transaction(database: str, placement: str) -> None:
    """Without the in-memory record (another process completed the key, or this one restarted), a
    replay reads the record in one transaction that writes nothing and takes no lock: with the claim
    sent first, one statement; with it sent ahead, the handler's statements go with it, and the
    database skips them (the span says which)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shardrouter.shardd.server import start_shard
    from tests.helpers import make_settings

    exporter = InMemorySpanExporter()
    provider = tracing.new_tracer_provider(SERVICE, [exporter], batch=False)
    settings = make_settings(database, replay_cache_entries=0, claim_placement=placement)
    daemon = start_shard(settings, tracer_provider=provider)
    md = key_metadata()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            stub.Deposit(_deposit(), metadata=md)
            stub.Deposit(_deposit(), metadata=md)
    finally:
        daemon.stop(0.5)
    provider.force_flush()
    spans = exporter.get_finished_spans()
    replay = next(
        s
        for s in spans
        if s.name == "idempotency" and (s.attributes or {}).get("idempotency.outcome") == "replay"
    )
    assert replay.attributes is not None and replay.attributes["idempotency.record_source"] == "database"
    (transaction,) = [
        s for s in spans if s.name == "db.transaction" and s.parent.span_id == replay.context.span_id
    ]  # type: ignore[union-attr]
    sql = [
        str((s.attributes or {}).get("db.statement", ""))
        for s in spans
        if s.parent is not None and s.parent.span_id == transaction.context.span_id
    ]
    assert replay.attributes["idempotency.claim"] == placement
    if placement == "first":
        assert sql and all(not q.startswith(("INSERT", "UPDATE", "DELETE")) for q in sql), sql
        assert len([q for q in sql if q.startswith("SELECT")]) == 1, sql
    else:
        assert sql[0].startswith("SELECT c.*, set_config('shardrouter.key_claimed'"), sql
        assert sql[1].startswith("SELECT CASE WHEN current_setting('shardrouter.key_claimed')"), sql
        assert sql[2] == "BEGIN", sql
        # The handler's statement, the record's and the COMMIT follow (the Deposit builds its answer
        # in the database, so nothing waits for a result before the Sync), unless psycopg had
        # already read the database's refusal when one was sent (then it raises before sending).
        # The database skips all three.
        sent_after = [q.split(" (", 1)[0] for q in sql[3:]]
        assert sent_after == ["WITH account AS", "WITH stored AS", "COMMIT"][: len(sent_after)], sql
    # Whatever was sent, the database applied the Deposit once and took no lock that outlived the call.
    with psycopg.connect(database, autocommit=True) as check:
        (entries,) = check.execute(
            "SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (md[0][1],)
        ).fetchone()  # type: ignore[misc]
        (locks,) = check.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
            " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
        ).fetchone()  # type: ignore[misc]
    assert (entries, locks) == (1, 0)


def test_transient_failure_is_an_error(database: str) -> None:
    """A handler that cannot get a row lock in time: UNAVAILABLE, and the spans say ERROR."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shardrouter.shardd.server import start_shard
    from tests.helpers import make_settings

    exporter = InMemorySpanExporter()
    provider = tracing.new_tracer_provider(SERVICE, [exporter], batch=False)
    daemon = start_shard(make_settings(database, handler_lock_timeout_ms=100), tracer_provider=provider)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            deposit(stub, "alice", 100)
            md = key_metadata()
            with psycopg.connect(database) as holder:
                holder.execute("SELECT 1 FROM accounts WHERE id = 'alice' FOR UPDATE")
                with pytest.raises(grpc.RpcError) as info:
                    stub.Deposit(_deposit(), metadata=md)
                holder.rollback()
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        daemon.stop(0.5)
    provider.force_flush()
    spans = exporter.get_finished_spans()
    (idem,) = [
        s
        for s in spans
        if s.name == "idempotency" and (s.attributes or {}).get("idempotency.key") == md[0][1]
    ]
    assert idem.attributes is not None and idem.attributes["idempotency.outcome"] == "error"
    assert idem.status.status_code is StatusCode.ERROR
    (db_span,) = [
        s
        for s in spans
        if s.name == "db.transaction" and s.parent and s.parent.span_id == idem.context.span_id
    ]
    assert db_span.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in db_span.events)
    (server,) = [s for s in spans if idem.parent and s.context.span_id == idem.parent.span_id]
    assert server.status.status_code is StatusCode.ERROR  # UNAVAILABLE is a server failure
    provider.shutdown()


def test_caller_span_and_shard_spans_share_one_trace(traced: Traced) -> None:
    tracer = traced.provider.get_tracer("test-caller")
    md = key_metadata()
    with tracer.start_as_current_span("caller.transfer", kind=SpanKind.CLIENT) as caller:
        sent = tracing.inject_trace_context(md)
        traced.stub.Deposit(_deposit(), metadata=sent)
    assert [k for k, _ in sent].count("traceparent") == 1
    assert sent[0] == md[0], "the other entries keep their place"
    (idem,) = _idem(traced, md[0][1])
    trace_id = caller.get_span_context().trace_id
    server = _parent_of(traced, idem)
    assert server.context.trace_id == trace_id
    assert idem.context.trace_id == trace_id
    assert server.parent is not None and server.parent.span_id == caller.get_span_context().span_id
    assert server.parent.is_remote
    db_spans = [s for s in traced.spans("db.transaction") if s.context.trace_id == trace_id]
    assert db_spans, "the database span is in the caller's trace too"


def test_client_interceptor_makes_the_parent_span(traced: Traced) -> None:
    channel = grpc.intercept_channel(traced.channel, tracing.client_interceptor(traced.provider))
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    md = key_metadata()
    stub.Deposit(_deposit(), metadata=md)
    with pytest.raises(grpc.RpcError):
        stub.Deposit(_deposit(7), metadata=md)  # key reused
    clients = traced.wait_for(
        lambda: [s for s in traced.spans(DEPOSIT.lstrip("/")) if s.kind is SpanKind.CLIENT], 2
    )
    assert len(clients) == 2
    first_client, failed_client = sorted(clients, key=lambda s: s.start_time or 0)
    first, _ = _idem(traced, md[0][1], 2)
    server = _parent_of(traced, first)
    assert server.parent is not None and server.parent.span_id == first_client.context.span_id
    assert first_client.status.status_code is StatusCode.UNSET
    # On the client side any non-OK answer is an error (gRPC semantic conventions).
    assert failed_client.status.status_code is StatusCode.ERROR
    assert failed_client.attributes is not None
    assert failed_client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.FAILED_PRECONDITION.value[0]


def test_router_span_sits_between_caller_and_shard(traced: Traced) -> None:
    tracer = traced.provider.get_tracer("test-caller")
    md = key_metadata()
    with tracer.start_as_current_span("caller") as caller:
        incoming = tracing.inject_trace_context(md)
    # The router gets the caller's metadata on another thread, with no current span of its own.
    assert not trace.get_current_span().get_span_context().is_valid
    with router_tracing.router_span(
        DEPOSIT, incoming, tracer_provider=traced.provider, shard_id="shard-obs"
    ) as out:
        traced.stub.Deposit(_deposit(), metadata=out)
        router_tracing.record_forwarded_status(grpc.StatusCode.OK)
    (router,) = traced.spans(DEPOSIT.lstrip("/"), {"shard.id": "shard-obs"})
    assert router.kind is SpanKind.CLIENT
    assert router.parent is not None and router.parent.span_id == caller.get_span_context().span_id
    (idem,) = _idem(traced, md[0][1])
    server = _parent_of(traced, idem)
    assert server.parent is not None and server.parent.span_id == router.context.span_id
    assert {router.context.trace_id, server.context.trace_id, idem.context.trace_id} == {
        caller.get_span_context().trace_id
    }


def test_inject_keeps_duplicates_and_replaces_old_trace_headers() -> None:
    provider = tracing.new_tracer_provider("t", [], batch=False)
    md = [
        ("idempotency-key", "a"),
        ("idempotency-key", "b"),
        ("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),
    ]
    with provider.get_tracer("t").start_as_current_span("s") as span:
        out = tracing.inject_trace_context(md)
    assert out[:2] == md[:2]
    parents = [v for k, v in out if k == "traceparent"]
    assert len(parents) == 1
    context = span.get_span_context()
    assert parents[0].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    # Without an active span the metadata is left as it is.
    assert tracing.inject_trace_context(md) == md


def test_exporters_from_env() -> None:
    assert tracing.exporters_from_env({}) == []
    assert tracing.exporters_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}) == ["otlp"]
    assert tracing.exporters_from_env({"OTEL_TRACES_EXPORTER": "console,otlp"}) == ["console", "otlp"]
    assert (
        tracing.exporters_from_env({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == []
    )
    disabled = {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}
    assert tracing.exporters_from_env(disabled) == []
    with pytest.raises(ValueError, match="zipkin"):
        tracing.exporters_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_tracing_off_installs_nothing_and_the_shard_serves_without_the_interceptor(stub, shard, db) -> None:
    assert tracing.configure_tracing("shardd/test", env={}) is None
    assert not tracing.tracing_active()
    interceptors = shard.server._state.interceptor_pipeline.interceptors  # type: ignore[attr-defined]
    assert not any(isinstance(i, tracing.TracingServerInterceptor) for i in interceptors)
    md = key_metadata()
    reply = stub.Deposit(_deposit(9), metadata=md)
    assert reply.balance.amount_minor == 9
    (stored,) = db.execute(
        "SELECT first_traceparent FROM idempotency_record WHERE key = %s", (md[0][1],)
    ).fetchone()
    assert stored is None


def test_aio_router_spans_caller_router_and_shard_in_one_trace(traced: Traced) -> None:
    """A grpc.aio forwarder like the router's: SERVER span (aio interceptor), CLIENT span per
    forwarding attempt (router_span), then the shard's spans, all children in one trace."""
    import asyncio

    shard_address = f"127.0.0.1:{traced.daemon.port}"
    provider = traced.provider

    async def forward(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        incoming = tuple(context.invocation_metadata() or ())
        outgoing = [(k, v) for k, v in incoming if k in ("idempotency-key", "traceparent", "tracestate")]
        async with grpc.aio.insecure_channel(shard_address) as channel:
            call = channel.unary_unary(DEPOSIT)
            with router_tracing.router_span(
                DEPOSIT, outgoing, tracer_provider=provider, shard_id="shard-obs"
            ) as md:
                try:
                    reply: bytes = await call(raw, metadata=tuple(md))
                except grpc.aio.AioRpcError as error:
                    router_tracing.record_forwarded_status(error.code())
                    await context.abort(error.code(), error.details() or "")
                router_tracing.record_forwarded_status(grpc.StatusCode.OK)
        return reply

    async def refuse(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "shard unreachable")
        raise AssertionError("unreachable")

    handlers = {
        "Deposit": grpc.unary_unary_rpc_method_handler(forward),
        "Refuse": grpc.unary_unary_rpc_method_handler(refuse),
    }
    caller_tracer = provider.get_tracer("test-caller")
    md = key_metadata()

    async def scenario() -> trace.Span:
        server = grpc.aio.server(interceptors=[tracing.aio_server_interceptor(provider)])
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("shardrouter.v1.TransferService", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                body = _deposit().SerializeToString()
                with caller_tracer.start_as_current_span("caller", kind=SpanKind.CLIENT) as caller:
                    await channel.unary_unary(DEPOSIT)(body, metadata=tuple(tracing.inject_trace_context(md)))
                    await channel.unary_unary(DEPOSIT)(body, metadata=tuple(tracing.inject_trace_context(md)))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary("/shardrouter.v1.TransferService/Refuse")(body)
                assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)
        return caller

    caller = asyncio.run(scenario())
    trace_id = caller.get_span_context().trace_id
    first, replay = _idem(traced, md[0][1], 2)
    assert replay.attributes is not None and replay.attributes["idempotency.outcome"] == "replay"
    for idem in (first, replay):
        shard_server = _parent_of(traced, idem)
        router_client = _parent_of(traced, shard_server)
        router_server = _parent_of(traced, router_client)
        assert (shard_server.kind, router_client.kind, router_server.kind) == (
            SpanKind.SERVER,
            SpanKind.CLIENT,
            SpanKind.SERVER,
        )
        assert router_client.attributes is not None and router_client.attributes["shard.id"] == "shard-obs"
        assert router_server.parent is not None
        assert router_server.parent.span_id == caller.get_span_context().span_id
        assert {idem.context.trace_id, shard_server.context.trace_id, router_server.context.trace_id} == {
            trace_id
        }
        assert router_server.status.status_code is StatusCode.UNSET
    (refused,) = traced.spans("shardrouter.v1.TransferService/Refuse")
    assert refused.kind is SpanKind.SERVER
    assert refused.attributes is not None and refused.attributes["rpc.grpc.status_code"] == 14
    assert refused.status.status_code is StatusCode.ERROR


def test_expired_and_invalid_keys_are_refusals_not_errors(traced: Traced) -> None:
    from shardrouter.core.keys import new_key

    old = new_key(int((datetime.now(UTC).timestamp() - 60 * 86400) * 1000))
    with pytest.raises(grpc.RpcError) as info:
        traced.stub.Deposit(_deposit(), metadata=[("idempotency-key", str(old))])
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    (expired,) = _idem(traced, str(old))
    assert expired.attributes is not None and expired.attributes["idempotency.outcome"] == "expired"
    assert expired.status.status_code is StatusCode.UNSET
    with pytest.raises(grpc.RpcError):
        traced.stub.Deposit(_deposit(), metadata=[("idempotency-key", "not a key")])
    invalid = traced.wait_for(lambda: traced.spans("idempotency", {"idempotency.outcome": "invalid"}))
    assert len(invalid) == 1
    assert "idempotency.key" not in (invalid[0].attributes or {})
    assert invalid[0].status.status_code is StatusCode.UNSET


def _router_for(traced: Traced, tmp_path):
    """The real router (grpc.aio, in a thread) in front of the traced shard, tracing to the same provider."""
    import yaml

    from shardrouter.core.shardmap import even_shard_map, shard_map_document
    from shardrouter.router.server import start_router_thread
    from shardrouter.router.settings import RouterSettings

    path = tmp_path / "shard-map.yaml"
    path.write_text(
        yaml.safe_dump(shard_map_document(even_shard_map({"shard-obs": f"127.0.0.1:{traced.daemon.port}"})))
    )
    settings = RouterSettings(listen="127.0.0.1:0", shard_map=str(path), dev_mode=True, metrics_port=0)
    return start_router_thread(settings, tracer_provider=traced.provider)


def _chain(traced: Traced, span: ReadableSpan) -> list[ReadableSpan]:
    """`span` and its ancestors, innermost first."""
    by_id = {s.context.span_id: s for s in traced.exporter.get_finished_spans()}
    chain = [span]
    while chain[-1].parent is not None and chain[-1].parent.span_id in by_id:
        chain.append(by_id[chain[-1].parent.span_id])
    return chain


def test_caller_library_router_and_shard_in_one_trace_with_linked_retries(
    traced: Traced, database: str, tmp_path
) -> None:
    """Real caller library -> real router -> shard: a conflict, its retry, then a replay.

    The first attempt meets an in-flight holder of the key (ABORTED), the library retries after the
    RetryInfo delay and the key is new by then; a second send replays. Every attempt's chain is
    caller operation -> caller attempt -> router SERVER -> router CLIENT -> shard SERVER ->
    idempotency, in one trace; the retry links to the first attempt.
    """
    import threading

    from shardrouter.client import SqliteOperationStore, TransferClient

    router = _router_for(traced, tmp_path)
    store = SqliteOperationStore(str(tmp_path / "ops.db"))
    client = TransferClient(
        f"127.0.0.1:{router.port}", store=store, caller_id="billing", tracer_provider=traced.provider
    )
    holder = psycopg.connect(database)
    try:
        op = client.create_deposit("alice", 500, "EUR")
        key = uuid.UUID(op.idempotency_key)
        scope = f"{DEPOSIT}|billing"
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{scope} {key}",))
        released = threading.Timer(0.3, holder.rollback)
        released.start()
        first = client.send_with_retries(op, attempt_timeout_s=2.0, budget_s=10.0)
        released.join()
        assert first.ok and not first.replayed and first.attempts >= 2
        again = client.send_with_retries(op)
        assert again.ok and again.replayed
    finally:
        holder.close()
        client.close()
        router.stop(0.5)

    idem = _idem(traced, str(key), first.attempts + 1)
    outcomes = [s.attributes["idempotency.outcome"] for s in idem]  # type: ignore[index]
    assert outcomes == ["in_flight"] * (first.attempts - 1) + ["new", "replay"]
    chains = [_chain(traced, s) for s in idem]
    for chain in chains:
        names = [(s.name, s.kind) for s in chain]
        assert names == [
            ("idempotency", SpanKind.INTERNAL),
            ("shardrouter.v1.TransferService/Deposit", SpanKind.SERVER),  # shard
            ("shardrouter.v1.TransferService/Deposit", SpanKind.CLIENT),  # router -> shard
            ("shardrouter.v1.TransferService/Deposit", SpanKind.SERVER),  # router
            ("shardrouter.v1.TransferService/Deposit", SpanKind.CLIENT),  # caller attempt
            ("shardrouter.client.operation", SpanKind.INTERNAL),
        ], names
        assert len({s.context.trace_id for s in chain}) == 1
        assert chain[2].attributes is not None and chain[2].attributes["shard.id"] == "shard-obs"
        for span in chain[1:]:
            assert span.attributes is not None and span.attributes.get("idempotency.key", str(key)) == str(
                key
            )
    # One trace per send: the conflict and its retry share the first operation span.
    first_send = {c[-1].context.span_id for c in chains[:-1]}
    assert len(first_send) == 1
    assert chains[-1][-1].context.span_id not in first_send
    attempts = [c[4] for c in chains[:-1]]
    assert attempts[0].links == ()
    for number, retry in enumerate(attempts[1:], start=2):
        assert [link.context.span_id for link in retry.links] == [attempts[0].context.span_id]
        assert dict(retry.links[0].attributes or {}) == {"shardrouter.client.link": "first_attempt"}
        assert retry.attributes is not None and retry.attributes["shardrouter.client.attempt"] == number
    # The caller's side: the conflict is an error there (to retry), the replay is tagged.
    assert attempts[0].status.status_code is StatusCode.ERROR
    replay_attempt = chains[-1][4]
    assert replay_attempt.attributes is not None and replay_attempt.attributes["idempotency.replayed"] is True
    assert [e.name for e in replay_attempt.events] == ["idempotency.replay"]
    operation = chains[-1][-1]
    assert operation.attributes is not None and operation.attributes["operation.state"] == "succeeded"
    assert operation.attributes["shardrouter.client.attempts"] == again.attempts
    first_operation = chains[0][-1]
    assert first_operation.attributes is not None
    assert first_operation.attributes["shardrouter.client.attempts"] == first.attempts


def test_statement_spans_can_be_switched_off(database: str) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shardrouter.shardd.server import start_shard
    from tests.helpers import make_settings

    exporter = InMemorySpanExporter()
    provider = tracing.new_tracer_provider("shardd/no-sql", [exporter], batch=False)
    daemon = start_shard(make_settings(database, trace_statements=False), tracer_provider=provider)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            transfer_pb2_grpc.TransferServiceStub(channel).Deposit(_deposit(), metadata=key_metadata())
    finally:
        daemon.stop(0.5)
        provider.shutdown()
    names = [s.name for s in exporter.get_finished_spans()]
    assert "idempotency" in names and "db.transaction" in names, names
    assert not [s for s in exporter.get_finished_spans() if "db.statement" in (s.attributes or {})], names


def test_sampler_comes_from_the_standard_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = tracing.new_tracer_provider("t", [], batch=False)
    assert isinstance(provider.sampler, ParentBased)
    assert "0.25" in provider.sampler.get_description()
