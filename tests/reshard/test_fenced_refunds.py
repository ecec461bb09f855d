"""Refunds and voids respect fences: on a fenced slot, `VoidCredit` and `RefundTransfer` are refused
SLOT_RANGE_MOVING before they lock a row (a lock there would hold up a move's apply worker, which
writes the replicated rows of an incoming range), and the relay sends no refund of a dead letter in
a fenced slot (one replicated into a range moving in waits for the hand-over, as its outbox rows do).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import load_shard_map
from shardrouter.internal.v1 import ledger_pb2, ledger_pb2_grpc
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd import fences
from shardrouter.shardd.fences import SlotFence
from shardrouter.shardd.ledger.service import refund_key
from shardrouter.shardd.relay import OutboxRelay
from shardrouter.shardd.server import ShardDaemon
from shardrouter.v1 import transfer_pb2
from tests.helpers import error_info, key_metadata, money
from tests.reshard.cluster import Pair, accounts, new_pair, seed, send, start_daemons


@pytest.fixture
def served(postgres: LocalPostgres, tmp_path: Path) -> Iterator[tuple[Pair, dict[str, ShardDaemon]]]:
    cluster = new_pair(postgres, tmp_path)
    daemons = start_daemons(cluster)
    yield cluster, daemons
    cluster.close()
    for daemon in daemons.values():
        daemon.stop(0.2)


def _fence_slot_of(pair: Pair, account: str) -> None:
    """Fence the account's slot on shard-0, its owner by the map (as a move's cut-over does)."""
    shard_map = load_shard_map(pair.map_path)
    slot = shard_map.slot_of(account)
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        fences.raise_fence(conn, SlotFence("m-test", shard_map.slots, slot, slot))


def _wait_delivered(pair: Pair, shard_id: str, timeout_s: float = 30.0) -> None:
    """Until the shard's relay has marked every credit delivered (a bounded wait for a state)."""
    deadline = time.monotonic() + timeout_s
    while pair.count(shard_id, "SELECT count(*) FROM outbox WHERE delivered_at IS NULL"):
        assert time.monotonic() < deadline, f"credits of {shard_id} still undelivered after {timeout_s} s"
        time.sleep(0.05)


def _refused_moving(call: object, started: float) -> None:
    assert isinstance(call, grpc.RpcError), call
    assert call.code() is grpc.StatusCode.UNAVAILABLE, (call.code(), call.details())
    assert error_info(call)[0].reason == "SLOT_RANGE_MOVING"
    assert time.monotonic() - started < 2.0  # at once, not after a lock wait


def test_void_and_refund_on_a_fenced_slot_are_refused_before_any_row_lock(
    served: tuple[Pair, dict[str, ShardDaemon]],
) -> None:
    pair, _ = served
    (mover, *_), _ = accounts(pair, 1)
    staying = next(a for a in accounts(pair, 8)[1] if pair.owner(a) == "shard-1")
    seed(pair, [mover, staying])
    # A cross-shard transfer whose credit is delivered before the fence goes up.
    answer = send(
        pair,
        "Transfer",
        transfer_pb2.TransferRequest(
            source_account_id=mover, destination_account_id=staying, amount=money(3)
        ),
        new_key(),
        mover,
    )
    transfer_id = answer.transfer.transfer_id  # type: ignore[attr-defined]
    _wait_delivered(pair, "shard-0")  # else the relay, marking it delivered, waits on the rows held below
    _fence_slot_of(pair, mover)
    pair.stub("shard-0")
    stub = ledger_pb2_grpc.ShardLedgerServiceStub(pair.channels["shard-0"])
    # Another transaction holds the rows (as an apply worker writing them would).
    with psycopg.connect(pair.dsns["shard-0"]) as holder:
        holder.execute("SELECT 1 FROM accounts WHERE id = %s FOR UPDATE", (mover,))
        holder.execute("SELECT 1 FROM transfers WHERE id = %s FOR UPDATE", (transfer_id,))
        calls = {
            "VoidCredit": lambda: stub.VoidCredit(
                ledger_pb2.VoidCreditRequest(transfer_id=str(uuid.uuid4()), destination_account_id=mover),
                metadata=key_metadata(caller="relay:shard-1"),
                timeout=3,
            ),
            "RefundTransfer": lambda: stub.RefundTransfer(
                ledger_pb2.RefundTransferRequest(transfer_id=transfer_id, source_account_id=mover),
                metadata=key_metadata(refund_key(uuid.UUID(transfer_id)), caller="relay:shard-0"),
                timeout=3,
            ),
        }
        for name, call in calls.items():
            started = time.monotonic()
            try:
                result: object = call()
            except grpc.RpcError as err:
                result = err
            _refused_moving(result, started)
            waiting = pair.count(
                "shard-0",
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype IN ('tuple', 'transactionid')",
            )
            assert waiting == 0, f"{name} left a lock waiter"
        holder.rollback()


def test_the_relay_sends_no_refund_of_a_dead_letter_in_a_fenced_slot(
    served: tuple[Pair, dict[str, ShardDaemon]], caplog: pytest.LogCaptureFixture
) -> None:
    pair, daemons = served
    (mover, *_), _ = accounts(pair, 1)
    seed(pair, [mover])
    _fence_slot_of(pair, mover)
    transfer_id = new_key()
    # Rows of a transfer given up on, replicated into the fenced range (apply workers skip triggers).
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn, conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            "INSERT INTO transfers (id, source_account_id, destination_account_id, destination_shard_id,"
            " amount_minor, currency, state, account_hash)"
            " VALUES (%s, %s, 'elsewhere', 'shard-1', 5, 'EUR', 'pending', account_hash(%s))",
            (transfer_id, mover, mover),
        )
        outbox_id = conn.execute(
            "INSERT INTO outbox (transfer_id, destination_shard_id, idempotency_key, payload, dead_lettered_at,"
            " account_hash) VALUES (%s, 'shard-1', %s, '\\x00', now(), account_hash(%s)) RETURNING id",
            (transfer_id, uuid.uuid4(), mover),
        ).fetchone()[0]  # type: ignore[index]
        conn.execute(
            "INSERT INTO dead_letters (transfer_id, outbox_id, reason, refund_key, account_hash)"
            " VALUES (%s, %s, 'test', %s, account_hash(%s))",
            (transfer_id, outbox_id, str(refund_key(transfer_id)), mover),
        )
    relay = next(b for b in daemons["shard-0"].background if isinstance(b, OutboxRelay))
    with caplog.at_level(logging.WARNING):
        assert relay.refund_owed() == 0
        time.sleep(0.5)  # the relay's own passes too
    assert [r.getMessage() for r in caplog.records if str(transfer_id) in r.getMessage()] == []
    assert pair.sql(
        "shard-0", "SELECT refunded_at FROM dead_letters WHERE transfer_id = %s", (transfer_id,)
    ) == [(None,)]
