"""The seed's verification under real concurrency, and transient faults that must leave nothing behind."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardrouter.shardd.server import ShardDaemon
from shardrouter.v1 import transfer_pb2
from tests.helpers import deposit, key_metadata, money


@pytest.fixture
def shard(shard_in_each_pipeline_mode: ShardDaemon) -> ShardDaemon:
    """Every test here runs against a pipelined and an unpipelined shard."""
    return shard_in_each_pipeline_mode


def _fire(stub, request, md, n):
    barrier = threading.Barrier(n)

    def attempt(_):
        barrier.wait()
        try:
            response, call = stub.Transfer.with_call(request, metadata=md, timeout=10)
            return ("ok", response.SerializeToString(), dict(call.trailing_metadata()))
        except grpc.RpcError as err:
            return ("err", err, dict(err.trailing_metadata()))

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(attempt, range(n)))


def test_twenty_parallel_attempts_with_one_key_apply_once(stub, db):
    deposit(stub, "acct-8842", 10_000)
    deposit(stub, "acct-1190", 1)
    request = transfer_pb2.TransferRequest(
        source_account_id="acct-8842", destination_account_id="acct-1190", amount=money(2500)
    )
    md = key_metadata()
    results = _fire(stub, request, md, 20)
    firsts = [r for r in results if r[0] == "ok" and "idempotency-replayed" not in r[2]]
    replays = [r for r in results if r[0] == "ok" and r[2].get("idempotency-replayed") == "true"]
    conflicts = [r for r in results if r[0] == "err"]
    assert len(firsts) == 1
    assert len(firsts) + len(replays) + len(conflicts) == 20
    for _, body, _ in replays:
        assert body == firsts[0][1]
    for _, err, trailers in conflicts:
        assert err.code() == grpc.StatusCode.ABORTED
        status = rpc_status.from_call(err)
        assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
        assert trailers["grpc-retry-pushback-ms"] == "100"
    assert (
        db.execute(
            "SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out' AND account_id = 'acct-8842'"
        ).fetchone()[0]
        == 1
    )
    assert (
        db.execute(
            "SELECT count(*) FROM idempotency_record WHERE state = 'completed' AND key = %s",
            (md[0][1],),
        ).fetchone()[0]
        == 1
    )
    # Then a retry of any of them replays.
    response, call = stub.Transfer.with_call(request, metadata=md)
    assert response.SerializeToString() == firsts[0][1]
    assert dict(call.trailing_metadata())["idempotency-replayed"] == "true"
    print(f"\n20 parallel attempts: 1 applied, {len(replays)} replays, {len(conflicts)} ABORTED in flight")


def test_many_keys_in_parallel_each_apply_once(stub, db):
    deposit(stub, "pool", 1_000_000)
    for i in range(5):
        deposit(stub, f"dest-{i}", 1)
    keys = [key_metadata() for _ in range(40)]
    jobs = [(md, i % 5) for i, md in enumerate(keys) for _ in range(4)]

    def attempt(job):
        md, dest = job
        req = transfer_pb2.TransferRequest(
            source_account_id="pool", destination_account_id=f"dest-{dest}", amount=money(7)
        )
        for _ in range(50):
            try:
                return stub.Transfer(req, metadata=md, timeout=10).transfer.transfer_id
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.ABORTED:
                    raise
                time.sleep(0.02)
        raise AssertionError("never completed")

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(attempt, jobs))
    # All attempts of one key see one transfer id; 40 keys give 40 transfers.
    assert len(set(ids)) == 40
    for k in range(40):
        assert len(set(ids[k * 4 : (k + 1) * 4])) == 1
    assert db.execute("SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out'").fetchone()[0] == 40
    assert db.execute("SELECT balance FROM accounts WHERE id = 'pool'").fetchone()[0] == 1_000_000 - 280


def _backend_waiting_on_lock(db, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = db.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'shardd' AND wait_event_type = 'Lock'"
        ).fetchone()
        if row:
            return row[0]
        time.sleep(0.02)
    raise AssertionError("the shard's transaction never waited on the lock")


def test_connection_killed_mid_handler_leaves_no_record_and_retry_applies_once(stub, db, database):
    deposit(stub, "alice", 100)
    md = key_metadata()
    holder = psycopg.connect(database)
    holder.execute("SELECT 1 FROM accounts WHERE id = 'alice' FOR UPDATE")
    errors: list[grpc.RpcError] = []

    def call():
        try:
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md, timeout=10
            )
        except grpc.RpcError as err:
            errors.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    pid = _backend_waiting_on_lock(db)
    db.execute("SELECT pg_terminate_backend(%s)", (pid,))  # the database drops the shard's connection
    thread.join(10)
    holder.rollback()
    holder.close()
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "nothing was applied" in errors[0].details()
    key = uuid.UUID(md[0][1])
    assert (
        db.execute("SELECT count(*) FROM idempotency_record WHERE key = %s", (str(key),)).fetchone()[0] == 0
    )
    assert (
        db.execute("SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (str(key),)).fetchone()[
            0
        ]
        == 0
    )
    reply = stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    assert reply.balance.amount_minor == 105
    again = stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    assert again == reply
    assert (
        db.execute("SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (str(key),)).fetchone()[
            0
        ]
        == 1
    )


def test_deadline_running_out_in_the_database_rolls_back(stub, db, database):
    deposit(stub, "alice", 100)
    md = key_metadata()
    holder = psycopg.connect(database)
    holder.execute("SELECT 1 FROM accounts WHERE id = 'alice' FOR UPDATE")
    with pytest.raises(grpc.RpcError) as info:
        stub.Deposit(
            transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md, timeout=0.5
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.7)  # let the shard's statement timeout fire and roll back
    holder.rollback()
    holder.close()
    key = uuid.UUID(md[0][1])
    assert (
        db.execute("SELECT count(*) FROM idempotency_record WHERE key = %s", (str(key),)).fetchone()[0] == 0
    )
    reply = stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    assert reply.balance.amount_minor == 105
