"""Partition maintenance and the retention job, against a real PostgreSQL with live writers."""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import grpc
import psycopg
import pytest

from shardrouter.core.keys import key_time, new_key
from shardrouter.shardd import partitions
from shardrouter.shardd.idempotency.record import ClaimStatus
from shardrouter.shardd.retention import run_retention
from shardrouter.shardd.server import prepare_database
from shardrouter.v1 import transfer_pb2
from tests.helpers import key_metadata, money, store_key

RETENTION = timedelta(days=30)


def _months(conn) -> list[str]:
    return [m.table for m in partitions.existing_partitions(conn)]


def test_start_up_creates_the_window_and_two_months_ahead(database):
    prepare_database(database, RETENTION)
    with psycopg.connect(database, autocommit=True) as conn:
        names = _months(conn)
    now = datetime.now(UTC)
    expected = [m.table for m in partitions.months_to_keep(now, RETENTION, 2)]
    assert names == expected
    assert len(names) >= 3  # the current month, the next two, and the start of the window


def test_first_day_of_a_month_still_accepts_keys_from_the_last_day_before(database):
    prepare_database(database, RETENTION)
    first_of_march = datetime(2027, 3, 1, 0, 0, 5, tzinfo=UTC)
    with psycopg.connect(database, autocommit=True) as conn:
        partitions.ensure_partitions(conn, now=first_of_march, retention=RETENTION, months_ahead=2)
        assert "idempotency_record_2027_02" in _months(conn)
    key = new_key(int(datetime(2027, 2, 28, 23, 59, 59, tzinfo=UTC).timestamp() * 1000))
    with psycopg.connect(database, autocommit=True) as conn:
        claim = store_key(
            conn,
            scope="s",
            key=str(key),
            key_time=key_time(key),
        )
    assert claim.status is ClaimStatus.CLAIMED


def test_there_is_no_default_partition_so_a_missing_month_fails_loudly(database):
    prepare_database(database, RETENTION)
    far = new_key(int(datetime(2031, 6, 1, tzinfo=UTC).timestamp() * 1000))
    with (
        psycopg.connect(database, autocommit=True) as conn,
        pytest.raises(psycopg.errors.CheckViolation, match="no partition"),
    ):
        store_key(conn, scope="s", key=str(far), key_time=key_time(far))


def _seed_old_rows(database: str, month_start: datetime, rows: int) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        for i in range(rows):
            key = new_key(int((month_start + timedelta(hours=i)).timestamp() * 1000))
            store_key(
                conn,
                scope="old",
                key=str(key),
                key_time=key_time(key),
            )


def test_retention_drops_whole_expired_months_and_keeps_the_rest(database):
    prepare_database(database, RETENTION)
    now = datetime.now(UTC)
    with psycopg.connect(database, autocommit=True) as conn:
        partitions.ensure_partitions(conn, now=now - timedelta(days=150), retention=RETENTION, months_ahead=5)
        before = _months(conn)
    old_month = partitions.Month.of(now - timedelta(days=120))
    _seed_old_rows(database, old_month.start(), 24)
    result = run_retention(database, retention=RETENTION, months_ahead=2, now=now)
    with psycopg.connect(database, autocommit=True) as conn:
        after = _months(conn)
        leftover = conn.execute("SELECT count(*) FROM idempotency_record WHERE scope = 'old'").fetchone()[0]
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE tablename LIKE 'idempotency_record_%'"
            )
        }
    cutoff = now - RETENTION
    assert old_month.table in result.dropped
    for name in result.dropped:
        assert name in before and name not in after and name not in tables  # detached AND dropped
    with psycopg.connect(database, autocommit=True) as conn:
        for month in partitions.existing_partitions(conn):
            assert month.end() > cutoff, f"{month.table} is wholly past retention but was kept"
    assert partitions.Month.of(cutoff).table in after  # the month the window starts in is kept
    assert leftover == 0
    print(f"\npartitions before {before}\n          after  {after}\n  run took {result.seconds:.3f} s")


def test_two_retention_runs_at_once_are_safe(database):
    prepare_database(database, RETENTION)
    now = datetime.now(UTC)
    with psycopg.connect(database, autocommit=True) as conn:
        partitions.ensure_partitions(conn, now=now - timedelta(days=200), retention=RETENTION, months_ahead=0)
    results = []
    barrier = threading.Barrier(2)

    def run():
        barrier.wait()
        results.append(run_retention(database, retention=RETENTION, months_ahead=2, now=now))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ran = [r for r in results if r.ran]
    assert ran, "at least one run must work"
    dropped = [name for r in results for name in r.dropped]
    assert len(dropped) == len(set(dropped)), "a partition was dropped twice"
    again = run_retention(database, retention=RETENTION, months_ahead=2, now=now)
    assert again.ran and again.dropped == () and again.created == ()


def test_retention_under_live_traffic_loses_no_write_and_blocks_none_for_long(shard, stub, db, database):
    now = datetime.now(UTC)
    with psycopg.connect(database, autocommit=True) as conn:
        partitions.ensure_partitions(conn, now=now - timedelta(days=180), retention=RETENTION, months_ahead=6)
    for months_back in (100, 130, 160):
        _seed_old_rows(database, partitions.Month.of(now - timedelta(days=months_back)).start(), 200)
    stop = threading.Event()
    latencies: list[tuple[float, float]] = []  # (start time, seconds)
    failures: list[BaseException] = []
    succeeded: list[str] = []
    lock = threading.Lock()

    def writer(n: int) -> None:
        while not stop.is_set():
            md = key_metadata()
            started = time.monotonic()
            try:
                stub.Deposit(
                    transfer_pb2.DepositRequest(account_id=f"w{n}", amount=money(1)), metadata=md, timeout=10
                )
            except grpc.RpcError as exc:
                failures.append(exc)
                continue
            with lock:
                latencies.append((started, time.monotonic() - started))
                succeeded.append(md[0][1])

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    run_started = time.monotonic()
    result = run_retention(database, retention=RETENTION, months_ahead=2, now=now)
    run_ended = time.monotonic()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert len(result.dropped) >= 3
    during = [s for start, s in latencies if run_started - s <= start <= run_ended]
    before = [s for start, s in latencies if start < run_started]
    # No write lost: every acknowledged deposit has its ledger entry and its record.
    keys = [uuid.UUID(k) for k in succeeded]
    assert db.execute(
        "SELECT count(*) FROM ledger_entries WHERE idempotency_key = ANY(%s)", ([str(k) for k in keys],)
    ).fetchone()[0] == len(keys)
    assert db.execute(
        "SELECT count(*) FROM idempotency_record WHERE key = ANY(%s)", ([str(k) for k in keys],)
    ).fetchone()[0] == len(keys)
    worst = max(during) if during else 0.0
    assert worst < 2.0, f"a write waited {worst:.2f} s behind the retention job"
    print(
        f"\nretention with 8 live writers: dropped {len(result.dropped)} partitions in {result.seconds * 1000:.0f} ms; "
        f"writes {len(keys)} ok, 0 lost; latency before p50 {statistics.median(before) * 1000:.1f} ms, "
        f"during p50 {statistics.median(during) * 1000 if during else 0:.1f} ms max {worst * 1000:.1f} ms"
    )
