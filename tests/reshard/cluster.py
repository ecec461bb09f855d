"""Two real shards over two databases of one real PostgreSQL (wal_level=logical), following one
shard map file, and what the move tests ask of them: routing by the map in force, retries with one
key, the ledger's invariants, and everything a move could leave behind."""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psycopg
from grpc_status import rpc_status

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import ShardMap, load_shard_map
from shardrouter.reshard.move import ShardDatabases
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.conftest import key_metadata, money

FIRST, LAST = 0, 4095  # a quarter of the slots, all owned by shard-0 in the even map
SEEDED = 10_000  # what `seed` deposits into each account

Answer = tuple[object, ...]


@dataclass
class Pair:
    """Two shards over two databases, one map file; `ports` are the shards' gRPC ports."""

    map_path: Path
    dsns: dict[str, str]
    ports: dict[str, int]
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

    def count(self, shard_id: str, query: str) -> int:
        return int(self.sql(shard_id, query)[0][0])  # type: ignore[call-overload]

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def accounts(pair: Pair, n: int) -> tuple[list[str], list[str]]:
    """`n` accounts in the moving range and `n` elsewhere (on both shards)."""
    shard_map = load_shard_map(pair.map_path)
    moving: list[str] = []
    staying: list[str] = []
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


def answer_of(call: object) -> Answer:
    """What a caller sees of an answer, byte for byte."""
    if isinstance(call, grpc.RpcError):
        status = rpc_status.from_call(call)  # type: ignore[arg-type]
        return ("error", call.code(), call.details(), status.SerializeToString() if status else b"")
    return ("ok", call.SerializeToString(deterministic=True))  # type: ignore[attr-defined]


def send(
    pair: Pair, method: str, request: object, key: uuid.UUID, route: str, *, deadline_s: float = 30.0
) -> object:
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


def seed(pair: Pair, accounts_: list[str], amount: int = SEEDED) -> None:
    for account in accounts_:
        answer = send(
            pair,
            "Deposit",
            transfer_pb2.DepositRequest(account_id=account, amount=money(amount)),
            new_key(),
            account,
        )
        assert not isinstance(answer, grpc.RpcError), answer


@dataclass
class Load:
    """Deposits and transfers over some accounts from a few threads, each key's first answer kept,
    and 30 % of calls sent again at once with the same key (whose answer must be the same)."""

    pair: Pair
    everyone: list[str]
    threads: int = 4
    answers: dict[uuid.UUID, tuple[str, object, str, Answer]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self._workers = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(60)

    def _run(self, seed_: int) -> None:
        rng = random.Random(seed_)
        while not self._stop.is_set():
            key = new_key()
            request: object
            if rng.random() < 0.4:
                account = rng.choice(self.everyone)
                method, route = "Deposit", account
                request = transfer_pb2.DepositRequest(account_id=account, amount=money(rng.randint(1, 9)))
            else:
                src, dst = rng.sample(self.everyone, 2)
                method, route = "Transfer", src
                request = transfer_pb2.TransferRequest(
                    source_account_id=src, destination_account_id=dst, amount=money(rng.randint(1, 5))
                )
            first = answer_of(send(self.pair, method, request, key, route))
            with self._lock:
                self.answers[key] = (method, request, route, first)
            if rng.random() < 0.3:  # a duplicate right away: before, during or after the cut-over
                again = answer_of(send(self.pair, method, request, key, route))
                if again != first:
                    with self._lock:
                        self.mismatches.append(f"{method} {key}: {first[:2]} then {again[:2]}")

    def ok_count(self) -> int:
        return sum(1 for a in self.answers.values() if a[3][0] == "ok")

    def deposited(self) -> int:
        return sum(
            r.amount.amount_minor  # type: ignore[attr-defined]
            for m, r, _, a in self.answers.values()
            if m == "Deposit" and a[0] == "ok"
        )

    def replays_that_differ(self) -> list[uuid.UUID]:
        """Every key sent again through the map in force: the keys whose answer is not verbatim."""
        return [
            k
            for k, (m, r, route, first) in self.answers.items()
            if answer_of(send(self.pair, m, r, k, route)) != first
        ]


def check_ledger(pair: Pair, seeded_accounts: int, deposited: int) -> None:
    """Every ledger leg of a key once, every credit landed, money conserved, balances = ledger."""
    legs: dict[str, int] = {}
    for sid in pair.dsns:
        for key, kind, n in pair.sql(
            sid, "SELECT idempotency_key::text, kind, count(*) FROM ledger_entries GROUP BY 1, 2"
        ):
            legs[f"{key}/{kind}"] = legs.get(f"{key}/{kind}", 0) + int(n)  # type: ignore[call-overload]
    assert {k: n for k, n in legs.items() if n != 1} == {}
    deadline = time.monotonic() + 30
    pending = -1
    while time.monotonic() < deadline:
        pending = sum(
            pair.count(sid, "SELECT count(*) FROM outbox WHERE delivered_at IS NULL") for sid in pair.dsns
        )
        if pending == 0:
            break
        time.sleep(0.1)
    assert pending == 0, "credits still undelivered after 30 s"
    total = sum(pair.count(sid, "SELECT coalesce(sum(balance), 0) FROM accounts") for sid in pair.dsns)
    assert total == SEEDED * seeded_accounts + deposited
    for sid in pair.dsns:
        assert pair.sql(
            sid,
            "SELECT count(*) FROM accounts a WHERE balance <> coalesce((SELECT sum(amount_minor)"
            " FROM ledger_entries l WHERE l.account_id = a.id), 0)",
        ) == [(0,)]


def leftovers(pair: Pair) -> dict[str, object]:
    """Everything a move could leave behind, on both sides."""
    found: dict[str, object] = {}
    for sid in pair.dsns:
        found[f"{sid} publications"] = pair.sql(sid, "SELECT pubname FROM pg_publication")
        found[f"{sid} subscriptions"] = pair.sql(
            sid,
            "SELECT subname FROM pg_subscription"
            " WHERE subdbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        found[f"{sid} full identities"] = pair.sql(
            sid, "SELECT relname FROM pg_class WHERE relreplident = 'f' AND relkind IN ('r', 'p')"
        )
        found[f"{sid} slots"] = pair.sql(
            sid, "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
        )
    return found


def assert_no_leftovers(pair: Pair) -> None:
    assert {k: v for k, v in leftovers(pair).items() if v} == {}
