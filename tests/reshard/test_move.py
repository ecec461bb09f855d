"""Moving a slot range between two shards: under load with duplicates, resumed after a stop at
every phase, aborted at every phase, and refused when it cannot be done.

Two real shard daemons (gRPC on loopback, relays on) over two databases of a real PostgreSQL
(wal_level=logical), following one shard map file; the move uses PostgreSQL's own logical
replication between them.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psycopg
import pytest
from grpc_status import rpc_status

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import ShardMap, even_shard_map, load_shard_map, write_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.reshard.move import Move, MoveSettings, ShardDatabases, start_move
from shardrouter.reshard.plan import MoveError, Phase
from shardrouter.reshard.verify import rows_in_range
from shardrouter.shardd.migrations import FENCED_TABLES
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.conftest import key_metadata, make_settings, money

FIRST, LAST = 0, 4095  # a quarter of the slots, all owned by shard-0 in the even map


@dataclass
class Pair:
    """Two shards over two databases, one map file."""

    map_path: Path
    dsns: dict[str, str]
    ports: dict[str, int]
    daemons: dict[str, ShardDaemon] = field(default_factory=dict)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    @property
    def databases(self) -> ShardDatabases:
        return ShardDatabases(self.dsns)

    def stub(self, shard_id: str) -> transfer_pb2_grpc.TransferServiceStub:
        if shard_id not in self.channels:
            self.channels[shard_id] = grpc.insecure_channel(f"127.0.0.1:{self.ports[shard_id]}")
        return transfer_pb2_grpc.TransferServiceStub(self.channels[shard_id])

    def owner(self, account: str, shard_map: ShardMap | None = None) -> str:
        return (shard_map or load_shard_map(self.map_path)).shard_for(account).id

    def sql(self, shard_id: str, query: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        with psycopg.connect(self.dsns[shard_id], autocommit=True) as conn:
            return conn.execute(query, params).fetchall()


@pytest.fixture
def pair(postgres: LocalPostgres, tmp_path: Path) -> Iterator[Pair]:
    ports = {"shard-0": free_port(), "shard-1": free_port()}
    map_path = tmp_path / "shard-map.yaml"
    write_shard_map(map_path, even_shard_map({s: f"127.0.0.1:{p}" for s, p in ports.items()}, version=1))
    dsns = {}
    for sid in ports:
        name = f"mv{uuid.uuid4().hex[:10]}"
        postgres.create_database(name)
        dsns[sid] = postgres.dsn_for(name)
    cluster = Pair(map_path, dsns, ports)
    for sid in ports:
        cluster.daemons[sid] = start_shard(
            make_settings(
                dsns[sid],
                shard_id=sid,
                listen=f"127.0.0.1:{ports[sid]}",
                shard_map=str(map_path),
                shard_map_reload_s=0.1,
                relay_workers=1,
            )
        )
    yield cluster
    for channel in cluster.channels.values():
        channel.close()
    for daemon in cluster.daemons.values():
        daemon.stop(0.2)


def _accounts(pair: Pair, n: int) -> tuple[list[str], list[str]]:
    """`n` accounts in the moving range and `n` elsewhere (half of those on each shard)."""
    shard_map = load_shard_map(pair.map_path)
    moving, staying = [], []
    for i in range(100_000):
        account = f"acct-{i}"
        if FIRST <= shard_map.slot_of(account) <= LAST:
            if len(moving) < n:
                moving.append(account)
        elif len(staying) < n:
            staying.append(account)
        if len(moving) == n and len(staying) == n:
            return moving, staying
    raise AssertionError("not enough accounts")


def _answer(
    call: grpc.RpcError | transfer_pb2.DepositResponse | transfer_pb2.TransferResponse,
) -> tuple[object, ...]:
    """What a caller sees of an answer, byte for byte."""
    if isinstance(call, grpc.RpcError):
        status = rpc_status.from_call(call)  # type: ignore[arg-type]
        return ("error", call.code(), call.details(), status.SerializeToString() if status else b"")
    return ("ok", call.SerializeToString(deterministic=True))


def _send(pair: Pair, method: str, request: object, key: uuid.UUID, route: str, *, deadline_s: float = 30.0):
    """Send with one key until a final answer; UNAVAILABLE/ABORTED are retried with the same key.
    `route` is the account that picks the shard, by the map in the file at each attempt."""
    give_up = time.monotonic() + deadline_s
    while True:
        stub = pair.stub(pair.owner(route))
        try:
            return getattr(stub, method)(request, metadata=key_metadata(key), timeout=5)
        except grpc.RpcError as err:
            if (
                err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
                or time.monotonic() > give_up
            ):
                return err
            time.sleep(0.02)


def _seed(pair: Pair, accounts: list[str], amount: int) -> None:
    for account in accounts:
        answer = _send(
            pair,
            "Deposit",
            transfer_pb2.DepositRequest(account_id=account, amount=money(amount)),
            new_key(),
            account,
        )
        assert not isinstance(answer, grpc.RpcError), answer


def _leftovers(pair: Pair) -> dict[str, object]:
    """Everything a move could leave behind, on both sides."""
    found: dict[str, object] = {}
    for sid in pair.dsns:
        found[f"{sid} publications"] = pair.sql(sid, "SELECT pubname FROM pg_publication")
        found[f"{sid} subscriptions"] = pair.sql(
            sid,
            "SELECT subname FROM pg_subscription WHERE subdbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        found[f"{sid} full identities"] = pair.sql(
            sid, "SELECT relname FROM pg_class WHERE relreplident = 'f' AND relkind IN ('r', 'p')"
        )
    found["slots"] = pair.sql(
        "shard-0", "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'shardrouter_move_%%'"
    )
    return found


def _no_leftovers(pair: Pair) -> None:
    assert {k: v for k, v in _leftovers(pair).items() if v} == {}


def test_a_move_under_load_applies_every_key_once_and_replays_after(pair: Pair) -> None:
    moving, staying = _accounts(pair, 12)
    everyone = moving + staying
    _seed(pair, everyone, 10_000)
    old_map = load_shard_map(pair.map_path)
    answers: dict[uuid.UUID, tuple[str, object, str, tuple[object, ...]]] = {}
    mismatches: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def load(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            key = new_key()
            if rng.random() < 0.4:
                account = rng.choice(everyone)
                method, route = "Deposit", account
                request: object = transfer_pb2.DepositRequest(
                    account_id=account, amount=money(rng.randint(1, 9))
                )
            else:
                src, dst = rng.sample(everyone, 2)
                method, route = "Transfer", src
                request = transfer_pb2.TransferRequest(
                    source_account_id=src, destination_account_id=dst, amount=money(rng.randint(1, 5))
                )
            first = _answer(_send(pair, method, request, key, route))
            with lock:
                answers[key] = (method, request, route, first)
            if rng.random() < 0.3:  # a duplicate right away: before, during or after the cut-over
                again = _answer(_send(pair, method, request, key, route))
                if again != first:
                    with lock:
                        mismatches.append(f"{method} {key}: {first[:2]} then {again[:2]}")

    workers = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    settings = MoveSettings(copy_timeout_s=30, catch_up_timeout_s=30, final_sync_timeout_s=30)
    try:
        with Move(record, map_path=pair.map_path, databases=pair.databases, settings=settings) as move:
            move.run()
    finally:
        stop.set()
    time.sleep(1.0)
    stop.set()
    for w in workers:
        w.join(60)

    assert record.phase is Phase.DONE
    assert sum(record.figures["rows_moved"].values()) > 0
    assert mismatches == []
    ok = [k for k, a in answers.items() if a[3][0] == "ok"]
    assert len(ok) > 50, f"the load barely ran: {len(ok)} successful calls"
    # Every retry after the move, through the map in force, is a verbatim replay.
    new_map = load_shard_map(pair.map_path)
    assert new_map.version == old_map.version + 1 and all(pair.owner(a, new_map) == "shard-1" for a in moving)
    replays = {k: _answer(_send(pair, m, r, k, route)) for k, (m, r, route, _) in answers.items()}
    assert [k for k in answers if replays[k] != answers[k][3]] == []
    # Each applied key moved money once, wherever its rows are now.
    legs: dict[str, int] = {}
    for sid in pair.dsns:
        for key, kind, n in pair.sql(
            sid, "SELECT idempotency_key::text, kind, count(*) FROM ledger_entries GROUP BY 1, 2"
        ):
            legs[f"{key}/{kind}"] = legs.get(f"{key}/{kind}", 0) + int(n)  # type: ignore[call-overload]
    assert {k: n for k, n in legs.items() if n != 1} == {}
    # Money is conserved once every credit has landed.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pending = sum(
            int(pair.sql(sid, "SELECT count(*) FROM outbox WHERE delivered_at IS NULL")[0][0])  # type: ignore[call-overload]
            for sid in pair.dsns
        )
        if pending == 0:
            break
        time.sleep(0.1)
    assert pending == 0
    deposited = 10_000 * len(everyone) + sum(
        r.amount.amount_minor  # type: ignore[attr-defined]
        for m, r, _, a in answers.values()
        if m == "Deposit" and a[0] == "ok"
    )
    total = sum(
        int(pair.sql(sid, "SELECT coalesce(sum(balance), 0) FROM accounts")[0][0]) for sid in pair.dsns
    )  # type: ignore[call-overload]
    assert total == deposited
    for sid in pair.dsns:
        assert pair.sql(
            sid,
            "SELECT count(*) FROM accounts a WHERE balance <> coalesce((SELECT sum(amount_minor)"
            " FROM ledger_entries l WHERE l.account_id = a.id), 0)",
        ) == [(0,)]
    # The old owner holds nothing of the range and refuses it for good; nothing is left behind.
    plan = record.plan
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        assert sum(rows_in_range(conn, plan).values()) == 0
    with pytest.raises(grpc.RpcError) as refused:
        pair.stub("shard-0").Deposit(
            transfer_pb2.DepositRequest(account_id=moving[0], amount=money(1)),
            metadata=key_metadata(),
            timeout=5,
        )
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    _no_leftovers(pair)


def test_a_committed_move_cannot_be_aborted(pair: Pair) -> None:
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_path=pair.map_path, databases=pair.databases) as move:
        move.run(until=Phase.COMMITTED)
        with pytest.raises(MoveError, match="committed"):
            move.abort()
        move.run()
    assert record.phase is Phase.DONE


def test_a_move_back_returns_the_range_and_lifts_the_old_marker(pair: Pair) -> None:
    moving, _ = _accounts(pair, 3)
    _seed(pair, moving, 50)
    there = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(there, map_path=pair.map_path, databases=pair.databases) as move:
        move.run()
    back = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-0")
    with Move(back, map_path=pair.map_path, databases=pair.databases, settings=MoveSettings()) as move:
        move.run()
    assert all(pair.owner(a) == "shard-0" for a in moving)
    _seed(pair, moving, 1)  # the old owner takes them again: the moved-out marker is gone
    assert pair.sql("shard-0", "SELECT move_id FROM slot_fences") == []
    assert [m for (m,) in pair.sql("shard-1", "SELECT move_id FROM slot_fences")] == [back.plan.move_id]
    assert set(FENCED_TABLES) <= {t for (t,) in pair.sql("shard-0", "SELECT tablename::text FROM pg_tables")}
    _no_leftovers(pair)
