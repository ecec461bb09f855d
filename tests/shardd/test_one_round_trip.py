"""A new key's Deposit is one round trip to PostgreSQL, counted on the wire, and what it stores is
what it answers.

The claim sent ahead, the Deposit, the record and the COMMIT go in one pipeline: the Deposit's
statement builds its serialised answer in the database (`shardd.answer_sql`), so nothing waits for a
result before the Sync. A deposit that writes nothing (another currency, the limit) noted no answer:
it is run again the usual way and its refusal stored. A real daemon in this process, its pool
connected through the counting proxy of the bench (`bench/wire.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.wire import WireProxy
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money

CALLS = 30


@pytest.fixture
def counted_stub(database: str) -> Iterator[tuple[transfer_pb2_grpc.TransferServiceStub, WireProxy]]:
    """A stub of a daemon whose database connections go through a counting proxy; claims ahead,
    replays from the database (no replay cache)."""
    target = conninfo_to_dict(database)
    proxy = WireProxy(str(target.get("host") or "127.0.0.1"), int(str(target["port"]))).start()
    dsn = make_conninfo(database, host="127.0.0.1", port=proxy.port, sslmode="disable")
    daemon = start_shard(make_settings(dsn, claim_placement="ahead", replay_cache_entries=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            yield transfer_pb2_grpc.TransferServiceStub(channel), proxy
    finally:
        daemon.stop(0.5)
        proxy.close()


def _round_trips(proxy: WireProxy) -> int:
    return proxy.counter.snapshot()["round_trips"]


def _deposit(account: str, amount: int, currency: str = "EUR") -> transfer_pb2.DepositRequest:
    return transfer_pb2.DepositRequest(account_id=account, amount=money(amount, currency), reference="rt")


def test_a_new_keys_deposit_is_one_round_trip_and_stores_what_it_answers(
    counted_stub: tuple[transfer_pb2_grpc.TransferServiceStub, WireProxy],
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    stub, proxy = counted_stub
    stub.Deposit(_deposit("rt-warm", 1), metadata=key_metadata())  # the pool's statements prepared
    idle_from, idle_started = _round_trips(proxy), time.monotonic()
    time.sleep(0.5)
    idle_per_s = (_round_trips(proxy) - idle_from) / (time.monotonic() - idle_started)
    calls = [(key_metadata(), _deposit(f"rt-{n % 3}", 10 + n)) for n in range(CALLS)]
    before, started = _round_trips(proxy), time.monotonic()
    answers = [stub.Deposit(request, metadata=md) for md, request in calls]
    spent = _round_trips(proxy) - before - idle_per_s * (time.monotonic() - started)
    assert spent / CALLS <= 1.1, (spent, idle_per_s)
    # Each answer carries the balance right after it, and is the record's bytes, replayed verbatim.
    balances: dict[str, int] = {}
    for (md, request), answer in zip(calls, answers, strict=True):
        account = request.account_id
        balances[account] = balances.get(account, 0) + request.amount.amount_minor
        assert answer.balance == money(balances[account]) and answer.entry_id, answer
        (stored,) = db.execute(
            "SELECT response FROM idempotency_record WHERE key = %s", (md[0][1],)
        ).fetchone() or (None,)
        assert stored is not None and bytes(stored) == answer.SerializeToString()  # type: ignore[arg-type]
        assert stub.Deposit(request, metadata=md) == answer
    assert db.execute("SELECT count(*) FROM ledger_entries WHERE reference = 'rt'").fetchone() == (CALLS + 1,)


def test_a_deposit_that_writes_nothing_is_refused_and_the_refusal_replayed(
    counted_stub: tuple[transfer_pb2_grpc.TransferServiceStub, WireProxy],
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    stub, _ = counted_stub
    stub.Deposit(_deposit("rt-eur", 5), metadata=key_metadata())
    md = key_metadata()
    with pytest.raises(grpc.RpcError) as first:
        stub.Deposit(_deposit("rt-eur", 5, "USD"), metadata=md)
    with pytest.raises(grpc.RpcError) as again:
        stub.Deposit(_deposit("rt-eur", 5, "USD"), metadata=md)
    assert first.value.code() is grpc.StatusCode.FAILED_PRECONDITION, first.value.details()
    assert "USD" in (first.value.details() or "") or "EUR" in (first.value.details() or "")
    assert (again.value.code(), again.value.details()) == (first.value.code(), first.value.details())
    assert db.execute("SELECT balance FROM accounts WHERE id = 'rt-eur'").fetchone() == (5,)
    assert db.execute("SELECT count(*) FROM ledger_entries WHERE account_id = 'rt-eur'").fetchone() == (1,)
    (code,) = db.execute(
        "SELECT status_code FROM idempotency_record WHERE key = %s", (md[0][1],)
    ).fetchone() or (None,)
    assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    # The key is not left held: no advisory lock outlives the calls.
    locks = db.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
        " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
    ).fetchone()
    assert locks == (0,)
