"""Background work is traced only when it does work: one span per job, its statements beneath it.

The shard's background loops poll the database all the time (the outbox relay every 0.2 s per
worker, the metrics refresh, the partition keeper). With statement tracing on, each idle poll used to
be a root `SELECT` span, thousands a minute in the tracing UI. Real shards, real PostgreSQL, real
relay threads; the spans go to an in-memory exporter.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shardrouter.core.shardmap import ShardMap, even_shard_map, shard_map_document
from shardrouter.core.tracing import new_tracer_provider
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd import retention
from shardrouter.shardd.db import Database
from shardrouter.shardd.observability import ShardStateCollector
from shardrouter.shardd.partition_keeper import PartitionKeeper
from shardrouter.shardd.server import MONTHS_AHEAD, ShardDaemon, prepare_database, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, money

SERVICE = "shardd/background-test"
CREDIT = "shardrouter.internal.v1.ShardLedgerService/CreditTransfer"


@dataclass
class TracedPair:
    """Two traced shards, each with a running relay, sharing one in-memory exporter."""

    shard_map: ShardMap
    daemons: dict[str, ShardDaemon]
    dsns: dict[str, str]
    exporter: InMemorySpanExporter

    def stub(self, account: str) -> transfer_pb2_grpc.TransferServiceStub:
        channel = grpc.insecure_channel(self.shard_map.shard_for(account).address)
        return transfer_pb2_grpc.TransferServiceStub(channel)

    def account_on(self, shard_id: str) -> str:
        return next(
            a for a in (f"acct-{i}" for i in range(1000)) if self.shard_map.shard_for(a).id == shard_id
        )

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def _is_statement(span: ReadableSpan) -> bool:
    return "db.statement" in (span.attributes or {})


def _describe(spans: list[ReadableSpan]) -> list[str]:
    return [f"{s.name} parent={s.parent.span_id if s.parent else None}" for s in spans]


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer_provider = new_tracer_provider(SERVICE, [exporter], batch=False)
    yield tracer_provider, exporter
    tracer_provider.shutdown()


@pytest.fixture
def pair(
    postgres: LocalPostgres, tmp_path: Path, provider: tuple[TracerProvider, InMemorySpanExporter]
) -> Iterator[TracedPair]:
    from tests.helpers import make_settings

    tracer_provider, exporter = provider
    ports = {"shard-0": free_port(), "shard-1": free_port()}
    shard_map = even_shard_map({sid: f"127.0.0.1:{p}" for sid, p in ports.items()})
    map_path = tmp_path / "shard-map.yaml"
    map_path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    dsns: dict[str, str] = {}
    daemons: dict[str, ShardDaemon] = {}
    try:
        for sid, port in ports.items():
            name = f"bg{uuid.uuid4().hex[:10]}"
            postgres.create_database(name)
            dsns[sid] = postgres.dsn_for(name)
            settings = make_settings(
                dsns[sid],
                shard_id=sid,
                listen=f"127.0.0.1:{port}",
                shard_map=str(map_path),
                relay_workers=1,  # the real polling loop, as a daemon runs it
            )
            daemons[sid] = start_shard(settings, tracer_provider=tracer_provider)
        yield TracedPair(shard_map, daemons, dsns, exporter)
    finally:
        for daemon in daemons.values():
            daemon.stop(0.2)


def test_idle_relays_leave_no_spans(pair: TracedPair) -> None:
    pair.exporter.clear()  # start-up is not the subject
    time.sleep(2.0)  # ~10 polls of each relay (outbox and dead letters each time)
    spans = pair.spans()
    roots = [s for s in spans if s.parent is None]
    assert not [s for s in spans if _is_statement(s)], _describe(spans)
    assert roots == [], _describe(roots)


def test_a_cross_shard_delivery_is_one_job_span_with_its_statements_and_the_credit_beneath(
    pair: TracedPair,
) -> None:
    src, dst = pair.account_on("shard-0"), pair.account_on("shard-1")
    for account, amount in ((src, 1000), (dst, 1)):
        pair.stub(account).Deposit(
            transfer_pb2.DepositRequest(account_id=account, amount=money(amount)), metadata=key_metadata()
        )
    transfer = (
        pair.stub(src)
        .Transfer(
            transfer_pb2.TransferRequest(
                source_account_id=src, destination_account_id=dst, amount=money(300)
            ),
            metadata=key_metadata(),
        )
        .transfer
    )
    deadline = time.monotonic() + 10
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT state FROM transfers WHERE id = %s", (transfer.transfer_id,)
            ).fetchone()
            if row is not None and row[0] == "completed":
                break
            time.sleep(0.05)
        assert row is not None and row[0] == "completed", row
    time.sleep(0.5)  # a few more idle polls after the delivery: they must add nothing

    spans = pair.spans()
    jobs = [s for s in spans if s.name == "outbox.deliver"]
    assert len(jobs) == 1, _describe(spans)
    (job,) = jobs
    assert job.parent is None and job.kind is SpanKind.INTERNAL
    attrs = dict(job.attributes or {})
    assert attrs["outbox.transfer_ids"] == (transfer.transfer_id,)
    assert (attrs["outbox.batch_size"], attrs["outbox.delivered"], attrs["outbox.dead_lettered"]) == (1, 1, 0)
    assert attrs["shard.id"] == "shard-0"

    children = [s for s in spans if s.parent is not None and s.parent.span_id == job.context.span_id]
    sql = [str((s.attributes or {})["db.statement"]) for s in children if _is_statement(s)]
    assert any(q.startswith("UPDATE outbox SET delivered_at") for q in sql), sql
    assert any("transfers" in q and q.startswith("UPDATE") for q in sql), sql
    # The credit it sent is in the same trace: the destination's SERVER span is the job's child.
    (credit,) = [s for s in children if s.name == CREDIT]
    assert credit.kind is SpanKind.SERVER and credit.context.trace_id == job.context.trace_id

    # Nothing else the loops did is a root statement span: every root is a served call or the job.
    roots = [s for s in spans if s.parent is None]
    assert {(s.name, s.kind) for s in roots if s.kind is not SpanKind.SERVER} == {
        ("outbox.deliver", SpanKind.INTERNAL)
    }, _describe(roots)
    assert not [s for s in roots if _is_statement(s)]


def test_metrics_refresh_is_untraced(
    database: str, provider: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    tracer_provider, exporter = provider
    prepare_database(database, timedelta(days=30))
    db = Database(database, min_size=1, max_size=2, tracer_provider=tracer_provider, traced=True)
    db.open()
    try:
        collector = ShardStateCollector(db, retention=timedelta(days=30))
        assert collector.refresh()
        assert collector.state is not None
    finally:
        db.close()
    assert exporter.get_finished_spans() == ()


def test_partition_keeper_traces_only_a_tick_that_creates(
    database: str, provider: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    tracer_provider, exporter = provider
    prepare_database(database, timedelta(days=30))
    later = datetime.now(UTC) + timedelta(days=200)
    clock = [datetime.now(UTC)]
    keeper = PartitionKeeper(
        database,
        retention=timedelta(days=30),
        months_ahead=MONTHS_AHEAD,
        clock=lambda: clock[0],
        tracer_provider=tracer_provider,
    )
    assert keeper.tick() == []
    assert exporter.get_finished_spans() == (), "every month exists: an idle tick"

    clock[0] = later
    created = keeper.tick()
    assert created, "months ahead of the moved clock are missing"
    (job,) = [s for s in exporter.get_finished_spans() if s.parent is None]
    assert job.name == "partitions.ensure" and job.kind is SpanKind.INTERNAL
    assert (job.attributes or {})["partitions.created"] == tuple(m.table for m in created)
    ddl = [
        str((s.attributes or {})["db.statement"])
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == job.context.span_id and _is_statement(s)
    ]
    assert any("ATTACH PARTITION" in q for q in ddl), ddl

    exporter.clear()
    assert keeper.tick() == []
    assert exporter.get_finished_spans() == ()


def test_a_retention_run_is_one_span_with_its_statements(
    database: str, provider: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    tracer_provider, exporter = provider
    prepare_database(database, timedelta(days=30))
    result = retention.run_retention(
        database, retention=timedelta(days=30), months_ahead=MONTHS_AHEAD, tracer_provider=tracer_provider
    )
    assert result.ran
    spans = exporter.get_finished_spans()
    (job,) = [s for s in spans if s.parent is None]
    assert job.name == "retention.run" and (job.attributes or {})["retention.ran"] is True
    statements = [s for s in spans if _is_statement(s)]
    assert statements and all(
        s.parent is not None and s.parent.span_id == job.context.span_id for s in statements
    )
