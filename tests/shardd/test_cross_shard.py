"""Transfers between shards: outbox, relay, idempotent credit, dead letters and refunds.

Two real shard daemons (in this process, real gRPC on loopback), each with its own database.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml

from shardrouter.core.shardmap import ShardMap, even_shard_map, shard_map_document
from shardrouter.internal.v1 import ledger_pb2, ledger_pb2_grpc
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd.ledger.service import credit_key
from shardrouter.shardd.relay import OutboxRelay
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.shardd.transfer_waits import TransferWaits
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import error_info, key_metadata, make_settings, money


@dataclass
class TwoShards:
    shard_map: ShardMap
    map_path: Path
    daemons: dict[str, ShardDaemon]
    dsns: dict[str, str]
    ports: dict[str, int]

    def stub(self, account: str) -> transfer_pb2_grpc.TransferServiceStub:
        shard = self.shard_map.shard_for(account)
        return transfer_pb2_grpc.TransferServiceStub(grpc.insecure_channel(shard.address))

    def db(self, account: str) -> psycopg.Connection:
        return psycopg.connect(self.dsns[self.shard_map.shard_for(account).id], autocommit=True)

    def relay(self, shard_id: str) -> OutboxRelay:
        daemon = self.daemons[shard_id]
        return OutboxRelay(daemon.settings, daemon.database, lambda: self.shard_map)

    def start(self, shard_id: str, **overrides: object) -> None:
        self.daemons[shard_id] = start_shard(
            make_settings(
                self.dsns[shard_id],
                shard_id=shard_id,
                listen=f"127.0.0.1:{self.ports[shard_id]}",
                shard_map=str(self.map_path),
                **overrides,
            )
        )


def accounts_on(shard_map: ShardMap, shard_id: str, n: int) -> list[str]:
    found = []
    i = 0
    while len(found) < n:
        name = f"acct-{i}"
        if shard_map.shard_for(name).id == shard_id:
            found.append(name)
        i += 1
    return found


@pytest.fixture
def two_shards(postgres: LocalPostgres, tmp_path: Path) -> Iterator[TwoShards]:
    ports = {"shard-0": free_port(), "shard-1": free_port()}
    shard_map = even_shard_map({sid: f"127.0.0.1:{p}" for sid, p in ports.items()})
    map_path = tmp_path / "shard-map.yaml"
    map_path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    dsns = {}
    for sid in ports:
        name = f"x{uuid.uuid4().hex[:10]}"
        postgres.create_database(name)
        dsns[sid] = postgres.dsn_for(name)
    cluster = TwoShards(shard_map, map_path, {}, dsns, ports)
    for sid in ports:
        cluster.start(sid)
    yield cluster
    for daemon in cluster.daemons.values():
        daemon.stop(0.2)


def _open(cluster: TwoShards, account: str, amount: int, currency: str = "EUR") -> None:
    cluster.stub(account).Deposit(
        transfer_pb2.DepositRequest(account_id=account, amount=money(amount, currency)),
        metadata=key_metadata(),
    )


def _opened_pair(cluster: TwoShards, source_balance: int = 1000) -> tuple[str, str]:
    """An account on shard-0 holding `source_balance` and one on shard-1 holding 1."""
    src = accounts_on(cluster.shard_map, "shard-0", 1)[0]
    dst = accounts_on(cluster.shard_map, "shard-1", 1)[0]
    _open(cluster, src, source_balance)
    _open(cluster, dst, 1)
    return src, dst


def _transfer(cluster: TwoShards, src: str, dst: str, amount: int, md=None) -> transfer_pb2.Transfer:
    return (
        cluster.stub(src)
        .Transfer(
            transfer_pb2.TransferRequest(
                source_account_id=src, destination_account_id=dst, amount=money(amount)
            ),
            metadata=md or key_metadata(),
        )
        .transfer
    )


def _balance(cluster: TwoShards, account: str) -> int:
    with cluster.db(account) as conn:
        return conn.execute("SELECT balance FROM accounts WHERE id = %s", (account,)).fetchone()[0]


def test_cross_shard_transfer_debits_then_the_relay_credits_once(two_shards):
    src, dst = _opened_pair(two_shards)
    md = key_metadata()
    transfer = _transfer(two_shards, src, dst, 300, md)
    assert transfer.state == transfer_pb2.TRANSFER_STATE_PENDING
    assert _balance(two_shards, src) == 700 and _balance(two_shards, dst) == 1
    relay = two_shards.relay("shard-0")
    assert relay.run_once().delivered == 1
    assert relay.run_once().delivered == 0  # nothing left: delivered rows are not sent again
    assert _balance(two_shards, dst) == 301
    got = (
        two_shards.stub(src)
        .GetTransfer(transfer_pb2.GetTransferRequest(source_account_id=src, transfer_id=transfer.transfer_id))
        .transfer
    )
    assert got.state == transfer_pb2.TRANSFER_STATE_COMPLETED
    assert [a.status_code for a in got.delivery_attempts] == ["OK"]
    # The caller's retry replays the original answer (PENDING at the time), byte for byte.
    again = _transfer(two_shards, src, dst, 300, md)
    assert again == transfer


def test_redelivering_one_credit_many_times_gives_one_ledger_entry(two_shards):
    src, dst = _opened_pair(two_shards)
    transfer = _transfer(two_shards, src, dst, 250)
    with two_shards.db(src) as conn:
        payload, key = conn.execute(
            "SELECT payload, idempotency_key FROM outbox WHERE transfer_id = %s",
            (uuid.UUID(transfer.transfer_id),),
        ).fetchone()
    channel = grpc.insecure_channel(two_shards.shard_map.shard_for(dst).address)
    credit = channel.unary_unary("/shardrouter.internal.v1.ShardLedgerService/CreditTransfer")
    answers = []

    def redeliver():
        for _ in range(5):
            try:
                answers.append(credit(bytes(payload), metadata=[("idempotency-key", str(key))], timeout=10))
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.ABORTED

    threads = [threading.Thread(target=redeliver) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers and len(set(answers)) == 1  # every OK answer is the same stored response
    with two_shards.db(dst) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM ledger_entries WHERE transfer_id = %s AND kind = 'transfer_in'",
            (uuid.UUID(transfer.transfer_id),),
        ).fetchone()[0]
    assert rows == 1
    assert _balance(two_shards, dst) == 251
    channel.close()


def test_unknown_destination_is_dead_lettered_and_refunded_once(two_shards):
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    ghost = accounts_on(two_shards.shard_map, "shard-1", 3)[2]  # never opened
    _open(two_shards, src, 1000)
    transfer = _transfer(two_shards, src, ghost, 400)
    assert _balance(two_shards, src) == 600
    stats = two_shards.relay("shard-0").run_once()
    assert stats.dead_lettered == 1 and stats.refunded == 1
    assert _balance(two_shards, src) == 1000
    got = (
        two_shards.stub(src)
        .GetTransfer(transfer_pb2.GetTransferRequest(source_account_id=src, transfer_id=transfer.transfer_id))
        .transfer
    )
    assert got.state == transfer_pb2.TRANSFER_STATE_REFUNDED
    assert got.delivery_attempts[0].status_code == "NOT_FOUND"
    with two_shards.db(src) as conn:
        letters = conn.execute("SELECT reason, refunded_at FROM dead_letters").fetchall()
    assert len(letters) == 1 and letters[0][1] is not None and "NOT_FOUND" in letters[0][0]


def test_dead_letter_replay_twice_gives_one_refund(two_shards):
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    ghost = accounts_on(two_shards.shard_map, "shard-1", 3)[2]
    _open(two_shards, src, 1000)
    transfer = _transfer(two_shards, src, ghost, 100)
    relay = two_shards.relay("shard-0")
    relay.run_once()
    transfer_id = uuid.UUID(transfer.transfer_id)
    assert relay.refund_owed(transfer_id) == 1  # replay 1: the refund's key replays
    assert relay.refund_owed(transfer_id) == 1  # replay 2
    with two_shards.db(src) as conn:
        refunds = conn.execute(
            "SELECT count(*) FROM ledger_entries WHERE transfer_id = %s AND kind = 'refund'", (transfer_id,)
        ).fetchone()[0]
    assert refunds == 1
    assert _balance(two_shards, src) == 1000


def test_currency_mismatch_at_destination_is_permanent(two_shards):
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    dst = accounts_on(two_shards.shard_map, "shard-1", 1)[0]
    _open(two_shards, src, 1000)
    _open(two_shards, dst, 5, "USD")
    _transfer(two_shards, src, dst, 100)
    stats = two_shards.relay("shard-0").run_once()
    assert stats.dead_lettered == 1
    assert _balance(two_shards, src) == 1000 and _balance(two_shards, dst) == 5


def test_a_voided_credit_can_never_land_and_is_refunded(two_shards):
    src, dst = _opened_pair(two_shards)
    transfer = _transfer(two_shards, src, dst, 100)
    stub = ledger_pb2_grpc.ShardLedgerServiceStub(
        grpc.insecure_channel(two_shards.shard_map.shard_for(dst).address)
    )
    key = credit_key(uuid.UUID(transfer.transfer_id))
    caller = [("x-caller-id", "relay:shard-0")]
    stub.VoidCredit(
        ledger_pb2.VoidCreditRequest(transfer_id=transfer.transfer_id),
        metadata=[("idempotency-key", str(key)), *caller],
    )
    stats = two_shards.relay("shard-0").run_once()
    assert stats.dead_lettered == 1
    assert _balance(two_shards, dst) == 1  # the fence held
    assert _balance(two_shards, src) == 1000


def test_destination_down_then_back_delivers_with_backoff(two_shards):
    src, dst = _opened_pair(two_shards)
    two_shards.daemons["shard-1"].stop(0.2)
    transfer = _transfer(two_shards, src, dst, 10)
    relay = two_shards.relay("shard-0")
    assert relay.run_once().postponed == 1
    with two_shards.db(src) as conn:
        conn.execute("UPDATE outbox SET next_attempt_at = now()")  # skip the backoff wait
    two_shards.start("shard-1")
    delivered = 0
    deadline = time.monotonic() + 10
    while not delivered and time.monotonic() < deadline:
        with two_shards.db(src) as conn:
            conn.execute("UPDATE outbox SET next_attempt_at = now()")
        delivered = relay.run_once().delivered
        time.sleep(0.1)
    assert delivered == 1
    got = (
        two_shards.stub(src)
        .GetTransfer(transfer_pb2.GetTransferRequest(source_account_id=src, transfer_id=transfer.transfer_id))
        .transfer
    )
    codes = [a.status_code for a in got.delivery_attempts]
    assert codes[0] == "UNAVAILABLE" and codes[-1] == "OK" and codes.count("OK") == 1
    assert _balance(two_shards, dst) == 11


def test_background_relay_completes_and_get_transfer_waits(two_shards):
    two_shards.daemons["shard-0"].stop(0.2)
    two_shards.start("shard-0", relay_workers=2)
    src, dst = _opened_pair(two_shards)
    transfer = _transfer(two_shards, src, dst, 10)
    got = (
        two_shards.stub(src)
        .GetTransfer(
            transfer_pb2.GetTransferRequest(
                source_account_id=src, transfer_id=transfer.transfer_id, wait_for_completion_ms=10_000
            ),
            timeout=15,
        )
        .transfer
    )
    assert got.state == transfer_pb2.TRANSFER_STATE_COMPLETED
    assert _balance(two_shards, dst) == 11


def test_a_commit_that_queues_a_credit_wakes_the_relay(two_shards, monkeypatch):
    """The relay hears the credit's commit (LISTEN/NOTIFY) instead of waiting for its next poll."""
    from shardrouter.shardd import relay as relay_module

    monkeypatch.setattr(relay_module, "_IDLE_S", 60.0)  # a poll would come far too late to pass
    src, dst = _opened_pair(two_shards)
    daemon = two_shards.daemons["shard-0"]
    waits = TransferWaits()
    relay = OutboxRelay(
        dataclasses.replace(daemon.settings, relay_workers=1),
        daemon.database,
        lambda: two_shards.shard_map,
        waits=waits,
    )
    relay.start()
    try:
        # The relay's own listener tells its waits once every channel's LISTEN was issued.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not waits.listening:
            time.sleep(0.01)  # waiting for the listener's connection, not for the relay
        assert waits.listening, "the relay's listener never started listening"
        _transfer(two_shards, src, dst, 250)
        started = time.monotonic()
        while _balance(two_shards, dst) != 251 and time.monotonic() - started < 10:
            time.sleep(0.01)
        assert _balance(two_shards, dst) == 251, "the credit waited for a poll"
    finally:
        relay.stop()


def test_a_void_under_another_relays_scope_finds_the_credit_already_applied(two_shards):
    """After a move of the source's slot, the new owner's relay sends under its own caller scope, so
    the old relay's record of a delivered credit is not its own: its void must find the credit itself
    (refused, not stored), and its delivery must answer with the credit's entry, never a second one."""
    src, dst = _opened_pair(two_shards)
    transfer = _transfer(two_shards, src, dst, 70)
    with two_shards.db(src) as conn:
        payload = conn.execute("SELECT payload FROM outbox").fetchone()[0]
    stub = ledger_pb2_grpc.ShardLedgerServiceStub(
        grpc.insecure_channel(two_shards.shard_map.shard_for(dst).address)
    )
    key = [("idempotency-key", str(credit_key(uuid.UUID(transfer.transfer_id))))]
    credit = ledger_pb2.CreditTransferRequest.FromString(payload)
    first = stub.CreditTransfer(credit, metadata=[*key, ("x-caller-id", "relay:shard-0")])
    assert _balance(two_shards, dst) == 71

    void = ledger_pb2.VoidCreditRequest(transfer_id=transfer.transfer_id, destination_account_id=dst)
    other = [*key, ("x-caller-id", "relay:shard-9")]
    for _ in range(2):  # refused every time: the refusal is not stored as the key's outcome
        with pytest.raises(grpc.RpcError) as refused:
            stub.VoidCredit(void, metadata=other)
        info, retryable = error_info(refused.value)
        assert refused.value.code() is grpc.StatusCode.ABORTED
        assert (info.reason, retryable) == ("CREDIT_ALREADY_APPLIED", True)
    with two_shards.db(dst) as conn:
        stored = conn.execute(
            "SELECT count(*) FROM idempotency_record WHERE scope LIKE %s", ("%relay:shard-9",)
        ).fetchone()[0]
    assert stored == 0

    again = stub.CreditTransfer(credit, metadata=other)  # the new relay's delivery: the same entry
    assert again.entry_id == first.entry_id
    assert _balance(two_shards, dst) == 71

    # The relay itself, its row now older than its limit: it delivers (a replay), never refunds.
    with two_shards.db(src) as conn:
        conn.execute("UPDATE outbox SET created_at = now() - interval '1 day'")
    stats = two_shards.relay("shard-0").run_once()
    assert (stats.delivered, stats.dead_lettered) == (1, 0)
    assert (_balance(two_shards, src), _balance(two_shards, dst)) == (930, 71)


def test_a_credit_voided_under_another_relays_scope_never_lands(two_shards):
    """The other order: the new owner's relay voided the credit under its own scope; a credit the old
    relay was still sending then arrives under the old scope, and is refused for good."""
    src, dst = _opened_pair(two_shards)
    transfer = _transfer(two_shards, src, dst, 40)
    with two_shards.db(src) as conn:
        credit = ledger_pb2.CreditTransferRequest.FromString(conn.execute("SELECT payload FROM outbox").fetchone()[0])
    stub = ledger_pb2_grpc.ShardLedgerServiceStub(
        grpc.insecure_channel(two_shards.shard_map.shard_for(dst).address)
    )
    key = [("idempotency-key", str(credit_key(uuid.UUID(transfer.transfer_id))))]
    void = ledger_pb2.VoidCreditRequest(transfer_id=transfer.transfer_id, destination_account_id=dst)
    stub.VoidCredit(void, metadata=[*key, ("x-caller-id", "relay:shard-9")])
    with pytest.raises(grpc.RpcError) as refused:
        stub.CreditTransfer(credit, metadata=[*key, ("x-caller-id", "relay:shard-0")])
    info, _ = error_info(refused.value)
    assert (refused.value.code(), info.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CREDIT_VOIDED")
    assert _balance(two_shards, dst) == 1
    with two_shards.db(dst) as conn:
        assert conn.execute("SELECT account_id FROM voided_credits").fetchall() == [(dst,)]


def test_a_credit_and_its_void_from_two_relays_at_once_never_both_take_effect(two_shards):
    """Under concurrency, per transfer: the credit applies or the void holds, never both, never
    neither (each side is retried while the other answers ABORTED, as the relay does)."""
    src, dst = _opened_pair(two_shards, 100_000)
    transfers = [_transfer(two_shards, src, dst, 10 + i) for i in range(24)]
    with two_shards.db(src) as conn:
        payloads = {
            str(tid): payload for tid, payload in conn.execute("SELECT transfer_id, payload FROM outbox").fetchall()
        }
    channel = grpc.insecure_channel(two_shards.shard_map.shard_for(dst).address)
    stub = ledger_pb2_grpc.ShardLedgerServiceStub(channel)
    outcomes: dict[tuple[str, str], grpc.StatusCode] = {}

    def send(transfer_id: str, what: str, start: threading.Barrier) -> None:
        key = ("idempotency-key", str(credit_key(uuid.UUID(transfer_id))))
        start.wait()
        for _ in range(50):
            try:
                if what == "credit":
                    request = ledger_pb2.CreditTransferRequest.FromString(payloads[transfer_id])
                    stub.CreditTransfer(request, metadata=[key, ("x-caller-id", "relay:shard-0")])
                else:
                    void = ledger_pb2.VoidCreditRequest(transfer_id=transfer_id, destination_account_id=dst)
                    stub.VoidCredit(void, metadata=[key, ("x-caller-id", "relay:shard-9")])
                outcomes[(transfer_id, what)] = grpc.StatusCode.OK
                return
            except grpc.RpcError as error:
                outcomes[(transfer_id, what)] = error.code()
                if error.code() is not grpc.StatusCode.ABORTED:
                    return

    for transfer in transfers:
        start = threading.Barrier(2)
        threads = [
            threading.Thread(target=send, args=(transfer.transfer_id, what, start)) for what in ("credit", "void")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    credited = 0
    for transfer in transfers:
        credit = outcomes[(transfer.transfer_id, "credit")]
        void = outcomes[(transfer.transfer_id, "void")]
        assert {credit, void} == {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION} or (
            credit is grpc.StatusCode.OK and void is grpc.StatusCode.ABORTED
        ), (transfer.transfer_id, credit, void)
        if credit is grpc.StatusCode.OK:
            credited += transfer.amount.amount_minor
    assert _balance(two_shards, dst) == 1 + credited
    with two_shards.db(dst) as conn:
        voided = {str(t) for (t,) in conn.execute("SELECT transfer_id FROM voided_credits").fetchall()}
    assert voided == {t.transfer_id for t in transfers if outcomes[(t.transfer_id, "void")] is grpc.StatusCode.OK}
    channel.close()
