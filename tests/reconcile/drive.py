"""What the reconcile tests do to a real local cluster (`LocalCluster`: a PostgreSQL, a `shardd`
process per shard, the router): calls through the router, cross-shard load, waiting for the relays,
the faults a restore leaves behind (written as the restore would leave them: an entry, its balance
and its idempotency record go together), and `shard-router reconcile` run in-process or as the
installed command."""

from __future__ import annotations

import contextlib
import io
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psycopg

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import load_shard_map
from shardrouter.localcluster.cluster import LocalCluster
from shardrouter.localcluster.postgres import free_port
from shardrouter.reconcile import cli
from shardrouter.reconcile.repair import REPAIRED
from shardrouter.shardd.ledger.service import credit_key, refund_key
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, money, pg_data_dir
from tests.processes import run_to_failpoint

SEEDED = 100_000  # what each account gets first


@contextlib.contextmanager
def running_cluster(shards: int = 2) -> Iterator[LocalCluster]:
    """A local cluster of `shards` shards on free ports, stopped and deleted afterwards."""
    cluster = LocalCluster(
        data_dir=pg_data_dir().parent / "cluster", shards=shards, router_port=free_port(), http_port=0
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        cluster.wipe()


@dataclass
class Bank:
    """Accounts on every shard of a running cluster, called through its router."""

    cluster: LocalCluster
    by_shard: dict[str, list[str]] = field(default_factory=dict)
    _channel: grpc.Channel | None = None

    @property
    def stub(self) -> transfer_pb2_grpc.TransferServiceStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.cluster.router_port}")
        return transfer_pb2_grpc.TransferServiceStub(self._channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def open_accounts(self, prefix: str, per_shard: int) -> dict[str, list[str]]:
        """`per_shard` new accounts on each shard, each given SEEDED."""
        shard_map = load_shard_map(self.cluster.shard_map_path)
        made: dict[str, list[str]] = {s: [] for s in self.cluster.shard_ids}
        i = 0
        while any(len(v) < per_shard for v in made.values()):
            account = f"{prefix}-{i}"
            i += 1
            owner = shard_map.shard_for(account).id
            if len(made[owner]) < per_shard:
                made[owner].append(account)
                self.deposit(account, SEEDED)
        for shard, accounts in made.items():
            self.by_shard.setdefault(shard, []).extend(accounts)
        return made

    def call(self, method: str, request: object, key: uuid.UUID | None = None) -> Any:
        """One operation with one key, resent on the codes a caller resends on (bounded)."""
        key = key or new_key()
        give_up = time.monotonic() + 30
        while True:
            try:
                return getattr(self.stub, method)(request, metadata=key_metadata(key), timeout=10)
            except grpc.RpcError as err:
                if (
                    err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
                    or time.monotonic() > give_up
                ):
                    raise
                time.sleep(0.05)

    def deposit(self, account: str, amount: int) -> None:
        self.call("Deposit", transfer_pb2.DepositRequest(account_id=account, amount=money(amount)))

    def transfer(self, src: str, dst: str, amount: int, key: uuid.UUID | None = None) -> uuid.UUID:
        reply = self.call(
            "Transfer",
            transfer_pb2.TransferRequest(
                source_account_id=src, destination_account_id=dst, amount=money(amount)
            ),
            key,
        )
        return uuid.UUID(reply.transfer.transfer_id)

    def nobody_on(self, shard: str) -> str:
        """An account id the shard owns that no one opened."""
        shard_map = load_shard_map(self.cluster.shard_map_path)
        return next(f"nobody-{i}" for i in range(10_000) if shard_map.shard_for(f"nobody-{i}").id == shard)

    def shard_of(self, account: str) -> str:
        return load_shard_map(self.cluster.shard_map_path).shard_for(account).id


def cross_shard_load(
    bank: Bank, accounts: dict[str, list[str]], transfers: int, threads: int = 4
) -> list[uuid.UUID]:
    """`transfers` transfers between accounts of different shards, from a few threads; their ids."""
    shards = sorted(accounts)
    made: list[uuid.UUID] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(seed: int, n: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(n):
                a, b = rng.sample(shards, 2)
                tid = bank.transfer(rng.choice(accounts[a]), rng.choice(accounts[b]), rng.randint(1, 50))
                with lock:
                    made.append(tid)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    workers = [
        threading.Thread(target=work, args=(i, transfers // threads + (i < transfers % threads)))
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors
    return made


@dataclass
class Load:
    """Cross-shard transfers from a background thread until stopped (the drill's load)."""

    bank: Bank
    accounts: dict[str, list[str]]
    made: list[uuid.UUID] = field(default_factory=list)
    #: What the caller keeps of each acknowledged transfer: transfer id -> (key, source, destination, amount).
    sent: dict[uuid.UUID, tuple[uuid.UUID, str, str, int]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(7)
        shards = sorted(self.accounts)
        while not self._stop.is_set():
            a, b = rng.sample(shards, 2)
            key, src, dst, amount = (
                new_key(),
                rng.choice(self.accounts[a]),
                rng.choice(self.accounts[b]),
                rng.randint(1, 50),
            )
            try:
                tid = self.bank.transfer(src, dst, amount, key)
                self.sent[tid] = (key, src, dst, amount)
                self.made.append(tid)
            except grpc.RpcError as err:
                self.failed.append(f"{err.code().name}: {err.details()}")

    def wait_for(self, count: int, timeout_s: float = 30) -> None:
        """Until `count` more transfers have been made (bounded)."""
        target = len(self.made) + count
        give_up = time.monotonic() + timeout_s
        while len(self.made) < target:
            assert time.monotonic() < give_up, (
                f"load made {len(self.made)} of {target} transfers; {self.failed[-3:]}"
            )
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


def sql(dsn: str, query: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def dsns(cluster: LocalCluster) -> dict[str, str]:
    import yaml

    loaded = yaml.safe_load(cluster.databases_path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return {str(k): str(v) for k, v in loaded.items()}


def settle(cluster: LocalCluster, timeout_s: float = 30) -> None:
    """Until every shard's outbox is delivered or dead-lettered and every dead letter refunded."""
    give_up = time.monotonic() + timeout_s
    while True:
        owed = sum(
            sql(
                dsn,
                "SELECT (SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL)"
                " + (SELECT count(*) FROM dead_letters WHERE refunded_at IS NULL)",
            )[0][0]
            for dsn in dsns(cluster).values()
        )
        if owed == 0:
            return
        assert time.monotonic() < give_up, f"{owed} credits or refunds still owed after {timeout_s} s"
        time.sleep(0.05)


def reconcile(cluster: LocalCluster, *args: str) -> tuple[int, dict[str, Any]]:
    """`shard-router reconcile --json ARGS` in this process: the exit code and the JSON report."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(
            [
                "--databases",
                str(cluster.databases_path),
                "--map",
                str(cluster.shard_map_path),
                "--json",
                *args,
            ]
        )
    return code, json.loads(out.getvalue())


def reconcile_text(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    """`shard-router reconcile ARGS` in this process, in words: the exit code and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["--databases", str(cluster.databases_path), *args])
    return code, out.getvalue()


def reconcile_command(cluster: LocalCluster, *args: str) -> subprocess.Popen[str]:
    """The installed `shard-router reconcile ARGS` as a process of its own (not waited for)."""
    command = Path(sys.executable).with_name("shard-router")
    return subprocess.Popen(
        [str(command), "reconcile", "--databases", str(cluster.databases_path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reconcile_killed_after_first_repair(cluster: LocalCluster, *args: str) -> None:
    """`shard-router reconcile --repair ARGS`, SIGKILLed right after its first repair committed
    (failpoint `reconcile.repaired`)."""
    command = Path(sys.executable).with_name("shard-router")
    run_to_failpoint(
        [str(command), "reconcile", "--databases", str(cluster.databases_path), "--repair", *args],
        REPAIRED,
    )


def kinds(report: dict[str, Any]) -> dict[str, str]:
    """transfer id (or shard/account) -> kind, of every mismatch."""
    return {(m["transfer_id"] or f"{m['shard']}/{m['account']}"): m["kind"] for m in report["mismatches"]}


# -- faults, as a restore (or a careless hand) leaves them -----------------------------------------


def lose_credit(dsn: str, transfer_id: uuid.UUID, *, keep_record: bool = False) -> tuple[str, int]:
    """The destination forgets a credit it applied: its entry, its balance and its key's record
    (with `keep_record`, a careless hand: the record stays). Returns (account, amount)."""
    with psycopg.connect(dsn) as conn:
        account, amount = conn.execute(
            "DELETE FROM ledger_entries WHERE transfer_id = %s AND kind = 'transfer_in' RETURNING account_id, amount_minor",
            (transfer_id,),
        ).fetchone() or (None, 0)
        assert account is not None, f"no credit of {transfer_id} here"
        conn.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, account))
        if not keep_record:
            conn.execute("DELETE FROM idempotency_record WHERE key = %s", (str(credit_key(transfer_id)),))
    return str(account), int(amount)


def lose_transfer(dsn: str, transfer_id: uuid.UUID) -> tuple[str, int]:
    """The source forgets a transfer: its row, debit, outbox row, history and the caller's key
    record, and the debit goes back to the balance. Returns (source account, amount)."""
    with psycopg.connect(dsn) as conn:
        account, amount, key = conn.execute(
            "SELECT account_id, -amount_minor, idempotency_key FROM ledger_entries"
            " WHERE transfer_id = %s AND kind = 'transfer_out'",
            (transfer_id,),
        ).fetchone() or (None, 0, None)
        assert account is not None, f"no debit of {transfer_id} here"
        conn.execute("DELETE FROM ledger_entries WHERE transfer_id = %s", (transfer_id,))
        conn.execute("DELETE FROM dead_letters WHERE transfer_id = %s", (transfer_id,))
        conn.execute("DELETE FROM delivery_attempts WHERE transfer_id = %s", (transfer_id,))
        conn.execute("DELETE FROM outbox WHERE transfer_id = %s", (transfer_id,))
        conn.execute("DELETE FROM transfers WHERE id = %s", (transfer_id,))
        conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, account))
        conn.execute("DELETE FROM idempotency_record WHERE key = %s", (key,))
    return str(account), int(amount)


def lose_outbox_row(dsn: str, transfer_id: uuid.UUID) -> None:
    """The source's outbox row of a transfer (and its delivery history) is gone."""
    with psycopg.connect(dsn) as conn:
        conn.execute("DELETE FROM delivery_attempts WHERE transfer_id = %s", (transfer_id,))
        conn.execute("DELETE FROM outbox WHERE transfer_id = %s", (transfer_id,))


def lose_refund(dsn: str, transfer_id: uuid.UUID) -> int:
    """A refunded dead letter keeps saying refunded, but its refund entry, balance and key record are
    gone. Returns the amount."""
    with psycopg.connect(dsn) as conn:
        account, amount = conn.execute(
            "DELETE FROM ledger_entries WHERE transfer_id = %s AND kind = 'refund' RETURNING account_id, amount_minor",
            (transfer_id,),
        ).fetchone() or (None, 0)
        assert account is not None, f"no refund of {transfer_id} here"
        conn.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, account))
        conn.execute("DELETE FROM idempotency_record WHERE key = %s", (str(refund_key(transfer_id)),))
    return int(amount)


def restart_daemons(cluster: LocalCluster) -> None:
    """Restart every shard daemon, as a restore does: a daemon remembers the outcomes of keys it
    completed recently and would replay one its database has forgotten."""
    for daemon in cluster.shard_daemons:
        daemon.stop()
        daemon.start()


def money_total(cluster: LocalCluster) -> int:
    """The sum of every balance on every shard."""
    return sum(
        int(sql(dsn, "SELECT coalesce(sum(balance), 0) FROM accounts")[0][0])
        for dsn in dsns(cluster).values()
    )


def deposits_total(cluster: LocalCluster) -> int:
    return sum(
        int(
            sql(dsn, "SELECT coalesce(sum(amount_minor), 0) FROM ledger_entries WHERE kind = 'deposit'")[0][0]
        )
        for dsn in dsns(cluster).values()
    )


def credits_of(cluster: LocalCluster, transfer_id: uuid.UUID) -> int:
    """How many credit entries of a transfer all shards hold."""
    return sum(
        int(
            sql(
                dsn,
                "SELECT count(*) FROM ledger_entries WHERE transfer_id = %s AND kind = 'transfer_in'",
                (transfer_id,),
            )[0][0]
        )
        for dsn in dsns(cluster).values()
    )
