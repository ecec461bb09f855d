"""Routing hashes on every row that moves with an account, and slot fences enforced by the database.

Real shard daemon (gRPC on loopback) over a real PostgreSQL database.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
import zlib

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardrouter.core.shardmap import DEFAULT_SLOTS
from shardrouter.shardd import fences
from shardrouter.shardd.fences import SlotFence
from shardrouter.shardd.migrations import FENCED_TABLES
from shardrouter.v1 import transfer_pb2
from tests.helpers import deposit, key_metadata, money


def _slot(account: str) -> int:
    return zlib.crc32(account.encode()) % DEFAULT_SLOTS


def _slot_twin(account: str) -> str:
    """Another account id in the same slot."""
    return next(f"twin-{i}" for i in range(10**6) if _slot(f"twin-{i}") == _slot(account))


def _fence_of(account: str, move_id: str = "move-1") -> SlotFence:
    slot = _slot(account)
    return SlotFence(move_id, DEFAULT_SLOTS, slot, slot)


def _deposit_request(account: str, amount: int = 5) -> transfer_pb2.DepositRequest:
    return transfer_pb2.DepositRequest(account_id=account, amount=money(amount))


def test_account_hash_in_sql_is_the_routers_crc32(shard, db):
    rng = random.Random(7)
    alphabet = "abcxyz0189-_.:ÄößéЖ中🙂"
    ids = ["", "a", "acct-1", "x" * 128] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(2000)
    ]
    rows = db.execute("SELECT id, account_hash(id) FROM unnest(%s::text[]) AS id", (ids,)).fetchall()
    mismatches = [(i, h) for i, h in rows if h != zlib.crc32(i.encode())]
    assert mismatches == []


def test_every_row_of_an_account_carries_its_hash(stub, db):
    deposit(stub, "alice", 1_000)
    deposit(stub, "bob", 1)
    stub.Transfer(
        transfer_pb2.TransferRequest(
            source_account_id="alice", destination_account_id="bob", amount=money(10)
        ),
        metadata=key_metadata(),
    )
    expected = {"alice": zlib.crc32(b"alice"), "bob": zlib.crc32(b"bob")}
    for account_id, hash_ in db.execute("SELECT id, account_hash FROM accounts").fetchall():
        assert hash_ == expected[account_id]
    for account_id, hash_ in db.execute("SELECT account_id, account_hash FROM ledger_entries").fetchall():
        assert hash_ == expected[account_id]
    assert db.execute("SELECT account_hash FROM transfers").fetchall() == [(expected["alice"],)]
    records = db.execute("SELECT method, account_hash FROM idempotency_record ORDER BY created_at").fetchall()
    assert [r[1] for r in records] == [expected["alice"], expected["bob"], expected["alice"]]
    # The transfer's other rows take its hash from the transfers row, whoever writes them.
    transfer_id = db.execute("SELECT id FROM transfers").fetchone()[0]
    db.execute(
        "INSERT INTO delivery_attempts (transfer_id, status_code, message) VALUES (%s, 'OK', '')",
        (transfer_id,),
    )
    assert db.execute("SELECT account_hash FROM delivery_attempts").fetchall() == [(expected["alice"],)]


def test_a_fenced_slot_refuses_calls_retryably_and_applies_nothing(stub, db):
    deposit(stub, "fenced-acct", 100)
    deposit(stub, "free-acct", 100)
    fences.raise_fence(db, _fence_of("fenced-acct"))
    md = key_metadata()
    with pytest.raises(grpc.RpcError) as refused:
        stub.Deposit(_deposit_request("fenced-acct"), metadata=md)
    err = refused.value
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "moving to another shard" in err.details()
    status = rpc_status.from_call(err)
    infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    assert info.reason == "SLOT_RANGE_MOVING"
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
    key = uuid.UUID(md[0][1])
    assert (
        db.execute("SELECT count(*) FROM idempotency_record WHERE key = %s", (str(key),)).fetchone()[0] == 0
    )
    assert db.execute("SELECT balance FROM accounts WHERE id = 'fenced-acct'").fetchone()[0] == 100
    # Other slots flow; a transfer out of a fenced account is refused like a deposit.
    stub.Deposit(_deposit_request("free-acct"), metadata=key_metadata())
    with pytest.raises(grpc.RpcError) as transfer_refused:
        stub.Transfer(
            transfer_pb2.TransferRequest(
                source_account_id="free-acct", destination_account_id="fenced-acct", amount=money(1)
            ),
            metadata=key_metadata(),
        )
    assert transfer_refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # Lowering the fence (an aborted move) frees the key: the retry applies once.
    assert fences.lower_fence(db, "move-1")
    stub.Deposit(_deposit_request("fenced-acct"), metadata=md)
    _, call = stub.Deposit.with_call(_deposit_request("fenced-acct"), metadata=md)
    assert dict(call.trailing_metadata())["idempotency-replayed"] == "true"
    assert db.execute("SELECT balance FROM accounts WHERE id = 'fenced-acct'").fetchone()[0] == 105


#: A column each table's test update sets to itself (generated columns cannot be set).
_SAME_VALUE_COLUMN = {
    "accounts": "balance",
    "ledger_entries": "reference",
    "transfers": "reference",
    "outbox": "attempts",
    "delivery_attempts": "message",
    "dead_letters": "reason",
    "idempotency_record": "method",
    "voided_credits": "reason",
}


@pytest.mark.parametrize("table", FENCED_TABLES)
def test_the_fence_holds_against_any_writer(stub, db, table):
    deposit(stub, "fenced-acct", 100)
    deposit(stub, "other-acct", 1)
    stub.Transfer(
        transfer_pb2.TransferRequest(
            source_account_id="fenced-acct", destination_account_id="other-acct", amount=money(1)
        ),
        metadata=key_metadata(),
    )
    transfer_id = db.execute("SELECT id FROM transfers").fetchone()[0]
    outbox_id = db.execute(
        "INSERT INTO outbox (transfer_id, destination_shard_id, idempotency_key, payload)"
        " VALUES (%s, 'shard-x', %s, '') RETURNING id",
        (transfer_id, uuid.uuid4()),
    ).fetchone()[0]
    db.execute(
        "INSERT INTO delivery_attempts (transfer_id, status_code) VALUES (%s, 'UNAVAILABLE')", (transfer_id,)
    )
    db.execute(
        "INSERT INTO dead_letters (transfer_id, outbox_id, reason, refund_key) VALUES (%s, %s, 'test', %s)",
        (transfer_id, outbox_id, uuid.uuid4()),
    )
    db.execute(
        "INSERT INTO voided_credits (transfer_id, account_id, reason) VALUES (%s, 'fenced-acct', 'test')",
        (uuid.uuid4(),),
    )
    hash_ = zlib.crc32(b"fenced-acct")
    column = _SAME_VALUE_COLUMN[table]
    touch = f"UPDATE {table} SET {column} = {column} WHERE account_hash = %s"
    assert db.execute(touch, (hash_,)).rowcount >= 1  # the rows are there, and writable before the fence
    fences.raise_fence(db, _fence_of("fenced-acct"))
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="moving to another shard"):
        db.execute(touch, (hash_,))
    # Rows other tables reference (accounts, transfers) are kept by their foreign keys as well.
    referenced = table in ("accounts", "transfers", "outbox")
    with pytest.raises(
        (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.ForeignKeyViolation)
        if referenced
        else psycopg.errors.ObjectNotInPrerequisiteState
    ):
        db.execute(f"DELETE FROM {table} WHERE account_hash = %s", (hash_,))


def test_fenced_rows_can_be_neither_changed_nor_deleted(stub, db):
    deposit(stub, "fenced-acct", 100)
    fences.raise_fence(db, _fence_of("fenced-acct"))
    for statement in (
        "UPDATE accounts SET balance = 0 WHERE id = 'fenced-acct'",
        "DELETE FROM ledger_entries WHERE account_id = 'fenced-acct'",
        "DELETE FROM idempotency_record WHERE account_hash = account_hash('fenced-acct')",
        f"INSERT INTO accounts (id, currency) VALUES ('{_slot_twin('fenced-acct')}', 'EUR')",
    ):
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="moving to another shard"):
            db.execute(statement)
    assert db.execute("SELECT balance FROM accounts WHERE id = 'fenced-acct'").fetchone()[0] == 100


def test_after_the_drain_no_write_to_the_fenced_slots_commits_under_load(stub, db, database):
    fenced = ["fenced-acct"]
    fence_slot = _slot(fenced[0])
    free = [f"free-{i}" for i in range(8)]
    stop = threading.Event()
    outcomes: dict[str, int] = {"ok": 0, "moving": 0}
    lock = threading.Lock()

    def load(accounts: list[str]) -> None:
        while not stop.is_set():
            account = random.choice(accounts)
            try:
                stub.Deposit(_deposit_request(account, 1), metadata=key_metadata(), timeout=5)
                with lock:
                    outcomes["ok"] += 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
                with lock:
                    outcomes["moving"] += 1

    threads = [threading.Thread(target=load, args=(fenced if i % 2 else free,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        fenced_at = fences.raise_fence(db, SlotFence("move-1", DEFAULT_SLOTS, fence_slot, fence_slot))
        with psycopg.connect(database, autocommit=True) as control:
            fences.drain(control, fenced_at, timeout_s=5)
        counted = "SELECT count(*), coalesce(sum(amount_minor), 0) FROM ledger_entries WHERE account_hash %% %s = %s"
        after_drain = db.execute(counted, (DEFAULT_SLOTS, fence_slot)).fetchone()
        free_before = db.execute(
            "SELECT count(*) FROM ledger_entries WHERE account_id LIKE 'free-%%'"
        ).fetchone()[0]
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert db.execute(counted, (DEFAULT_SLOTS, fence_slot)).fetchone() == after_drain
    assert (
        db.execute("SELECT count(*) FROM ledger_entries WHERE account_id LIKE 'free-%%'").fetchone()[0]
        > free_before
    )
    assert outcomes["moving"] > 0
    print(f"\nfence under load: {outcomes['ok']} applied, {outcomes['moving']} refused SLOT_RANGE_MOVING")


def test_only_the_fencing_move_deletes_its_rows_and_changes_nothing(stub, db, database):
    deposit(stub, "fenced-acct", 100)
    fences.raise_fence(db, _fence_of("fenced-acct", move_id="move-7"))
    with psycopg.connect(database) as mover:
        mover.execute("SET shardrouter.moving_out = 'move-8'")  # another move's name: refused
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            mover.execute("DELETE FROM idempotency_record WHERE account_hash = account_hash('fenced-acct')")
        mover.rollback()
        mover.execute("SET shardrouter.moving_out = 'move-7'")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):  # the move may only delete
            mover.execute("UPDATE accounts SET balance = 1 WHERE id = 'fenced-acct'")
        mover.rollback()
        mover.execute("SET shardrouter.moving_out = 'move-7'")
        deleted = mover.execute(
            "DELETE FROM idempotency_record WHERE account_hash = account_hash('fenced-acct')"
        ).rowcount
        mover.commit()
    assert deleted == 1
    assert db.execute("SELECT count(*) FROM idempotency_record").fetchone()[0] == 0
