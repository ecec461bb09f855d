"""TransferClient against a real in-process shard daemon (real gRPC server, real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from shardrouter.client import (
    InvalidOperation,
    Operation,
    OperationState,
    RpcFailure,
    SqliteOperationStore,
    TransferClient,
)
from shardrouter.core.errors import Reason
from shardrouter.shardd.server import ShardDaemon
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import deposit


@pytest.fixture
def client(shard: ShardDaemon, tmp_path: Path) -> Iterator[TransferClient]:
    with SqliteOperationStore(tmp_path / "ops.db") as store:
        with TransferClient(f"127.0.0.1:{shard.port}", store=store, caller_id="tests") as c:
            yield c


def _ledger_rows(dsn: str, key: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (str(key),)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_transfer_succeeds_and_a_resend_replays_the_same_transfer(
    client: TransferClient, stub: transfer_pb2_grpc.TransferServiceStub, database: str
) -> None:
    deposit(stub, "alice", 10_000)
    deposit(stub, "bob", 1)
    op = client.create_transfer("alice", "bob", 2_500, "EUR", reference="invoice 7")
    first = client.send_with_retries(op)
    assert first.ok and not first.replayed and first.attempts == 1
    assert first.state is OperationState.SUCCEEDED
    assert isinstance(first.response, transfer_pb2.TransferResponse)
    transfer = first.response.transfer
    assert transfer.state == transfer_pb2.TRANSFER_STATE_COMPLETED

    second = client.send_with_retries(op)
    assert second.ok and second.replayed
    assert isinstance(second.response, transfer_pb2.TransferResponse)
    assert second.response.transfer.transfer_id == transfer.transfer_id
    assert second.response == first.response

    stored = client.store.get(op.id)  # type: ignore[union-attr]
    assert stored is not None and [a.replayed for a in stored.attempts] == [False, True]
    assert _ledger_rows(database, op.idempotency_key) == 2  # one debit, one credit, not four
    assert client.get_balance("alice").balance.amount_minor == 7_500
    assert client.get_balance("bob").balance.amount_minor == 2_501
    fetched = client.get_transfer("alice", transfer.transfer_id)
    assert fetched.transfer.transfer_id == transfer.transfer_id
    assert fetched.transfer.reference == "invoice 7"


def test_deposit_opens_an_account(client: TransferClient) -> None:
    result = client.deposit("carol", 1_234, "EUR")
    assert result.ok and isinstance(result.response, transfer_pb2.DepositResponse)
    assert result.response.balance.amount_minor == 1_234
    assert client.get_balance("carol").balance.currency == "EUR"


def test_business_failure_is_recorded_not_retried_and_replayed_on_resend(
    client: TransferClient, stub: transfer_pb2_grpc.TransferServiceStub, database: str
) -> None:
    deposit(stub, "alice", 100)
    deposit(stub, "bob", 100)
    op = client.create_transfer("alice", "bob", 5_000, "EUR")
    result = client.send_with_retries(op)
    assert result.code is grpc.StatusCode.FAILED_PRECONDITION
    assert result.reason == Reason.INSUFFICIENT_FUNDS
    assert result.state is OperationState.FAILED and result.attempts == 1
    stored = client.store.get(op.id)  # type: ignore[union-attr]
    assert stored is not None and len(stored.attempts) == 1
    assert stored.outcome is not None and stored.outcome.reason == Reason.INSUFFICIENT_FUNDS
    assert stored.outcome.error_metadata == {"account_id": "alice"}
    again = client.send_with_retries(op)
    assert again.replayed and again.reason == Reason.INSUFFICIENT_FUNDS and again.attempts == 1
    assert _ledger_rows(database, op.idempotency_key) == 0
    assert client.get_balance("alice").balance.amount_minor == 100


def test_invalid_argument_from_the_shard_is_final(client: TransferClient) -> None:
    # Local validation refuses this before storing anything...
    with pytest.raises(InvalidOperation, match="amount_minor"):
        client.create_transfer("alice", "alice", 0, "EUR")
    assert client.store.list_operations() == []  # type: ignore[union-attr]
    # ...so store one by hand, as an older client version might have, to see the shard's answer.
    op = Operation.new(
        "transfer",
        {"source": "alice", "destination": "alice", "amount_minor": 0, "currency": "EUR", "reference": ""},
    )
    client.store.create(op)  # type: ignore[union-attr]
    result = client.send_with_retries(op)
    assert result.code is grpc.StatusCode.INVALID_ARGUMENT and result.attempts == 1
    assert result.state is OperationState.FAILED
    assert result.reason == Reason.INVALID_REQUEST
    assert result.error is not None
    assert {f for f, _ in result.error.field_violations} >= {"amount.amount_minor", "destination_account_id"}


def test_reads_raise_rpc_failure_with_the_reason(client: TransferClient) -> None:
    with pytest.raises(RpcFailure) as raised:
        client.get_balance("nobody")
    assert raised.value.code is grpc.StatusCode.NOT_FOUND
    assert raised.value.details.reason == Reason.ACCOUNT_NOT_FOUND


def test_reads_retry_unavailable_then_give_up(tmp_path: Path) -> None:
    slept: list[float] = []
    with TransferClient("127.0.0.1:1", store=None, sleep=slept.append) as client:
        with pytest.raises(RpcFailure) as raised:
            client.get_balance("alice", attempts=3)
        with pytest.raises(RuntimeError, match="read-only"):
            client.create_deposit("alice", 1, "EUR")
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    assert len(slept) == 2
