"""The outbox relay's daemon SIGKILLed at a named failpoint (`core/failpoints.py`) of a cross-shard
transfer's delivery or refund, then started again: the credit lands once, or the debit is refunded
once, whatever the kill interrupted.

Two shards of one daemon each (real processes, each over its own database). The transfer is made
first with the source's relay off; then the source daemon is started again with its relay on and the
failpoint armed, so the only calls that reach an armed point are the relay's own:

- `shardd.relay_delivered_before_marked`: the destination applied the credit and answered OK, the
  outbox row is not marked. After the restart the credit is delivered again, and the destination's
  key makes that harmless: the balance is credited once.
- for a credit the destination refuses for good (its account does not exist): dead letter, then
  `RefundTransfer` on the source, killed at `shardd.relay_dead_lettered_before_refund` (dead letter
  committed, refund not sent), `shardd.refund_applied_before_marked` (the refund's writes made in
  its open transaction, the dead letter not marked) or `shardd.committed_before_answer` (refund
  committed, the relay never heard). After the restart the debit is refunded exactly once, and the
  refund sent once more, as the relay or an operator's replay would, applies nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardrouter.core.keys import new_key
from shardrouter.internal.v1 import ledger_pb2
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.idempotency.steps import COMMITTED_BEFORE_ANSWER
from shardrouter.shardd.ledger.service import REFUND_APPLIED_BEFORE_MARKED, credit_key, refund_key
from shardrouter.shardd.relay import DEAD_LETTERED_BEFORE_REFUND, DELIVERED_BEFORE_MARKED
from shardrouter.v1 import transfer_pb2
from tests.faults.daemons import (
    TRANSFER,
    TwoShards,
    balances,
    call,
    entries,
    query,
    transfer_request,
    wait_for,
)

DELIVERED = DELIVERED_BEFORE_MARKED
REFUND = "/shardrouter.internal.v1.ShardLedgerService/RefundTransfer"


@pytest.fixture
def shards(postgres: LocalPostgres, tmp_path: Path) -> Iterator[TwoShards]:
    """Two shards; the source's relay off until the test starts it again armed."""
    two = TwoShards.build(postgres, tmp_path)
    two.daemons["shard-0"].env["SHARDD_RELAY_WORKERS"] = "0"
    for daemon in two.daemons.values():
        daemon.start()
    yield two
    two.stop()


def _pending_transfer(shards: TwoShards, src: str, dst: str) -> uuid.UUID:
    """A transfer of 300 from `src` (holding 1000) to `dst`, committed and not yet relayed."""
    shards.deposit(src, 1000)
    answer = call(shards.address_of(src), TRANSFER, transfer_request(src, dst, 300), str(new_key()))
    assert answer.code is grpc.StatusCode.OK, answer
    assert answer.response is not None
    transfer = transfer_pb2.TransferResponse.FromString(answer.response).transfer
    assert transfer.state == transfer_pb2.TRANSFER_STATE_PENDING
    return uuid.UUID(transfer.transfer_id)


def _restart_source(shards: TwoShards, *points: str) -> None:
    """The source daemon, stopped gracefully and started again with its relay on and `points` armed."""
    source = shards.daemons["shard-0"]
    source.terminate()
    source.env["SHARDD_RELAY_WORKERS"] = "1"
    source.arm(*points)
    source.start()


def _state(shards: TwoShards, transfer_id: uuid.UUID) -> str:
    return str(query(shards.dsns["shard-0"], "SELECT state FROM transfers WHERE id = %s", transfer_id)[0][0])


def _outbox(shards: TwoShards, transfer_id: uuid.UUID) -> tuple[bool, bool]:
    """(delivered, dead-lettered) of the transfer's outbox row."""
    ((delivered, dead),) = query(
        shards.dsns["shard-0"],
        "SELECT delivered_at IS NOT NULL, dead_lettered_at IS NOT NULL FROM outbox WHERE transfer_id = %s",
        transfer_id,
    )
    return bool(delivered), bool(dead)


def _refunded(shards: TwoShards, transfer_id: uuid.UUID) -> bool | None:
    """Whether the transfer's dead letter is marked refunded (None: no dead letter)."""
    rows = query(
        shards.dsns["shard-0"],
        "SELECT refunded_at IS NOT NULL FROM dead_letters WHERE transfer_id = %s",
        transfer_id,
    )
    return bool(rows[0][0]) if rows else None


def test_a_relay_killed_after_delivery_before_marking_it_delivers_again_and_the_credit_lands_once(
    shards: TwoShards,
) -> None:
    """Failpoint `shardd.relay_delivered_before_marked`."""
    src, dst = shards.account_on("shard-0"), shards.account_on("shard-1")
    shards.deposit(dst, 1)
    transfer_id = _pending_transfer(shards, src, dst)
    credit = str(credit_key(transfer_id))
    dst_dsn = shards.dsn_of(dst)

    _restart_source(shards, DELIVERED)
    shards.daemons["shard-0"].kill_at_failpoint(DELIVERED)

    # The destination applied the credit and answered; the source never recorded that.
    assert entries(dst_dsn, credit) == [("transfer_in", dst, 300)]
    assert balances(dst_dsn, dst) == [301]
    assert _outbox(shards, transfer_id) == (False, False)
    assert _state(shards, transfer_id) == "pending"

    _restart_source(shards)  # unarmed: the relay delivers the credit again
    wait_for("the transfer completed", lambda: _state(shards, transfer_id) == "completed", logs=shards.logs)
    assert _outbox(shards, transfer_id) == (True, False)
    # The redelivery was answered from the credit key's record: credited once.
    assert entries(dst_dsn, credit) == [("transfer_in", dst, 300)]
    assert balances(dst_dsn, dst) == [301]
    assert query(dst_dsn, "SELECT count(*) FROM idempotency_record WHERE key = %s", credit) == [(1,)]
    assert balances(shards.dsns["shard-0"], src) == [700]


@pytest.mark.parametrize(
    ("point", "refunded_at_the_kill"),
    [
        (DEAD_LETTERED_BEFORE_REFUND, False),
        (REFUND_APPLIED_BEFORE_MARKED, False),
        (COMMITTED_BEFORE_ANSWER, True),
    ],
)
def test_a_daemon_killed_inside_a_refund_refunds_exactly_once(
    shards: TwoShards, point: str, refunded_at_the_kill: bool
) -> None:
    """Failpoints `shardd.relay_dead_lettered_before_refund`, `shardd.refund_applied_before_marked`
    and `shardd.committed_before_answer` (of the relay's `RefundTransfer` on its own shard)."""
    src, nowhere = shards.account_on("shard-0"), shards.account_on("shard-1")  # never opened
    transfer_id = _pending_transfer(shards, src, nowhere)
    src_dsn, refund = shards.dsns["shard-0"], str(refund_key(transfer_id))

    _restart_source(shards, point)
    shards.daemons["shard-0"].kill_at_failpoint(point)

    # The dead letter is committed; the refund, and its mark, both or neither.
    assert _outbox(shards, transfer_id) == (False, True)
    assert _refunded(shards, transfer_id) is refunded_at_the_kill
    if refunded_at_the_kill:
        assert entries(src_dsn, refund) == [("refund", src, 300)]
        assert balances(src_dsn, src) == [1000] and _state(shards, transfer_id) == "refunded"
    else:
        assert entries(src_dsn, refund) == []
        assert balances(src_dsn, src) == [700] and _state(shards, transfer_id) == "pending"

    _restart_source(shards)  # unarmed: the relay refunds what is still owed
    wait_for("the dead letter refunded", lambda: _refunded(shards, transfer_id) is True, logs=shards.logs)
    assert _state(shards, transfer_id) == "refunded"
    assert entries(src_dsn, refund) == [("refund", src, 300)]
    assert balances(src_dsn, src) == [1000]

    # Sent once more, as the relay sends it (its request, key and caller): the stored outcome is
    # replayed and nothing is applied.
    ((reason,),) = query(src_dsn, "SELECT reason FROM dead_letters WHERE transfer_id = %s", transfer_id)
    request = ledger_pb2.RefundTransferRequest(
        transfer_id=str(transfer_id), reason=reason, source_account_id=src
    )
    again = call(
        shards.daemons["shard-0"].address,
        REFUND,
        request.SerializeToString(deterministic=True),
        refund,
        caller="relay:shard-0",
    )
    assert again.code is grpc.StatusCode.OK and again.replayed, again
    assert entries(src_dsn, refund) == [("refund", src, 300)]
    assert balances(src_dsn, src) == [1000]
