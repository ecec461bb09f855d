"""Two real shards over two databases of one real PostgreSQL (wal_level=logical), following one
shard map file (`new_pair` makes them, `start_daemons` serves them in this process), and what the
move tests ask of them: routing by the map in force, retries with one key, the ledger's
invariants, and everything a move could leave behind."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
import psycopg
from grpc_status import rpc_status

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import ShardMap, even_shard_map, load_shard_map, write_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.reshard import replication
from shardrouter.reshard.move import ShardDatabases
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money

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

    def call(self, method: str, request: object, key: uuid.UUID, route: str, sending: int = 0) -> object:
        """One attempt (a `Sender`): to the owner of `route` by the map file now."""
        return getattr(self.stub(self.owner(route)), method)(request, metadata=key_metadata(key), timeout=5)

    def count(self, shard_id: str, query: str) -> int:
        return int(self.sql(shard_id, query)[0][0])  # type: ignore[call-overload]

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def new_pair(postgres: LocalPostgres, tmp_path: Path) -> Pair:
    """Two new databases and a map file giving each shard half of the slots (version 1)."""
    ports = {"shard-0": free_port(), "shard-1": free_port()}
    map_path = tmp_path / "shard-map.yaml"
    write_shard_map(map_path, even_shard_map({s: f"127.0.0.1:{p}" for s, p in ports.items()}, version=1))
    dsns = {}
    for sid in ports:
        name = f"mv{uuid.uuid4().hex[:10]}"
        postgres.create_database(name)
        dsns[sid] = postgres.dsn_for(name)
    return Pair(map_path, dsns, ports)


def start_daemons(pair: Pair, *, metrics: bool = False) -> dict[str, ShardDaemon]:
    """An in-process daemon per shard of `pair`, on its port, following its map file (re-read every
    0.1 s), relays on; with `metrics`, each serves /metrics on a free loopback port."""
    return {
        sid: start_shard(
            make_settings(
                pair.dsns[sid],
                shard_id=sid,
                listen=f"127.0.0.1:{port}",
                shard_map=str(pair.map_path),
                shard_map_reload_s=0.1,
                relay_workers=1,
                **({"metrics_port": free_port()} if metrics else {}),
            ),
            metrics_host="127.0.0.1" if metrics else None,
        )
        for sid, port in pair.ports.items()
    }


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


#: What a caller retries with the same key: nothing was applied, or it may have been and the retry
#: gets the stored answer.
RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})
#: The same, and a call that timed out.
TRANSIENT = RETRIED | {grpc.StatusCode.DEADLINE_EXCEEDED}


class Sender(Protocol):
    """How the load sends one attempt of an operation: returns the response or raises the error.
    `route` is the account that picks the shard; `sending` is 0 for the key's first sending and
    its replays, 1 for its duplicate (a sender may send that elsewhere, e.g. through another router)."""

    def __call__(self, method: str, request: object, key: uuid.UUID, route: str, sending: int) -> object: ...


def until_final(
    attempt: Callable[[], object],
    *,
    retry_on: frozenset[grpc.StatusCode] = RETRIED,
    pause_s: float = 0.02,
    deadline_s: float = 30.0,
    retried: Counter[str] | None = None,
) -> object:
    """Repeat `attempt` (one call with one key) until a final answer: the response, or the error if its
    code is not in `retry_on` or `deadline_s` is over; each retried attempt counted in `retried` by code."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            return attempt()
        except grpc.RpcError as err:
            if err.code() not in retry_on or time.monotonic() > give_up:
                return err
            if retried is not None:
                retried[err.code().name] += 1
            time.sleep(pause_s)


def send(
    pair: Pair,
    method: str,
    request: object,
    key: uuid.UUID,
    route: str,
    *,
    retry_on: frozenset[grpc.StatusCode] = RETRIED,
    deadline_s: float = 30.0,
) -> object:
    """Send with one key until a final answer; codes in `retry_on` are retried with the same key.
    `route` is the account that picks the shard, by the map in the file at each attempt."""
    return until_final(
        lambda: pair.call(method, request, key, route), retry_on=retry_on, deadline_s=deadline_s
    )


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
class Call:
    """One operation's first sending as its caller saw it: when it started, how long it took to a
    final answer."""

    started: float
    seconds: float
    route: str
    answer: Answer
    key: uuid.UUID | None = None


@dataclass
class Load:
    """Deposits (40 %) and Transfers (60 %, between any two accounts: cross-shard ones too) from a
    few threads, each sent by `send` and retried with its key on a code in `retry_on`, each key's
    first answer kept, and 30 % of calls sent again at once with the same key (whose answer must be
    the same). Attempts retried are counted by code; with `timed`, each first sending's latency is
    kept in `calls`."""

    send: Sender
    everyone: list[str]
    threads: int = 4
    retry_on: frozenset[grpc.StatusCode] = RETRIED
    pause_s: float = 0.02
    timed: bool = False
    answers: dict[uuid.UUID, tuple[str, object, str, Answer]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    duplicates: int = 0
    #: Attempts answered with a code the caller retries, by code (from every thread).
    retried: Counter[str] = field(default_factory=Counter)
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

    @property
    def stuck(self) -> int:
        """Threads still running after `stop` gave each 60 s to end."""
        return sum(worker.is_alive() for worker in self._workers)

    def final(
        self,
        method: str,
        request: object,
        key: uuid.UUID,
        route: str,
        sending: int = 0,
        retried: Counter[str] | None = None,
    ) -> Answer:
        """What the caller ends up with: `send` until a final answer, with the same key."""
        return answer_of(
            until_final(
                lambda: self.send(method, request, key, route, sending),
                retry_on=self.retry_on,
                pause_s=self.pause_s,
                retried=retried,
            )
        )

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
            retried: Counter[str] = Counter()
            started = time.monotonic()
            first = self.final(method, request, key, route, 0, retried)
            call = Call(started, time.monotonic() - started, route, first, key)
            with self._lock:
                self.answers[key] = (method, request, route, first)
                if self.timed:
                    self.calls.append(call)
            if rng.random() < 0.3:  # a duplicate right away: before, during or after the cut-over
                again = self.final(method, request, key, route, 1, retried)
                with self._lock:
                    self.duplicates += 1
                    if again != first:
                        self.mismatches.append(f"{method} {key}: {first[:3]} then {again[:3]}")
            with self._lock:
                self.retried.update(retried)

    def ok_count(self) -> int:
        return sum(1 for a in self.answers.values() if a[3][0] == "ok")

    def refusals(self) -> list[tuple[str, object, Answer]]:
        """The operations whose final answer was not OK: method, request, answer."""
        return [(m, r, a) for m, r, _, a in self.answers.values() if a[0] != "ok"]

    def deposited(self) -> int:
        return sum(
            r.amount.amount_minor  # type: ignore[attr-defined]
            for m, r, _, a in self.answers.values()
            if m == "Deposit" and a[0] == "ok"
        )

    def replays_that_differ(self, sendings: tuple[int, ...] = (0,)) -> list[str]:
        """Every key sent again (as each of `sendings`), through the map in force: those whose
        answer is not the first one verbatim."""
        differ = []
        for key, (method, request, route, first) in self.answers.items():
            for sending in sendings:
                again = self.final(method, request, key, route, sending)
                if again != first:
                    differ.append(f"{method} {key}: {first[:3]} then {again[:3]}")
        return differ


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
        unbalanced = pair.sql(
            sid,
            "SELECT a.id, a.balance, coalesce((SELECT sum(amount_minor)"
            " FROM ledger_entries l WHERE l.account_id = a.id), 0) AS total FROM accounts a"
            " WHERE balance <> coalesce((SELECT sum(amount_minor) FROM ledger_entries l WHERE l.account_id = a.id), 0)",
        )
        # Named with every shard's entries of the account, so a failure shows where the difference is.
        assert unbalanced == [], f"{sid}: {unbalanced}; " + "; ".join(
            f"{other} entries of {a[0]}: "
            + str(
                pair.sql(
                    other,
                    "SELECT kind, amount_minor, transfer_id::text, account_hash, created_at::text"
                    " FROM ledger_entries WHERE account_id = %s ORDER BY created_at",
                    (a[0],),
                )
            )
            for a in unbalanced[:3]
            for other in pair.dsns
        )


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
        # The identity a move's row filter needs is permanent (migration 15, and each partition
        # when it is made): a move neither takes it away nor spreads it to other tables.
        with psycopg.connect(pair.dsns[sid], autocommit=True) as conn:
            moved = replication.replicated_relations(conn)
            found[f"{sid} moved tables not FULL"] = replication.lacking_replica_identity(conn)
        found[f"{sid} other tables FULL"] = pair.sql(
            sid,
            "SELECT relname FROM pg_class WHERE relreplident = 'f' AND relkind IN ('r', 'p')"
            " AND relnamespace = current_schema()::regnamespace AND NOT relname = ANY(%s)",
            (moved,),
        )
        found[f"{sid} slots"] = pair.sql(
            sid, "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
        )
    return found


def assert_replays_match(load: Load, pair: Pair, sendings: tuple[int, ...] = (0,)) -> None:
    """First, every operation first answered OK left its ledger entry on a shard (`unapplied_oks`:
    an OK is never the answer to work that did not commit); then every key sent again
    (`Load.replays_that_differ`) answers its first answer verbatim. Either failure lists what each
    shard's database holds of the keys concerned (their records and ledger rows, with the
    database's times), read before the databases go."""
    unapplied = unapplied_oks(load, pair)
    assert unapplied == [], "\n".join([*unapplied, *_whereabouts(pair, load, unapplied)])
    differ = load.replays_that_differ(sendings)
    assert differ == [], "\n".join([*differ, *_whereabouts(pair, load, differ)])


def unapplied_oks(load: Load, pair: Pair) -> list[str]:
    """The operations answered OK at their first sending whose ledger entry no shard holds: a
    Deposit's `entry_id`, a Transfer's debit leg (by `transfer_id`). Read before any replay, which
    could apply such an operation again and hide it."""
    wanted: dict[str, str] = {}  # entry or transfer id -> "<method> <key>: ..."
    for key, (method, _, _, first) in load.answers.items():
        ident = _answered_id(method, first)
        if ident is not None:
            wanted[ident] = (
                f"{method} {key}: {first[:2]} answered OK, its ledger entry {ident} is on no shard"
            )
    found: set[str] = set()
    for shard_id in pair.dsns:
        rows = pair.sql(
            shard_id,
            "SELECT id::text FROM ledger_entries WHERE id::text = ANY(%s)"
            " UNION SELECT transfer_id::text FROM ledger_entries"
            " WHERE kind = 'transfer_out' AND transfer_id::text = ANY(%s)",
            (list(wanted), list(wanted)),
        )
        found.update(str(r[0]) for r in rows)
    return [line for ident, line in wanted.items() if ident not in found]


def _answered_id(method: str, answer: Answer) -> str | None:
    """The ledger id an OK answer names (a Deposit's entry_id, a Transfer's transfer_id); None if
    the answer is not OK."""
    if answer[0] != "ok":
        return None
    raw = answer[1]
    assert isinstance(raw, bytes)
    if method == "Deposit":
        return transfer_pb2.DepositResponse.FromString(raw).entry_id
    return transfer_pb2.TransferResponse.FromString(raw).transfer.transfer_id


def _whereabouts(pair: Pair, load: Load, lines: list[str]) -> list[str]:
    """What each shard holds of the keys named in `lines`: their records and ledger rows, and the
    ledger row the key's first answer names, whichever key it is under (an answer that carried
    another call's outcome shows there)."""
    found = []
    for key in sorted({line.split()[1].rstrip(":") for line in lines}):
        method, _, _, first = load.answers[uuid.UUID(key)]
        ident = _answered_id(method, first)
        for shard_id in pair.dsns:
            records = pair.sql(
                shard_id,
                "SELECT scope, state, status_code, created_at, completed_at, account_hash"
                " FROM idempotency_record WHERE key::text = %s",
                (key,),
            )
            entries = pair.sql(
                shard_id,
                "SELECT id, account_id, amount_minor, kind, created_at FROM ledger_entries"
                " WHERE idempotency_key::text = %s",
                (key,),
            )
            named = pair.sql(
                shard_id,
                "SELECT id, idempotency_key, account_id, amount_minor, kind, created_at FROM ledger_entries"
                " WHERE id::text = %s OR (kind = 'transfer_out' AND transfer_id::text = %s)",
                (ident, ident),
            )
            found.append(
                f"{key} on {shard_id}: records {records}; ledger rows {entries}; "
                f"the first answer's entry {ident}: {named}"
            )
    return found


def assert_no_leftovers(pair: Pair) -> None:
    assert {k: v for k, v in leftovers(pair).items() if v} == {}
