"""Every idempotency record of a moved account moves with it, the refund of a transfer included:
sent again after the move, to the new owner, each call is answered from its record, verbatim."""

from __future__ import annotations

import time
import uuid

import grpc

from shardrouter.core.callers import CALLER_METADATA
from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.internal.v1 import ledger_pb2, ledger_pb2_grpc
from shardrouter.reshard.move import Move, MoveSettings, start_move
from shardrouter.shardd.ledger.service import credit_key, refund_key
from shardrouter.v1 import transfer_pb2
from tests.helpers import money
from tests.reshard.cluster import FIRST, LAST, Pair, accounts, assert_no_leftovers, seed, send


def _refund(pair: Pair, shard_id: str, transfer_id: str, source: str, reason: str) -> tuple[bytes, str]:
    with grpc.insecure_channel(f"127.0.0.1:{pair.ports[shard_id]}") as channel:
        stub = ledger_pb2_grpc.ShardLedgerServiceStub(channel)
        reply, call = stub.RefundTransfer.with_call(
            ledger_pb2.RefundTransferRequest(
                transfer_id=transfer_id, reason=reason, source_account_id=source
            ),
            metadata=[
                (KEY_METADATA, str(refund_key(uuid.UUID(transfer_id)))),
                (CALLER_METADATA, "relay:shard-0"),
            ],
            timeout=5,
        )
    replayed = dict(call.trailing_metadata()).get("idempotency-replayed", "")
    return reply.SerializeToString(deterministic=True), str(replayed)


def test_a_refund_sent_again_after_the_move_replays_from_its_moved_record(pair: Pair) -> None:
    moving, staying = accounts(pair, 10)
    source = moving[0]
    nowhere = next(a for a in staying if pair.owner(a) == "shard-1")  # never opened
    seed(pair, [source])
    answer = send(
        pair,
        "Transfer",
        transfer_pb2.TransferRequest(
            source_account_id=source, destination_account_id=nowhere, amount=money(7)
        ),
        new_key(),
        source,
    )
    assert not isinstance(answer, grpc.RpcError), answer
    transfer_id = answer.transfer.transfer_id  # type: ignore[attr-defined]
    # The credit is refused for good (no such account there): dead letter, then the relay's refund.
    deadline = time.monotonic() + 30
    while not pair.sql("shard-0", "SELECT 1 FROM dead_letters WHERE refunded_at IS NOT NULL"):
        assert time.monotonic() < deadline, "the relay did not refund the transfer"
        time.sleep(0.1)
    (reason,) = pair.sql("shard-0", "SELECT reason FROM dead_letters")[0]
    before = _refund(pair, "shard-0", transfer_id, source, str(reason))  # as the relay sent it
    assert before[1] == "true"
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=MoveSettings()) as move:
        move.run()
    assert record.figures["rows_moved"]["dead_letters"] == 1
    after = _refund(pair, "shard-1", transfer_id, source, str(reason))
    assert after == before  # the first answer's bytes, replayed from the record that moved
    assert pair.sql("shard-1", "SELECT count(*) FROM ledger_entries WHERE kind = 'refund'") == [(1,)]
    assert pair.sql("shard-0", "SELECT count(*) FROM idempotency_record WHERE account_hash IS NULL") == [(0,)]
    assert_no_leftovers(pair)


def _ledger_call(
    pair: Pair, shard_id: str, method: str, request: object, key: uuid.UUID, caller: str
) -> object:
    with grpc.insecure_channel(f"127.0.0.1:{pair.ports[shard_id]}") as channel:
        stub = ledger_pb2_grpc.ShardLedgerServiceStub(channel)
        try:
            return getattr(stub, method)(
                request, metadata=[(KEY_METADATA, str(key)), (CALLER_METADATA, caller)], timeout=5
            )
        except grpc.RpcError as error:
            return error


def test_a_voided_credit_moves_with_its_account_and_fences_any_relay_there(pair: Pair) -> None:
    """The void is a fact of the transfer on the destination account's slot: after a move, a late
    credit under another relay's key scope is refused on the new owner as it was on the old."""
    moving, staying = accounts(pair, 4)
    destination, source = moving[0], next(a for a in staying if pair.owner(a) == "shard-1")
    seed(pair, [destination])
    transfer_id = new_key()  # a UUIDv7 of now: its derived key is inside the retention window
    key = credit_key(transfer_id)
    void = ledger_pb2.VoidCreditRequest(
        transfer_id=str(transfer_id), reason="relay gave up", destination_account_id=destination
    )
    assert not isinstance(
        _ledger_call(pair, "shard-0", "VoidCredit", void, key, "relay:shard-9"), grpc.RpcError
    )
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=MoveSettings()) as move:
        move.run()
    assert record.figures["rows_moved"]["voided_credits"] == 1
    credit = ledger_pb2.CreditTransferRequest(
        transfer_id=str(transfer_id),
        source_account_id=source,
        destination_account_id=destination,
        amount=money(5),
    )
    refused = _ledger_call(pair, "shard-1", "CreditTransfer", credit, key, "relay:shard-1")
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION, refused
    assert "voided" in (refused.details() or "")
    assert pair.sql("shard-1", "SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_in'") == [(0,)]
    assert pair.sql("shard-0", "SELECT count(*) FROM voided_credits") == [(0,)]
    assert_no_leftovers(pair)
