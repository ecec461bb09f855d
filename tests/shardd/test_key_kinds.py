"""Exactly once for every key kind: UUIDv7 keys dated by their own time, and any other UUID or an
opaque key dated by its first receipt and found by (scope, key) across the live partitions.

Real shard daemon (gRPC on loopback) over a real PostgreSQL database, and the store itself on two
connections where an interleaving has to be forced.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import psycopg
import pytest

from shardrouter.core.keys import new_key
from shardrouter.shardd import partitions
from shardrouter.shardd.idempotency import store
from shardrouter.shardd.idempotency.record import ClaimStatus
from shardrouter.shardd.server import ShardDaemon, prepare_database, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import STORED_OK, completed_record, error_info, make_settings, money, store_key

KEYS = {
    "uuid4": lambda: str(uuid.uuid4()),
    "opaque": lambda: f"order-{uuid.uuid4().hex[:12]}/Attempt:1",
}
KINDS = pytest.mark.parametrize("make_key", KEYS.values(), ids=KEYS.keys())
DEPOSIT = "/shardrouter.v1.TransferService/Deposit"


@pytest.fixture
def uncached(database: str) -> Iterator[ShardDaemon]:
    """A shard that remembers no completed key in memory: every replay reads the database."""
    daemon = start_shard(make_settings(database, replay_cache_entries=0))
    yield daemon
    daemon.stop(0.5)


def _stub(daemon: ShardDaemon) -> tuple[grpc.Channel, transfer_pb2_grpc.TransferServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
    return channel, transfer_pb2_grpc.TransferServiceStub(channel)


def _entries(db: psycopg.Connection[Any], key: str) -> int:
    row = db.execute("SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (key,)).fetchone()
    assert row is not None
    return int(row[0])


def _records(db: psycopg.Connection[Any], key: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT tableoid::regclass::text, key_time FROM idempotency_record WHERE key = %s", (key,)
    ).fetchall()


@KINDS
def test_concurrent_duplicates_apply_once_and_every_answer_is_the_stored_one(uncached, db, make_key):
    """16 callers send one new key at once: one ledger entry; each answer is the stored one or
    ABORTED in flight; afterwards every retry replays the stored bytes."""
    key = make_key()
    request = transfer_pb2.DepositRequest(account_id="alice", amount=money(7))
    channel, stub = _stub(uncached)
    start = threading.Barrier(16)

    def send(_: int) -> tuple[str, bytes | str]:
        start.wait()
        try:
            response = stub.Deposit(request, metadata=[("idempotency-key", key)], timeout=10)
        except grpc.RpcError as err:
            info, retry = error_info(err)
            return f"{err.code().name}:{info.reason}:{retry}", err.details() or ""
        return "OK", response.SerializeToString()

    with channel, futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, range(16)))
        kinds = Counter(kind for kind, _ in answers)
        assert set(kinds) <= {"OK", "ABORTED:IDEMPOTENCY_KEY_IN_FLIGHT:True"}, kinds
        assert kinds["OK"] >= 1
        assert len({body for kind, body in answers if kind == "OK"}) == 1
        stored = next(body for kind, body in answers if kind == "OK")
        assert _entries(db, key) == 1
        assert len(_records(db, key)) == 1
        for _ in range(3):
            response, call = stub.Deposit.with_call(request, metadata=[("idempotency-key", key)], timeout=10)
            assert response.SerializeToString() == stored
            assert dict(call.trailing_metadata())["idempotency-replayed"] == "true"
    assert _entries(db, key) == 1


def _previous_month(now: datetime) -> datetime:
    """Noon on the 15th of the month before `now`'s (UTC)."""
    last = now.astimezone(UTC).replace(day=1) - timedelta(days=1)
    return last.replace(day=15, hour=12, minute=0, second=0, microsecond=0)


@KINDS
def test_a_duplicate_whose_first_record_is_in_last_months_partition_is_replayed(
    uncached, database, db, make_key
):
    """A key first received last month: its record sits in last month's partition, and a retry this
    month (whose own receipt would date a new record in this month's) finds it and replays it."""
    key = make_key()
    request = transfer_pb2.DepositRequest(account_id="alice", amount=money(9))
    channel, stub = _stub(uncached)
    with channel:
        first, call = stub.Deposit.with_call(request, metadata=[("idempotency-key", key)], timeout=10)
        received = _records(db, key)[0][1]
        assert abs(received - datetime.now(UTC)) < timedelta(minutes=1)  # dated by its receipt
        earlier = _previous_month(datetime.now(UTC))
        with psycopg.connect(database, autocommit=True) as conn:
            partitions.create_partition(conn, partitions.Month.of(earlier))
        db.execute("UPDATE idempotency_record SET key_time = %s WHERE key = %s", (earlier, key))
        db.commit()
        ((table, dated),) = _records(db, key)
        assert table == partitions.Month.of(earlier).table and dated == earlier
        again, call = stub.Deposit.with_call(request, metadata=[("idempotency-key", key)], timeout=10)
    trailers = dict(call.trailing_metadata())
    assert again.SerializeToString() == first.SerializeToString()
    assert trailers["idempotency-replayed"] == "true"
    # It expires with its first receipt, not with the retry.
    assert trailers["idempotency-expires-at"] == (earlier + timedelta(days=30)).isoformat(
        timespec="milliseconds"
    )
    assert _entries(db, key) == 1
    assert len(_records(db, key)) == 1


def _claim(conn: psycopg.Connection[Any], key: str, key_time: datetime, *, dated_by_key: bool) -> Any:
    return store.claim_key(conn, scope="s", key=key, key_time=key_time, dated_by_key=dated_by_key)


def _advisory_locks(conn: psycopg.Connection[Any], pid: int) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s AND granted", (pid,)
    ).fetchone()
    assert row is not None
    return int(row[0])


#: Stands in for the claim's record read on one connection (search_path): the first read of each
#: claim finds nothing, as a read whose snapshot predates a twin's commit would; later reads are real.
_STALE_FIRST_READ = """
CREATE SCHEMA IF NOT EXISTS race;
CREATE OR REPLACE FUNCTION race.idempotency_completed(p_scope text, p_key text, p_key_time timestamptz)
    RETURNS public.idempotency_record LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF coalesce(current_setting('race.first_read_done', true), '') <> 'yes' THEN
        PERFORM set_config('race.first_read_done', 'yes', true);
        RETURN NULL;
    END IF;
    RETURN public.idempotency_completed(p_scope, p_key, p_key_time);
END $$;
"""


@KINDS
def test_a_twin_that_commits_between_the_lookup_and_the_lock_is_found(database, make_key):
    """The race the claim's second read closes. The claim reads the key's record and only then tries
    the lock: a twin that commits (and so releases the lock) after that read started is invisible to
    it, and the lock is granted. Forced here: the twin stores the key first, then the claim's first
    read is made to find nothing (a stand-in function, first on the claiming connection's
    search_path). The read after the lock, a query started after it was granted, must see the
    twin's record (dated at another receipt time, so the primary key alone would not), and the lock
    must be let go at once."""
    prepare_database(database, timedelta(days=30))
    key = make_key()
    now = datetime.now(UTC)
    with psycopg.connect(database, autocommit=True) as twin:
        stored = store_key(twin, scope="s", key=key, key_time=now - timedelta(minutes=1), dated_by_key=False)
        assert stored.status is ClaimStatus.CLAIMED
        twin.execute(_STALE_FIRST_READ)
    with psycopg.connect(database, autocommit=True, options="-c search_path=race,public") as conn:
        claim = _claim(conn, key, now, dated_by_key=False)
        assert claim.status is ClaimStatus.EXISTING
        assert claim.existing is not None and claim.existing.outcome == STORED_OK
        with psycopg.connect(database, autocommit=True) as observer:
            assert _advisory_locks(observer, conn.info.backend_pid) == 0
        assert conn.execute("SELECT count(*) FROM idempotency_record WHERE key = %s", (key,)).fetchone() == (
            1,
        )


def test_a_twin_in_flight_holds_any_key_kind_off(database):
    """While a twin's claim is held and its handler's transaction uncommitted, a second claim of an
    opaque key is IN_FLIGHT at once; after the twin commits (and lets the key go), the same claim
    finds its record (in any partition)."""
    prepare_database(database, timedelta(days=30))
    key = "twin/" + uuid.uuid4().hex
    now = datetime.now(UTC)
    with (
        psycopg.connect(database, autocommit=True) as twin,
        psycopg.connect(database, autocommit=True) as other,
    ):
        claimed = _claim(twin, key, now, dated_by_key=False)
        assert claimed.status is ClaimStatus.CLAIMED
        store.begin_handler(twin)
        assert (
            _claim(other, key, now + timedelta(seconds=1), dated_by_key=False).status is ClaimStatus.IN_FLIGHT
        )
        assert claimed.created_at is not None
        record = completed_record(scope="s", key=key, key_time=now, created_at=claimed.created_at)
        store.complete_key(twin, record=record, account_id=None, keep_handler_writes=True)
        assert _advisory_locks(other, twin.info.backend_pid) == 0
        claim = _claim(other, key, now + timedelta(seconds=2), dated_by_key=False)
        assert claim.status is ClaimStatus.EXISTING and claim.existing is not None
        assert claim.existing.key == key and claim.existing.key_time == now
        assert store.find_key(other, key=key)[0].key_time == now


@pytest.mark.parametrize(
    ("key", "kind"),
    [("0d9f7c1e-4a3b-4c2d-8e5f-6a7b8c9d0e1f", "a version 4 UUID"), ("order-1", "an opaque key")],
    ids=["uuid4", "opaque"],
)
def test_a_shard_requiring_uuidv7_refuses_other_keys_and_stores_nothing(database, db, key, kind):
    daemon = start_shard(make_settings(database, require_uuidv7=True))
    try:
        channel, stub = _stub(daemon)
        with channel:
            request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Deposit(request, metadata=[("idempotency-key", key)], timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_info(refused.value)[0].reason == "IDEMPOTENCY_KEY_INVALID"
            assert "this shard accepts only UUIDv7 keys" in (refused.value.details() or "")
            assert kind in (refused.value.details() or "")
            assert db.execute("SELECT count(*) FROM idempotency_record").fetchone() == (0,)
            assert db.execute("SELECT count(*) FROM accounts").fetchone() == (0,)
            stub.Deposit(
                request, metadata=[("idempotency-key", str(new_key()))], timeout=10
            )  # a UUIDv7 is served
            assert db.execute("SELECT count(*) FROM ledger_entries").fetchone() == (1,)
    finally:
        daemon.stop(0.5)


def test_the_key_stays_held_from_its_hand_over_until_the_commit(database):
    """The record's statement exchanges the claim's session lock for a transaction lock: between it
    and the COMMIT a twin still finds the key in flight (the record is not visible yet), after the
    COMMIT the key is free; the handler's bounds were the transaction's alone."""
    prepare_database(database, timedelta(days=30))
    key = "handover/" + uuid.uuid4().hex
    now = datetime.now(UTC)
    with (
        psycopg.connect(database, autocommit=True) as holder,
        psycopg.connect(database, autocommit=True) as twin,
    ):
        own_timeout = holder.execute("SELECT current_setting('lock_timeout')").fetchone()
        claim = store.claim_key(holder, scope="s", key=key, key_time=now)
        assert claim.status is ClaimStatus.CLAIMED
        store.begin_handler(holder, lock_timeout_ms=1234)
        assert holder.execute("SELECT current_setting('lock_timeout')").fetchone() == ("1234ms",)
        handed_over = store.HAND_OVER.format(rows="(SELECT 1) AS one")
        assert holder.execute(handed_over, {"scope": "s", "key": key}).fetchone() == (True,)
        assert _claim(twin, key, now, dated_by_key=False).status is ClaimStatus.IN_FLIGHT
        holder.execute("COMMIT")
        assert holder.execute("SELECT current_setting('lock_timeout')").fetchone() == own_timeout
        assert _advisory_locks(twin, holder.info.backend_pid) == 0
        claimed = _claim(twin, key, now, dated_by_key=False)
        assert claimed.status is ClaimStatus.CLAIMED  # no record was stored: the key is free again
        store.release_claim(twin, scope="s", key=key)
