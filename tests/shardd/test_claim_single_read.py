"""A UUIDv7 key's claim reads its record once: the race a second read used to close is closed by the
primary key instead.

The claim reads the key's record and only then tries the lock. A twin that commits (and so lets the
lock go) between the two is not seen and the lock is granted: for a key dated by its own time the
claim is CLAIMED without reading again, and the completed record of this call then meets the twin's
in the primary key (scope, key, key_time), so it cannot commit and nothing of the call is applied.
A key dated by its receipt is still read again after the lock (`test_key_kinds`). Forced here on
two real connections: the claim's read is made to find nothing (an empty view of the key table
first on the claiming connection's search_path), as a read whose snapshot predates the twin's commit.
"""

from __future__ import annotations

import grpc
import psycopg
import pytest
from psycopg import errors

from shardrouter.core.keys import new_key, parse_key
from shardrouter.shardd.idempotency import store
from shardrouter.shardd.idempotency.record import ClaimStatus
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import completed_record, error_info, key_metadata, make_settings, money, store_key

#: Stands in for the key table where a connection whose search_path starts with `race` reads it: a
#: view of it that finds nothing, while inserts through it reach the table.
_BLIND_READ = """
CREATE SCHEMA IF NOT EXISTS race;
CREATE OR REPLACE VIEW race.idempotency_record AS SELECT * FROM public.idempotency_record WHERE false;
"""
_RACE_PATH = "-c search_path=race,public"


def test_a_uuidv7_twin_committed_between_the_read_and_the_lock_is_stopped_by_the_primary_key(database):
    key = str(new_key())
    key_time = parse_key(key).dated_at
    assert key_time is not None
    with psycopg.connect(database, autocommit=True) as twin:
        assert store_key(twin, scope="s", key=key, key_time=key_time).status is ClaimStatus.CLAIMED
        twin.execute(_BLIND_READ)
    with psycopg.connect(database, autocommit=True, options=_RACE_PATH) as conn:
        claim = store.claim_key(conn, scope="s", key=key, key_time=key_time)
        assert claim.status is ClaimStatus.CLAIMED  # one read, and it saw nothing
        assert claim.created_at is not None
        store.begin_handler(conn)
        conn.execute("INSERT INTO accounts (id, currency, balance) VALUES ('race-account', 'EUR', 5)")
        record = completed_record(scope="s", key=key, key_time=key_time, created_at=claim.created_at)
        with pytest.raises(errors.UniqueViolation) as met:
            store.complete_key(conn, record=record, account_id="race-account", keep_handler_writes=True)
        # What the interceptor answers in flight (steps._twin_holds_the_key).
        assert (met.value.diag.table_name or "").startswith("idempotency_record")
        store.release_claim(conn, scope="s", key=key)
    with psycopg.connect(database, autocommit=True) as db:
        assert db.execute("SELECT count(*) FROM idempotency_record WHERE key = %s", (key,)).fetchone() == (1,)
        assert db.execute("SELECT count(*) FROM accounts WHERE id = 'race-account'").fetchone() == (0,)
        locks = db.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
            " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
        ).fetchone()
        assert locks == (0,)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "unpipelined"])
def test_through_the_daemon_the_call_that_missed_the_twin_is_answered_in_flight(database, db, pipelined):
    """The same race through a real daemon's interceptor: a key completed by one daemon, resent to a
    second daemon once the claim's read was made to miss it. Its Deposit runs, its record meets the first in
    the primary key, and the call is answered ABORTED (in flight, retry): nothing applied twice."""
    key = str(new_key())
    request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
    first = start_shard(make_settings(database, db_pipeline=pipelined))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
                request, metadata=key_metadata(key), timeout=10
            )
    finally:
        first.stop(0.5)
    # The completed record made invisible to a claim's read (which looks for completed records
    # only), as a read whose snapshot predates the twin's commit; the row stays for the primary key.
    db.execute(
        "UPDATE idempotency_record SET state = 'in_progress', status_code = NULL, response = NULL"
        " WHERE key = %s",
        (key,),
    )
    blind = start_shard(make_settings(database, db_pipeline=pipelined, replay_cache_entries=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{blind.port}") as channel:
            with pytest.raises(grpc.RpcError) as answered:
                transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
                    request, metadata=key_metadata(key), timeout=10
                )
    finally:
        blind.stop(0.5)
    assert answered.value.code() == grpc.StatusCode.ABORTED
    assert error_info(answered.value)[0].reason == "IDEMPOTENCY_KEY_IN_FLIGHT"
    assert db.execute(
        "SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (key,)
    ).fetchone() == (1,)
    assert db.execute("SELECT balance FROM accounts WHERE id = 'alice'").fetchone() == (5,)
    assert db.execute("SELECT count(*) FROM idempotency_record WHERE key = %s", (key,)).fetchone() == (1,)
