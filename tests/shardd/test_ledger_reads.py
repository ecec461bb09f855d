"""The ledger's reads that `shard-router reconcile` compares shards with (`shardd.ledger.reads`, and
the listings of `shardd.ledger.store`) see what the shard's own calls wrote: transfers made through
real daemons, delivered or dead-lettered and refunded by the relay, then read back row by row; and
reconcile's repair of a credit goes through the ledger's own writes and the relay."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import psycopg

from shardrouter.reconcile import repair
from shardrouter.reconcile.check import classify
from shardrouter.reconcile.facts import follow_up_records, read_all
from shardrouter.shardd.ledger import reads, store
from shardrouter.shardd.ledger.service import credit_key, refund_key
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import deposit, key_metadata, money
from tests.shardd.test_cross_shard import (  # noqa: F401  (two_shards is a fixture)
    TwoShards,
    _open,
    _transfer,
    accounts_on,
    two_shards,
)


def test_a_local_transfer_is_seen_by_every_read(stub: transfer_pb2_grpc.TransferServiceStub, database: str):
    before = datetime.now(UTC)
    deposit(stub, "alice", 100)
    deposit(stub, "bob", 5)
    key = key_metadata()
    made = stub.Transfer(
        transfer_pb2.TransferRequest(
            source_account_id="alice", destination_account_id="bob", amount=money(30)
        ),
        metadata=key,
    ).transfer
    tid = uuid.UUID(made.transfer_id)
    with psycopg.connect(database, autocommit=True) as conn:
        [row] = store.list_transfers(conn)
        assert (row.id, row.source_account_id, row.destination_account_id, row.amount_minor) == (
            tid,
            "alice",
            "bob",
            30,
        )
        assert (row.currency, row.state) == ("EUR", "completed")
        assert store.list_transfers(conn, [tid]) == [row] and store.list_transfers(conn, [uuid.uuid4()]) == []
        entries = {(e.kind, e.account_id, e.amount_minor, e.currency) for e in reads.transfer_entries(conn)}
        assert entries == {("transfer_out", "alice", -30, "EUR"), ("transfer_in", "bob", 30, "EUR")}
        assert {e.idempotency_key for e in reads.transfer_entries(conn, [tid])} == {key[0][1]}
        credit = reads.transfer_entry(conn, tid, "transfer_in")
        assert credit is not None and (credit.account_id, credit.transfer_id) == ("bob", tid)
        assert reads.transfer_entry(conn, tid, "refund") is None
        assert store.list_outbox(conn) == [] and store.list_dead_letters(conn, transfer_ids=[tid]) == []
        assert reads.balances_by_currency(conn) == {"EUR": (105, 2)}
        assert reads.deposits_by_currency(conn) == {"EUR": 105}
        assert reads.transfers_touched_since(conn, before) == {tid}
        assert reads.transfers_touched_since(conn, datetime.now(UTC)) == set()
        assert reads.accounts_off_ledger(conn) == []
        conn.execute("UPDATE accounts SET balance = balance + 1 WHERE id = 'bob'")  # behind the ledger's back
        [off] = reads.accounts_off_ledger(conn)
        assert (off.account_id, off.currency, off.balance, off.ledger) == ("bob", "EUR", 36, 35)


def test_cross_shard_rows_read_back_as_the_relay_left_them(two_shards: TwoShards):  # noqa: F811  (the imported fixture)
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    dst, ghost = accounts_on(two_shards.shard_map, "shard-1", 3)[1:]
    _open(two_shards, src, 1000)
    _open(two_shards, dst, 1)
    delivered = uuid.UUID(_transfer(two_shards, src, dst, 300).transfer_id)
    refunded = uuid.UUID(_transfer(two_shards, src, ghost, 200).transfer_id)  # never opened: refused
    with two_shards.db(src) as conn:
        assert {o.transfer_id: o.state for o in store.list_outbox(conn)} == {
            delivered: "pending",
            refunded: "pending",
        }
    stats = two_shards.relay("shard-0").run_once()
    assert (stats.delivered, stats.dead_lettered, stats.refunded) == (1, 1, 1)
    with two_shards.db(src) as conn:
        outbox = {o.transfer_id: o for o in store.list_outbox(conn)}
        assert (outbox[delivered].state, outbox[refunded].state) == ("delivered", "dead_lettered")
        assert outbox[delivered].idempotency_key == str(credit_key(delivered))
        assert [o.transfer_id for o in store.list_outbox(conn, [refunded])] == [refunded]
        [letter] = store.list_dead_letters(conn, transfer_ids=[refunded, delivered])
        assert letter.transfer_id == refunded and letter.refunded_at is not None
        assert letter.refund_key == str(refund_key(refunded))
        assert store.list_dead_letters(conn, transfer_ids=[delivered]) == []
        assert {t.id: t.state for t in store.list_transfers(conn)} == {
            delivered: "completed",
            refunded: "refunded",
        }
        assert sorted((e.kind, e.amount_minor) for e in reads.transfer_entries(conn, [refunded])) == [
            ("refund", 200),
            ("transfer_out", -200),
        ]
    with two_shards.db(dst) as conn:
        credit = reads.transfer_entry(conn, delivered, "transfer_in")
        assert credit is not None and (credit.account_id, credit.amount_minor) == (dst, 300)
        assert credit.idempotency_key == str(credit_key(delivered))
        held = {
            (r.key, r.method.rpartition("/")[2]): r for r in follow_up_records(conn, "shard-1", [delivered])
        }
        assert list(held) == [(str(credit_key(delivered)), "CreditTransfer")]
        assert held[str(credit_key(delivered)), "CreditTransfer"].status_code == 0
        refused = {
            (r.method.rpartition("/")[2], r.status_code)
            for r in follow_up_records(conn, "shard-1", [refunded])
        }
        assert ("CreditTransfer", 5) in refused  # the NOT_FOUND that dead-lettered it
    with two_shards.db(src) as conn:
        records = follow_up_records(conn, "shard-0", [delivered, refunded])
        assert [(r.key, r.method.rpartition("/")[2], r.status_code) for r in records] == [
            (str(refund_key(refunded)), "RefundTransfer", 0)
        ]
    report = classify(read_all(two_shards.dsns))
    assert report.consistent and report.transfers == 2, report.as_json()


def test_a_requeued_credit_goes_through_the_ledgers_writes_and_replays(two_shards: TwoShards):  # noqa: F811  (the imported fixture)
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    dst = accounts_on(two_shards.shard_map, "shard-1", 1)[0]
    _open(two_shards, src, 1000)
    _open(two_shards, dst, 1)
    tid = uuid.UUID(_transfer(two_shards, src, dst, 300).transfer_id)
    relay = two_shards.relay("shard-0")
    assert relay.run_once().delivered == 1
    with two_shards.db(src) as conn:
        assert repair.requeue(conn, tid) is True
        assert repair.requeue(conn, tid) is False  # no longer marked delivered
        [row] = store.list_outbox(conn, [tid])
        assert (row.state, row.attempts) == ("pending", 0) and "re-queued" in (row.last_error or "")
        assert store.read_transfer(conn, tid).state == "pending"
    assert relay.run_once().delivered == 1  # the destination replays the credit's key
    with two_shards.db(dst) as conn:
        assert [e.kind for e in reads.transfer_entries(conn, [tid])] == ["transfer_in"]
        assert store.read_account(conn, dst).balance == 301
    with two_shards.db(src) as conn:
        assert store.read_transfer(conn, tid).state == "completed"
    assert classify(read_all(two_shards.dsns)).consistent
