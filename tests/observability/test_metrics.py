"""The shard's /metrics endpoint (real HTTP on loopback) and the database gauges behind it."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint
from prometheus_client import CollectorRegistry, generate_latest

from shardrouter.core.grpcserver import ListenError, listen_host
from shardrouter.core.metrics import start_metrics_server
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.metrics import RouterMetrics
from shardrouter.shardd import partitions, retention
from shardrouter.shardd.idempotency.outcomes import CallOutcome, OutcomeKind
from shardrouter.shardd.observability import (
    DURATION_BUCKETS,
    ShardMetrics,
    ShardState,
    ShardStateCollector,
    retention_lag_s,
)
from shardrouter.shardd.server import MONTHS_AHEAD, ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import deposit, key_metadata, make_settings, money
from tests.metrics import Labels, all_samples, scrape_text

Samples = dict[tuple[str, Labels], float]


def scrape(port: int) -> Samples:
    return all_samples(scrape_text(port))


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def collector_of(daemon: ShardDaemon) -> ShardStateCollector:
    (collector,) = [t for t in daemon.background if isinstance(t, ShardStateCollector)]
    return collector


@pytest.fixture
def metered(database: str) -> Iterator[ShardDaemon]:
    daemon = start_shard(make_settings(database, metrics_port=free_port()), metrics_host="127.0.0.1")
    yield daemon
    daemon.stop(0.5)


def test_requests_total_moves_on_replay(metered: ShardDaemon) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{metered.port}") as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)
        md = key_metadata()
        request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
        stub.Deposit(request, metadata=md)
        before = scrape(metered.metrics_port)
        assert value(before, "shardd_requests_total", method="Deposit", outcome="new") == 1
        assert value(before, "shardd_requests_total", method="Deposit", outcome="replay") is None
        stub.Deposit(request, metadata=md)
        stub.Deposit(request, metadata=md)
        after = scrape(metered.metrics_port)
        assert value(after, "shardd_requests_total", method="Deposit", outcome="replay") == 2
        assert value(after, "shardd_requests_total", method="Deposit", outcome="new") == 1
        assert value(after, "shardd_handler_duration_seconds_count", method="Deposit", outcome="replay") == 2
        assert value(after, "shardd_key_reuse_total") == 0
        with pytest.raises(grpc.RpcError):
            stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(6)), metadata=md)
        with pytest.raises(grpc.RpcError):
            stub.Deposit(request, metadata=[])  # no key
        last = scrape(metered.metrics_port)
    assert value(last, "shardd_key_reuse_total") == 1
    assert value(last, "shardd_requests_total", method="Deposit", outcome="key_reused") == 1
    assert value(last, "shardd_requests_total", method="Deposit", outcome="invalid") == 1


def test_database_gauges(
    metered: ShardDaemon, db: psycopg.Connection[tuple[object, ...]], database: str
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{metered.port}") as channel:
        deposit(transfer_pb2_grpc.TransferServiceStub(channel), "alice", 10)
    current = partitions.Month.of(datetime.now(UTC)).table
    db.execute(f"ANALYZE {current}")
    assert collector_of(metered).refresh()
    samples = scrape(metered.metrics_port)
    assert value(samples, "shardd_idempotency_records", partition=current) == 1
    size = value(samples, "shardd_idempotency_partition_bytes", partition=current)
    assert size is not None and size > 8192
    age = value(samples, "shardd_idempotency_oldest_partition_age_seconds")
    assert age is not None and age > 30 * 86400, "the oldest kept partition starts a retention window ago"
    assert value(samples, "shardd_retention_lag_seconds") == 0
    assert value(samples, "shardd_retention_last_success_timestamp_seconds") is None  # never ran
    assert value(samples, "shardd_outbox_backlog") == 0
    assert value(samples, "shardd_outbox_oldest_age_seconds") == 0

    # A forgotten partition from 2020: retention is years behind; a run drops it and records itself.
    with psycopg.connect(database, autocommit=True) as conn:
        partitions.create_partition(conn, partitions.Month(2020, 1))
    assert collector_of(metered).refresh()
    behind = scrape(metered.metrics_port)
    assert (
        value(behind, "shardd_idempotency_partition_bytes", partition="idempotency_record_2020_01")
        is not None
    )
    lag = value(behind, "shardd_retention_lag_seconds")
    assert lag is not None and lag > 365 * 86400
    retention.run_retention(database, retention=metered.settings.retention, months_ahead=MONTHS_AHEAD)
    assert collector_of(metered).refresh()
    caught_up = scrape(metered.metrics_port)
    assert value(caught_up, "shardd_retention_lag_seconds") == 0
    assert (
        value(caught_up, "shardd_idempotency_partition_bytes", partition="idempotency_record_2020_01") is None
    )
    finished = value(caught_up, "shardd_retention_last_success_timestamp_seconds")
    assert finished is not None and abs(finished - datetime.now(UTC).timestamp()) < 60


def test_outbox_backlog_gauge(database: str, tmp_path: Path) -> None:
    """A cross-shard transfer with no relay running leaves one credit in the outbox."""
    shard_map = even_shard_map({"shard-0": f"127.0.0.1:{free_port()}", "shard-1": "127.0.0.1:9"})
    path = tmp_path / "map.yaml"
    path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    address = shard_map.shard_by_id("shard-0").address  # type: ignore[union-attr]
    daemon = start_shard(
        make_settings(
            database, shard_id="shard-0", listen=address, shard_map=str(path), metrics_port=free_port()
        ),
        metrics_host="127.0.0.1",
    )
    try:
        local = next(f"a{i}" for i in range(1000) if shard_map.shard_for(f"a{i}").id == "shard-0")
        remote = next(f"a{i}" for i in range(1000) if shard_map.shard_for(f"a{i}").id == "shard-1")
        with grpc.insecure_channel(address) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            deposit(stub, local, 100)
            stub.Transfer(
                transfer_pb2.TransferRequest(
                    source_account_id=local, destination_account_id=remote, amount=money(10)
                ),
                metadata=key_metadata(),
            )
        assert collector_of(daemon).refresh()
        samples = scrape(daemon.metrics_port)
    finally:
        daemon.stop(0.5)
    assert value(samples, "shardd_outbox_backlog") == 1
    oldest = value(samples, "shardd_outbox_oldest_age_seconds")
    assert oldest is not None and 0 <= oldest < 60
    assert value(samples, "shardd_requests_total", method="Transfer", outcome="new") == 1


def test_dead_letters_are_counted_until_their_refund_is_done(metered: ShardDaemon, database: str) -> None:
    collector = collector_of(metered)
    assert collector.refresh()
    samples = scrape(metered.metrics_port)
    assert value(samples, "shardd_dead_letters", refund="pending") == 0
    assert value(samples, "shardd_dead_letter_oldest_unrefunded_age_seconds") == 0
    transfer_id = uuid.uuid4()
    with psycopg.connect(database, autocommit=True) as conn:  # a dead letter as the relay leaves it
        conn.execute("INSERT INTO accounts (id, currency, balance) VALUES ('src', 'EUR', 0)")
        conn.execute(
            "INSERT INTO transfers (id, source_account_id, destination_account_id, destination_shard_id,"
            " amount_minor, currency, state) VALUES (%s, 'src', 'ghost', 'shard-1', 10, 'EUR', 'pending')",
            (transfer_id,),
        )
        conn.execute(
            "INSERT INTO outbox (transfer_id, destination_shard_id, idempotency_key, payload, dead_lettered_at)"
            " VALUES (%s, 'shard-1', %s, '\\x00', now())",
            (transfer_id, uuid.uuid4()),
        )
        conn.execute(
            "INSERT INTO dead_letters (transfer_id, outbox_id, reason, refund_key, created_at)"
            " SELECT %s, id, 'NOT_FOUND: ghost', %s, now() - interval '90 seconds' FROM outbox",
            (transfer_id, uuid.uuid4()),
        )
        assert collector.refresh()
        samples = scrape(metered.metrics_port)
        assert value(samples, "shardd_dead_letters", refund="pending") == 1
        assert value(samples, "shardd_dead_letters", refund="done") == 0
        age = value(samples, "shardd_dead_letter_oldest_unrefunded_age_seconds")
        assert age is not None and 89 <= age < 600
        conn.execute("UPDATE dead_letters SET refunded_at = now()")
    assert collector.refresh()
    samples = scrape(metered.metrics_port)
    assert value(samples, "shardd_dead_letters", refund="pending") == 0
    assert value(samples, "shardd_dead_letters", refund="done") == 1
    assert value(samples, "shardd_dead_letter_oldest_unrefunded_age_seconds") == 0


def test_collector_keeps_last_values_when_the_database_fails(metered: ShardDaemon) -> None:
    collector = collector_of(metered)
    assert collector.refresh()
    kept = collector.state
    metered.database.close()
    assert not collector.refresh()
    assert collector.state is kept
    samples = scrape(metered.metrics_port)
    assert value(samples, "shardd_metrics_collector_errors_total") == 1
    assert value(samples, "shardd_outbox_backlog") == 0


def test_retention_lag_is_zero_until_the_oldest_month_is_wholly_expired() -> None:
    month = partitions.Month(2026, 1)
    info = partitions.PartitionInfo(month, 0, 0)
    window = timedelta(days=30)

    def state(at: datetime) -> ShardState:
        return ShardState(at, (info,), None, 0, 0.0)

    droppable = month.end() + window
    assert retention_lag_s(state(droppable - timedelta(seconds=1)), window) == 0
    assert retention_lag_s(state(droppable + timedelta(hours=2)), window) == 7200
    assert retention_lag_s(ShardState(droppable, (), None, 0, 0.0), window) == 0


def test_metrics_off_when_port_is_zero(shard: ShardDaemon) -> None:
    assert shard.metrics is None
    assert shard.metrics_port == 0


def test_metrics_host_follows_the_listen_address() -> None:
    assert listen_host("127.0.0.1:50061") == "127.0.0.1"
    assert listen_host("0.0.0.0:50061") == "0.0.0.0"
    assert listen_host("[::]:50061") == "::"
    assert listen_host(":50061") == "0.0.0.0"


def test_router_metrics_endpoint() -> None:
    metrics = RouterMetrics()
    server = start_metrics_server(0, metrics.registry, host="127.0.0.1")
    try:
        metrics.observe("/shardrouter.v1.TransferService/Transfer", grpc.StatusCode.OK, 0.01)
        metrics.observe("/shardrouter.v1.TransferService/Transfer", grpc.StatusCode.UNAVAILABLE, 0.5)
        metrics.observe("/shardrouter.v1.TransferService/Transfer", grpc.StatusCode.OK)
        with metrics.timed("/shardrouter.v1.TransferService/Deposit") as done:
            done(grpc.StatusCode.ABORTED)
        samples = scrape(server.port)
    finally:
        server.stop()
    assert value(samples, "router_requests_total", method="Transfer", code="OK", shard="none", protocol="grpc") == 2
    assert value(samples, "router_requests_total", method="Transfer", code="UNAVAILABLE", shard="none", protocol="grpc") == 1
    assert value(samples, "router_requests_total", method="Deposit", code="ABORTED", shard="none", protocol="grpc") == 1
    assert value(samples, "router_request_duration_seconds_count", method="Transfer", code="OK", shard="none", protocol="grpc") == 1


def test_two_shards_in_one_process_have_separate_registries(database: str, postgres) -> None:  # type: ignore[no-untyped-def]
    name = f"m{uuid.uuid4().hex[:10]}"
    postgres.create_database(name)
    a = start_shard(make_settings(database, metrics_port=free_port()), metrics_host="127.0.0.1")
    b = start_shard(make_settings(postgres.dsn_for(name), metrics_port=free_port()), metrics_host="127.0.0.1")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{a.port}") as channel:
            deposit(transfer_pb2_grpc.TransferServiceStub(channel), "alice", 1)
        assert value(scrape(a.metrics_port), "shardd_requests_total", method="Deposit", outcome="new") == 1
        assert value(scrape(b.metrics_port), "shardd_requests_total", method="Deposit", outcome="new") is None
        assert a.metrics is not None and b.metrics is not None
        assert a.metrics.pipeline.provider is not b.metrics.pipeline.provider
    finally:
        a.stop(0.5)
        b.stop(0.5)
    # Stopping a daemon shuts its provider down: the reader has left the registry.
    assert a.metrics is not None
    assert list(a.metrics.registry.collect()) == []


def test_shard_metrics_are_opentelemetry_instruments() -> None:
    """The counters go through an OpenTelemetry MeterProvider read by the Prometheus reader."""
    in_memory = InMemoryMetricReader()
    metrics = ShardMetrics(readers=[in_memory])
    try:
        assert isinstance(metrics.pipeline.provider, MeterProvider)
        assert isinstance(metrics.pipeline.reader, PrometheusMetricReader)
        for outcome in (OutcomeKind.NEW, OutcomeKind.REPLAY, OutcomeKind.REPLAY):
            metrics.observe(
                CallOutcome(
                    "/shardrouter.v1.TransferService/Deposit", "s", "k", outcome, grpc.StatusCode.OK, 0.003
                )
            )
        data = in_memory.get_metrics_data()
        assert data is not None
        otel = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        replays = [
            p.value
            for p in otel["shardd_requests"].data.data_points
            if isinstance(p, NumberDataPoint) and p.attributes == {"method": "Deposit", "outcome": "replay"}
        ]
        assert replays == [2]
        (bounds,) = [
            tuple(p.explicit_bounds)
            for p in otel["shardd_handler_duration_seconds"].data.data_points
            if isinstance(p, HistogramDataPoint) and dict(p.attributes or {}).get("outcome") == "new"
        ]
        assert bounds == DURATION_BUCKETS
        assert otel["shardd_handler_duration_seconds"].unit == "s"
        # The same instruments, as Prometheus sees them: exact names, no target_info, no scope labels.
        text = generate_latest(metrics.registry).decode()
        assert 'shardd_requests_total{method="Deposit",outcome="replay"} 2.0' in text
        assert (
            'shardd_handler_duration_seconds_bucket{le="0.0025",method="Deposit",outcome="new"} 0.0' in text
        )
        assert 'shardd_handler_duration_seconds_bucket{le="0.005",method="Deposit",outcome="new"} 1.0' in text
        assert "target_info" not in text and "otel_scope" not in text
    finally:
        metrics.shutdown()
        metrics.shutdown()  # idempotent: the daemon may reach it twice
    assert list(metrics.registry.collect()) == []


def test_a_metrics_port_in_use_is_refused_naming_it() -> None:
    """A process that cannot bind its /metrics port stops with the address in its one line, as it
    does for its gRPC port, not with a bare OSError ("cannot start: : Address already in use")."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match=rf"cannot serve /metrics on 127\.0\.0\.1:{port}: .*in use"):
            start_metrics_server(port, CollectorRegistry(), host="127.0.0.1")
