"""The partition keeper, against the real PostgreSQL: it fills months the clock walked into, races
safely with other creators, survives failed ticks and stops promptly."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import grpc
import psycopg
import pytest
from psycopg import sql

from shardrouter.core.keys import key_time, new_key
from shardrouter.shardd import partitions
from shardrouter.shardd.idempotency.record import ClaimStatus
from shardrouter.shardd.partition_keeper import PartitionKeeper
from shardrouter.shardd.retention import run_retention
from shardrouter.shardd.server import MONTHS_AHEAD, prepare_database, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money, store_key

RETENTION = timedelta(days=30)
Month = partitions.Month


def _partition_names(conn: psycopg.Connection) -> list[str]:
    """Every attached partition of the parent, straight from pg_inherits (duplicates would show)."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'idempotency_record'::regclass ORDER BY c.relname"
    ).fetchall()
    return [str(r[0]) for r in rows]


def _plus(month: Month, n: int) -> Month:
    for _ in range(n):
        month = month.next()
    return month


def _claim_at(dsn: str, moment: datetime) -> str:
    """Claim a key dated `moment` (a direct INSERT); the partition the row landed in."""
    key = new_key(int(moment.timestamp() * 1000))
    with psycopg.connect(dsn, autocommit=True) as conn:
        claim = store_key(
            conn,
            scope="s",
            key=str(key),
            key_time=key_time(key),
        )
        assert claim.status is ClaimStatus.CLAIMED
        row = conn.execute(
            "SELECT tableoid::regclass::text FROM idempotency_record WHERE key = %s", (str(key),)
        ).fetchone()
    assert row is not None
    return str(row[0])


def _wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _keeper(dsn: str, moment: datetime, interval_s: float = 3600.0) -> PartitionKeeper:
    return PartitionKeeper(
        dsn, retention=RETENTION, months_ahead=MONTHS_AHEAD, interval_s=interval_s, clock=lambda: moment
    )


def test_one_tick_creates_the_months_the_clock_walked_into_and_the_claim_then_succeeds(database, db):
    prepare_database(database, RETENTION)
    before = _partition_names(db)
    last = max(partitions.existing_partitions(db))
    target = _plus(last, 4)  # a daemon that ran four months past its start-up partitions
    moment = target.start() + timedelta(days=10)
    with pytest.raises(psycopg.errors.CheckViolation, match="no partition"):
        _claim_at(database, moment)

    keeper = _keeper(database, moment)
    started = time.monotonic()
    created = keeper.tick()
    took = time.monotonic() - started

    # The retention window reaches into the previous month; then this month and MONTHS_AHEAD more.
    expected = [_plus(last, 3).table, target.table, _plus(target, 1).table, _plus(target, 2).table]
    assert created is not None
    assert [m.table for m in created] == expected
    assert _partition_names(db) == sorted(before + expected)
    assert _claim_at(database, moment) == target.table
    assert keeper.tick() == []  # idempotent: nothing left to do
    assert (keeper.ticks_ok, keeper.ticks_failed) == (2, 0)
    print(f"\none tick created {len(created)} partitions {expected} in {took * 1000:.0f} ms")


def test_a_running_daemon_restores_a_missing_current_month_for_real_deposits(database, db):
    daemon = start_shard(make_settings(database))
    keeper = next(task for task in daemon.background if isinstance(task, PartitionKeeper))
    try:
        assert keeper.running
        _wait_until(lambda: keeper.ticks_ok >= 1)  # the tick at start (finds prepare_database's work)
        # The daemon outlived its partitions: drop this month and the next (covers a month boundary).
        now = datetime.now(UTC)
        gone = [Month.of(now), Month.of(now).next()]
        for month in gone:
            partitions.drop_partition(db, month)
        with pytest.raises(psycopg.errors.CheckViolation, match="no partition"):
            _claim_at(database, datetime.now(UTC))

        created = keeper.tick()

        assert created is not None and set(gone) <= set(created)
        key = new_key()
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id="a", amount=money(5)),
                metadata=key_metadata(key),
                timeout=5,
            )
        row = db.execute(
            "SELECT tableoid::regclass::text FROM idempotency_record WHERE key = %s", (str(key),)
        ).fetchone()
        assert row is not None and row[0] == Month.of(key_time(key)).table
    finally:
        daemon.stop(0.5)
    assert not keeper.running  # ShardDaemon.stop stops it with the other background tasks


def _race(database: str, moment: datetime, keepers: int) -> tuple[list[list[Month] | None], list[str]]:
    """`keepers` keeper ticks and one retention run released at once: each keeper's result, and
    the partitions the retention run created."""
    barrier = threading.Barrier(keepers + 1)
    keeper_results: list[list[Month] | None] = []
    retention_created: list[str] = []

    def keep() -> None:
        keeper = _keeper(database, moment)
        barrier.wait()
        keeper_results.append(keeper.tick())

    def retain() -> None:
        barrier.wait()
        result = run_retention(database, retention=RETENTION, months_ahead=MONTHS_AHEAD, now=moment)
        retention_created.extend(result.created)

    threads = [threading.Thread(target=keep) for _ in range(keepers)]
    threads.append(threading.Thread(target=retain))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return keeper_results, retention_created


def test_concurrent_keepers_and_a_retention_run_leave_exactly_one_partition_per_month(database, db):
    prepare_database(database, RETENTION)
    base = _plus(max(partitions.existing_partitions(db)), 12)
    for round_ in range(3):
        # Each round a new stretch of months, so every round races on months nobody created yet.
        moment = _plus(base, round_ * 6).start() + timedelta(days=10)
        keeper_results, retention_created = _race(database, moment, keepers=3)

        assert len(keeper_results) == 3 and None not in keeper_results, "a keeper tick failed"
        expected = [m.table for m in partitions.months_to_keep(moment, RETENTION, MONTHS_AHEAD)]
        creations = [m.table for r in keeper_results if r for m in r] + retention_created
        assert sorted(creations) == expected, "each month must be created exactly once, by someone"
        names = _partition_names(db)
        assert len(names) == len(set(names))
        assert set(expected) <= set(names)
        print(f"\nround {round_}: {len(expected)} months created once among 3 keepers + retention")


def test_a_failing_tick_does_not_kill_the_thread_and_the_next_tick_works(postgres, database, db, caplog):
    prepare_database(database, RETENTION)
    target = _plus(max(partitions.existing_partitions(db)), 3)
    moment = target.start() + timedelta(days=10)
    this_db = sql.Identifier(db.execute("SELECT current_database()").fetchone()[0])
    # A database cannot close itself to connections: switch it from the server's maintenance database.
    admin = psycopg.connect(postgres.dsn, autocommit=True)
    # The database becomes unreachable for new sessions (the keeper connects afresh each tick).
    admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(this_db))
    keeper = _keeper(database, moment, interval_s=0.05)
    caplog.set_level(logging.WARNING, logger="shardd.partition_keeper")
    try:
        keeper.start()
        _wait_until(lambda: keeper.ticks_failed >= 3)
        assert keeper.running
        assert keeper.ticks_ok == 0
        assert target.table not in _partition_names(db)
        assert any("ensuring partitions failed" in r.getMessage() for r in caplog.records)

        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(this_db))
        _wait_until(lambda: keeper.ticks_ok >= 1)
        assert keeper.running
        assert target.table in _partition_names(db)
        assert _claim_at(database, moment) == target.table
        print(f"\nkeeper survived {keeper.ticks_failed} failed ticks, then created {target.table}")
    finally:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(this_db))
        admin.close()
        keeper.stop()


def test_stop_returns_within_a_second(database):
    prepare_database(database, RETENTION)
    keeper = _keeper(database, datetime.now(UTC))  # default-like hour between ticks
    keeper.start()
    _wait_until(lambda: keeper.ticks_ok >= 1)
    started = time.monotonic()
    keeper.stop()
    took = time.monotonic() - started
    assert took < 1.0, f"stop took {took:.3f} s"
    assert not keeper.running
    assert keeper.ticks_ok == 1
    print(f"\nstop() returned in {took * 1000:.1f} ms")
