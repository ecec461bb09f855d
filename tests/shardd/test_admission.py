"""Load shedding: a retry storm is answered at once instead of queueing behind the database pool."""

from __future__ import annotations

import threading
import time

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.conftest import deposit, key_metadata, make_settings, money


def _retry_info(err: grpc.RpcError) -> error_details_pb2.RetryInfo | None:
    for detail in rpc_status.from_call(err).details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info
    return None


def _blocked_calls(stub, database, callers):
    """Start one Deposit per caller that blocks on a held account lock; returns (holder, threads, errors)."""
    holder = psycopg.connect(database)
    holder.execute("SELECT 1 FROM accounts WHERE id = 'hot' FOR UPDATE")
    errors: list[grpc.RpcError] = []

    def call(caller):
        try:
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id="hot", amount=money(1)),
                metadata=key_metadata(caller=caller),
                timeout=20,
            )
        except grpc.RpcError as err:
            errors.append(err)

    threads = [threading.Thread(target=call, args=(c,)) for c in callers]
    for t in threads:
        t.start()
    return holder, threads, errors


def _wait_for_lock_waiters(db, n):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        waiting = db.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'shardd' AND wait_event_type = 'Lock'"
        ).fetchone()[0]
        if waiting >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"expected {n} calls waiting on the lock")


def _one_more_call_while_blocked(stub, database, db, callers, *, caller):
    """Block one Deposit per `callers` on a held lock, then send one more (expected to be refused).

    Returns (the refusal, seconds it took, errors of the blocked calls once released)."""
    holder, threads, errors = _blocked_calls(stub, database, callers)
    try:
        _wait_for_lock_waiters(db, len(callers))
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id="cold", amount=money(1)),
                metadata=key_metadata(caller=caller),
                timeout=20,
            )
        elapsed = time.monotonic() - started
    finally:
        holder.rollback()
        holder.close()
        for t in threads:
            t.join()
    return info, elapsed, errors


@pytest.mark.parametrize(
    ("overrides", "callers", "code", "reason"),
    [
        (
            {"max_in_flight_per_caller": 2},
            ["storm", "storm"],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "RATE_LIMITED",
        ),
        ({"max_in_flight": 2}, ["a", "b"], grpc.StatusCode.UNAVAILABLE, "DATABASE_BUSY"),
    ],
)
def test_calls_beyond_the_limits_are_shed_at_once(database, db, overrides, callers, code, reason):
    daemon = start_shard(make_settings(database, **overrides))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            deposit(stub, "hot", 1)
            info, elapsed, errors = _one_more_call_while_blocked(stub, database, db, callers, caller="storm")
        assert info.value.code() == code
        assert reason in str(rpc_status.from_call(info.value))
        assert _retry_info(info.value) is not None
        assert elapsed < 0.5, f"shedding took {elapsed:.2f} s"
        assert not errors, "the admitted calls must complete"
        assert db.execute("SELECT count(*) FROM accounts WHERE id = 'cold'").fetchone()[0] == 0
    finally:
        daemon.stop(0.2)


def test_pool_exhaustion_answers_unavailable_quickly(database, db):
    daemon = start_shard(make_settings(database, pool_min=1, pool_max=2, pool_timeout_s=0.3))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            deposit(stub, "hot", 1)
            info, elapsed, errors = _one_more_call_while_blocked(stub, database, db, ["a", "b"], caller="c")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "connections are all busy" in info.value.details()
        assert _retry_info(info.value) is not None
        assert elapsed < 1.5
        assert not errors
    finally:
        daemon.stop(0.2)
