"""A completed key always replays, whatever the concurrency, and a replay writes nothing and locks nothing.

Real shard daemon (gRPC on loopback) over a real PostgreSQL database; each test runs with the
in-memory record of completed keys (the default) and without it (every replay reads the database,
as after a restart or when another process of the shard completed the key).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent import futures

import grpc
import psycopg
import pytest

from shardrouter.shardd.db import Database, current_transaction
from shardrouter.shardd.idempotency import IdempotencyConfig
from shardrouter.shardd.ledger.service import ShardLocator, TransferServicer
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import deposit, guarded_deposits, key_metadata, make_settings, money

CACHE = pytest.mark.parametrize("cache_entries", [10_000, 0], ids=["memory", "database"])


@pytest.fixture
def shard_with(database: str) -> Iterator[object]:
    started: list[ShardDaemon] = []

    def start(cache_entries: int) -> ShardDaemon:
        daemon = start_shard(make_settings(database, replay_cache_entries=cache_entries))
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop(0.5)


def _writes(db: psycopg.Connection[tuple[object, ...]]) -> tuple[object, ...]:
    """What any write to the tables a guarded call touches would move: each table's row count and
    the newest row version's transaction id (`xmin`: an UPDATE makes a new version, an INSERT a row).
    Scoped to this test's database, so other databases on the shared server cannot disturb it."""
    parts = [
        f"(SELECT count(*) || ':' || coalesce(max(xmin::text::bigint), 0) FROM {table})"
        for table in ("idempotency_record", "accounts", "ledger_entries", "transfers", "outbox")
    ]
    row = db.execute("SELECT " + ", ".join(parts)).fetchone()
    assert row is not None
    return tuple(row)


def _locks_held_by_shard(db: psycopg.Connection[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """Advisory and row-level locks held by the shard's connections (a read holds neither), with the
    statement of each. Not the lock a connection being opened holds on its database while it starts
    (an object lock on pg_database, RowExclusiveLock): the pool may open one at any time."""
    return db.execute(
        "SELECT l.locktype, l.mode, l.classid::regclass::text, l.objid, a.query FROM pg_locks l"
        " JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE a.application_name = 'shardd' AND l.granted"
        " AND (l.locktype = 'advisory' OR l.mode IN ('RowShareLock', 'RowExclusiveLock')"
        " OR l.locktype = 'transactionid')"
        " AND NOT (l.locktype = 'object' AND l.classid = 'pg_database'::regclass)"
    ).fetchall()


@CACHE
def test_concurrent_replays_of_a_completed_key_all_replay(shard_with, database, db, cache_entries) -> None:
    """Eight callers resending one completed Deposit: every answer is the stored one, never ABORTED;
    meanwhile no row changes, and the shard's connections hold no advisory lock, row lock or
    transaction id (only a writing transaction takes one)."""
    daemon = shard_with(cache_entries)
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)
        md = key_metadata()
        request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
        first = stub.Deposit(request, metadata=md).SerializeToString()
        stub.Deposit(request, metadata=md)  # warm: the first replay may set hint bits
        before = _writes(db)
        stop = threading.Event()
        locks: list[tuple[object, ...]] = []

        def watch_locks() -> None:
            with psycopg.connect(database, autocommit=True) as watcher:
                while not stop.is_set():
                    locks.extend(_locks_held_by_shard(watcher))

        def replays(_: int) -> Counter[str]:
            seen: Counter[str] = Counter()
            for _ in range(60):
                try:
                    reply, call = stub.Deposit.with_call(request, metadata=md, timeout=10)
                    same = reply.SerializeToString() == first
                    replayed = dict(call.trailing_metadata()).get("idempotency-replayed") == "true"
                    seen["replay" if same and replayed else "wrong answer"] += 1
                except grpc.RpcError as err:
                    seen[err.code().name] += 1
            return seen

        watcher = threading.Thread(target=watch_locks)
        watcher.start()
        started = time.monotonic()
        try:
            with futures.ThreadPoolExecutor(8) as pool:
                counts = sum(pool.map(replays, range(8)), Counter())
        finally:
            stop.set()
            watcher.join()
        elapsed = time.monotonic() - started
    print(
        f"\n8 callers replaying one key ({'memory' if cache_entries else 'database'}): {dict(counts)}, "
        f"{counts['replay'] / elapsed:.0f} replays/s"
    )
    assert counts == Counter({"replay": 480}), counts
    assert _writes(db) == before, "a replay wrote something"
    assert not locks, f"replays held locks: {locks[:5]}"


@CACHE
def test_replay_writes_nothing(shard_with, db, cache_entries) -> None:
    daemon = shard_with(cache_entries)
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)
        deposit(stub, "alice", 1000)
        md = key_metadata()
        request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
        stub.Deposit(request, metadata=md)
        stub.Deposit(request, metadata=md)
        before = _writes(db)
        for _ in range(3):
            stub.Deposit(request, metadata=md)
        assert _writes(db) == before
        # The check can fail: a new key moves the figures of the tables a Deposit writes.
        stub.Deposit(request, metadata=key_metadata())
        after_new = _writes(db)
    assert all(a != b for a, b in zip(after_new[:3], before[:3], strict=True)), (before, after_new)


class _TrailerSettingServicer(TransferServicer):
    """The real Deposit, plus trailers a handler might set (a plain one and a binary one) that
    differ on every run of the handler: a replay that ran the handler again would show it."""

    def __init__(self, database: Database) -> None:
        super().__init__(database, ShardLocator("shard-0", None))
        self.runs = 0

    def Deposit(
        self, request: transfer_pb2.DepositRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.DepositResponse:
        self.runs += 1
        assert current_transaction() is not None
        context.set_trailing_metadata(
            (("x-handler-run", str(self.runs)), ("x-handler-token-bin", bytes([self.runs, 0, 255])))
        )
        return super().Deposit(request, context)


@CACHE
def test_handler_trailers_are_stored_and_replayed(database, cache_entries) -> None:
    from shardrouter.shardd.idempotency.process_keys import CompletedKeys

    servicers: list[_TrailerSettingServicer] = []

    def servicer_for(pool: Database) -> _TrailerSettingServicer:
        servicers.append(_TrailerSettingServicer(pool))
        return servicers[-1]

    with guarded_deposits(
        database,
        servicer_for,
        # Claims sent first: a replay then never starts the handler, wherever its record comes from
        # (with claims sent ahead a replay from the database starts it, and the database skips what
        # it sends: tests/shardd/test_claim_ahead.py).
        config=IdempotencyConfig(claim_placement="first"),
        completed=CompletedKeys(max_entries=cache_entries, max_bytes=1 << 20),
    ) as stub:
        md = key_metadata()
        request = transfer_pb2.DepositRequest(account_id="zed", amount=money(5))
        _, c1 = stub.Deposit.with_call(request, metadata=md)
        _, c2 = stub.Deposit.with_call(request, metadata=md)
        _, c3 = stub.Deposit.with_call(request, metadata=key_metadata())
    (servicer,) = servicers
    t1, t2, t3 = (dict(c.trailing_metadata()) for c in (c1, c2, c3))
    assert servicer.runs == 2, "the replay ran the handler"
    assert (t1["x-handler-run"], t1["x-handler-token-bin"]) == ("1", bytes([1, 0, 255]))
    assert (t2["x-handler-run"], t2["x-handler-token-bin"]) == ("1", bytes([1, 0, 255]))
    assert t2["idempotency-replayed"] == "true" and "idempotency-replayed" not in t1
    assert t3["x-handler-run"] == "2"  # a new key runs the handler, so the trailer can differ
