"""Each outcome of the idempotency interceptor, with its exact status, details and trailers.

Real shard daemon (gRPC on loopback) over a real PostgreSQL database.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardrouter.core.keys import new_key
from shardrouter.shardd.server import ShardDaemon
from shardrouter.v1 import transfer_pb2
from tests.helpers import deposit, key_metadata, money


@pytest.fixture
def shard(shard_in_each_pipeline_mode: ShardDaemon) -> ShardDaemon:
    """Every test here runs against a pipelined and an unpipelined shard."""
    return shard_in_each_pipeline_mode


def _details(err: grpc.RpcError) -> dict[str, object]:
    status = rpc_status.from_call(err)
    assert status is not None, "expected rich error details"
    out: dict[str, object] = {}
    for any_detail in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.BadRequest):
            if any_detail.Is(cls.DESCRIPTOR):
                msg = cls()
                any_detail.Unpack(msg)
                out[cls.__name__] = msg
    return out


def _trailers(obj: object) -> dict[str, object]:
    return dict(obj.trailing_metadata())  # type: ignore[attr-defined]


def _transfer(src: str = "alice", dst: str = "bob", amount: int = 100) -> transfer_pb2.TransferRequest:
    return transfer_pb2.TransferRequest(
        source_account_id=src, destination_account_id=dst, amount=money(amount)
    )


def test_new_key_applies_and_replay_returns_stored_outcome_verbatim(stub, db):
    deposit(stub, "alice", 1000)
    deposit(stub, "bob", 1)
    md = key_metadata()
    first, call1 = stub.Transfer.with_call(_transfer(), metadata=md)
    second, call2 = stub.Transfer.with_call(_transfer(), metadata=md)
    assert first.SerializeToString() == second.SerializeToString()
    t1, t2 = _trailers(call1), _trailers(call2)
    assert "idempotency-replayed" not in t1
    assert t2.pop("idempotency-replayed") == "true"
    assert t1 == t2
    assert "idempotency-expires-at" in t1
    assert db.execute("SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out'").fetchone()[0] == 1
    assert db.execute("SELECT balance FROM accounts WHERE id = 'alice'").fetchone()[0] == 900


def test_business_failure_is_stored_and_replayed_byte_for_byte(stub, db):
    deposit(stub, "alice", 10)
    deposit(stub, "bob", 1)
    md = key_metadata()
    errors = []
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as info:
            stub.Transfer(_transfer(amount=50), metadata=md)
        errors.append(info.value)
    first, second = errors
    assert first.code() == second.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert first.details() == second.details()
    assert "insufficient funds" in first.details()
    t1, t2 = _trailers(first), _trailers(second)
    assert t2.pop("idempotency-replayed") == "true"
    assert t1 == t2  # includes grpc-status-details-bin, byte for byte
    assert _details(first)["ErrorInfo"].reason == "INSUFFICIENT_FUNDS"
    # Funds arrive later: the same key still replays the stored refusal - it was an outcome.
    deposit(stub, "alice", 1000)
    with pytest.raises(grpc.RpcError) as info:
        stub.Transfer(_transfer(amount=50), metadata=md)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert db.execute("SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out'").fetchone()[0] == 0


def test_unknown_account_is_a_stored_outcome(stub, db):
    deposit(stub, "alice", 1000)
    md = key_metadata()
    with pytest.raises(grpc.RpcError) as info:
        stub.Transfer(_transfer(dst="nobody"), metadata=md)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _details(info.value)["ErrorInfo"].reason == "ACCOUNT_NOT_FOUND"
    assert db.execute("SELECT count(*) FROM idempotency_record WHERE status_code = 5").fetchone()[0] == 1


def test_key_reused_for_different_request_is_refused(stub, db):
    deposit(stub, "alice", 1000)
    deposit(stub, "bob", 1)
    md = key_metadata()
    stub.Transfer(_transfer(amount=100), metadata=md)
    with pytest.raises(grpc.RpcError) as info:
        stub.Transfer(_transfer(amount=101), metadata=md)
    err = info.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _details(err)["ErrorInfo"].reason == "IDEMPOTENCY_KEY_REUSED"
    assert "different request" in err.details()
    assert _trailers(err)["idempotency-outcome"] == "key_reused"
    assert db.execute("SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out'").fetchone()[0] == 1


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ([], "missing idempotency-key"),
        ([("idempotency-key", "")], "got 0 characters"),
        ([("idempotency-key", "two words")], "character 4 is a space"),
        ([("idempotency-key", "k" * 256)], "got 256 characters, at most 255"),
        ([("idempotency-key", "k" * 5000)], "got 5000 characters"),
        ([("idempotency-key-bin", b"\x00\x01")], "missing idempotency-key"),
        ([("idempotency-key", str(new_key())), ("idempotency-key", str(new_key()))], "sent 2 times"),
    ],
)
def test_bad_keys_are_invalid_argument_and_write_nothing(stub, db, metadata, fragment):
    with pytest.raises(grpc.RpcError) as info:
        stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=metadata)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()
    assert "UUIDv7" in info.value.details() or "sent 2 times" in fragment
    assert db.execute("SELECT count(*) FROM idempotency_record").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM accounts").fetchone()[0] == 0


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (transfer_pb2.DepositRequest(account_id="alice", amount=money(0)), "amount.amount_minor"),
        (transfer_pb2.DepositRequest(account_id="alice", amount=money(-5)), "amount.amount_minor"),
        (transfer_pb2.DepositRequest(account_id="alice", amount=money(10**16)), "amount.amount_minor"),
        (transfer_pb2.DepositRequest(account_id="alice", amount=money(5, "XXX")), "amount.currency"),
        (transfer_pb2.DepositRequest(account_id="alice", amount=money(5, "eur")), "amount.currency"),
        (transfer_pb2.DepositRequest(account_id="", amount=money(5)), "account_id"),
        (transfer_pb2.DepositRequest(account_id="al ice", amount=money(5)), "account_id"),
        (transfer_pb2.DepositRequest(account_id="a" * 65, amount=money(5)), "account_id"),
        (transfer_pb2.DepositRequest(account_id="alice"), "amount"),
        (transfer_pb2.DepositRequest(account_id="alice", amount=money(5), reference="x\x00y"), "reference"),
    ],
)
def test_validation_failure_is_not_stored_so_a_corrected_request_may_reuse_the_key(stub, db, request_, field):
    md = key_metadata()
    with pytest.raises(grpc.RpcError) as info:
        stub.Deposit(request_, metadata=md)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = _details(info.value)["BadRequest"]
    assert field in [v.field for v in bad.field_violations]
    assert db.execute("SELECT count(*) FROM idempotency_record").fetchone()[0] == 0
    reply = stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    assert reply.balance.amount_minor == 5


def test_same_account_transfer_is_invalid(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Transfer(_transfer(src="alice", dst="alice"), metadata=key_metadata())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must differ" in info.value.details()


def test_garbage_request_bytes_are_invalid_argument(shard, db):
    with grpc.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        raw = channel.unary_unary("/shardrouter.v1.TransferService/Deposit")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff\xff\x0f", metadata=key_metadata())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid" in info.value.details()
    assert db.execute("SELECT count(*) FROM idempotency_record").fetchone()[0] == 0


def test_expired_key_is_refused_and_applies_nothing(stub, db):
    old = new_key(int((datetime.now(UTC) - timedelta(days=31)).timestamp() * 1000))
    with pytest.raises(grpc.RpcError) as info:
        stub.Deposit(
            transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=key_metadata(old)
        )
    err = info.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _details(err)["ErrorInfo"].reason == "IDEMPOTENCY_KEY_EXPIRED"
    assert "reconcile" in err.details()
    assert db.execute("SELECT count(*) FROM accounts").fetchone()[0] == 0


def test_key_just_inside_the_window_is_accepted_and_replays(stub, db):
    recent = new_key(int((datetime.now(UTC) - timedelta(days=29, hours=23)).timestamp() * 1000))
    md = key_metadata(recent)
    first = stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    again, call = stub.Deposit.with_call(
        transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md
    )
    assert again == first
    assert _trailers(call)["idempotency-replayed"] == "true"


def test_key_from_the_future_is_invalid(stub):
    future = new_key(int((datetime.now(UTC) + timedelta(hours=1)).timestamp() * 1000))
    with pytest.raises(grpc.RpcError) as info:
        stub.Deposit(
            transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=key_metadata(future)
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(info.value)["ErrorInfo"].reason == "IDEMPOTENCY_KEY_FROM_FUTURE"


def test_scope_includes_the_caller(stub, db):
    key = new_key()
    a = stub.Deposit(
        transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=key_metadata(key, "team-a")
    )
    b, call = stub.Deposit.with_call(
        transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=key_metadata(key, "team-b")
    )
    # Same key, other caller: its own operation, not a replay of team-a's response.
    assert "idempotency-replayed" not in _trailers(call)
    assert a.entry_id != b.entry_id
    assert b.balance.amount_minor == 10
    scopes = [r[0] for r in db.execute("SELECT scope FROM idempotency_record ORDER BY scope")]
    assert scopes == [
        "/shardrouter.v1.TransferService/Deposit|team-a",
        "/shardrouter.v1.TransferService/Deposit|team-b",
    ]


def test_in_flight_duplicate_gets_aborted_with_retry_info_then_replays(stub, database):
    deposit(stub, "alice", 100)
    md = key_metadata()
    key = uuid.UUID(md[0][1])
    # Hold the key's row lock as an in-flight first attempt would: claim it in an open transaction.
    holder = psycopg.connect(database)
    holder.execute(
        "INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state)"
        " VALUES (%s, %s, %s, 'x', '\\x00', 'in_progress')",
        (
            "/shardrouter.v1.TransferService/Deposit|anonymous",
            key,
            datetime.fromtimestamp((key.int >> 80) / 1000, UTC),
        ),
    )
    holder.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
        (f"/shardrouter.v1.TransferService/Deposit|anonymous {key}",),
    )
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    elapsed = time.monotonic() - started
    err = info.value
    assert err.code() == grpc.StatusCode.ABORTED
    retry = _details(err)["RetryInfo"]
    assert retry.retry_delay.ToMilliseconds() == 100
    assert _trailers(err)["grpc-retry-pushback-ms"] == "100"
    assert _trailers(err)["idempotency-outcome"] == "in_flight"
    assert elapsed < 1.0, "the conflict must be answered without holding the connection"
    # The first attempt rolls back: a retry claims the key normally.
    holder.rollback()
    holder.close()
    reply = stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    assert reply.balance.amount_minor == 105


def test_row_lock_backstop_answers_in_flight_even_without_the_advisory_lock(stub, database):
    md = key_metadata()
    key = uuid.UUID(md[0][1])
    holder = psycopg.connect(database)
    holder.execute(
        "INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state)"
        " VALUES (%s, %s, %s, 'x', '\\x00', 'in_progress')",
        (
            "/shardrouter.v1.TransferService/Deposit|anonymous",
            key,
            datetime.fromtimestamp((key.int >> 80) / 1000, UTC),
        ),
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    assert info.value.code() == grpc.StatusCode.ABORTED
    holder.rollback()
    holder.close()


def test_reads_need_no_key(stub):
    deposit(stub, "alice", 42)
    reply = stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id="alice"))
    assert reply.balance.amount_minor == 42
    with pytest.raises(grpc.RpcError) as info:
        stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id="ghost"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_get_transfer_returns_the_transfer(stub):
    deposit(stub, "alice", 100)
    deposit(stub, "bob", 1)
    created = stub.Transfer(_transfer(amount=30), metadata=key_metadata()).transfer
    got = stub.GetTransfer(
        transfer_pb2.GetTransferRequest(source_account_id="alice", transfer_id=created.transfer_id)
    ).transfer
    assert got.state == transfer_pb2.TRANSFER_STATE_COMPLETED
    assert got.amount.amount_minor == 30
    with pytest.raises(grpc.RpcError) as info:
        stub.GetTransfer(
            transfer_pb2.GetTransferRequest(source_account_id="bob", transfer_id=created.transfer_id)
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_concurrent_distinct_transfers_between_two_accounts_do_not_deadlock(stub, db):
    deposit(stub, "alice", 10_000)
    deposit(stub, "bob", 10_000)
    failures: list[BaseException] = []

    def move(src: str, dst: str) -> None:
        try:
            for _ in range(10):
                stub.Transfer(_transfer(src=src, dst=dst, amount=1), metadata=key_metadata(), timeout=10)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=move, args=p) for p in [("alice", "bob"), ("bob", "alice")] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    total = db.execute("SELECT sum(balance) FROM accounts").fetchone()[0]
    assert total == 20_000
    assert db.execute("SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out'").fetchone()[0] == 80
