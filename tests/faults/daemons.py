"""Shard daemons as real processes for the failpoint fault tests, and what those tests read back.

`OneShard` is one shard served by several `shardd` processes over one database, behind a router;
`TwoShards` is two shards of one daemon each (the relay's tests). Calls are sent as raw bytes, so a
test compares the bytes a caller got with the bytes the key's record stored; `Ledger`-like reads
(entries under a key, balances, the key's record) go straight to the database.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psycopg
import yaml
from google.rpc import error_details_pb2, status_pb2

from shardrouter.core.keys import KEY_METADATA
from shardrouter.core.shardmap import ShardMap, even_shard_map, shard_map_document
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.v1 import transfer_pb2
from tests.processes import ServiceProcess, router_process, shardd_process

TRANSFER = "/shardrouter.v1.TransferService/Transfer"
DEPOSIT = "/shardrouter.v1.TransferService/Deposit"
#: The trailer pair of a replayed answer, as a caller sees it on the wire.
REPLAYED = ("idempotency-replayed", "true")
#: The metadata entry naming the caller (believed in dev mode), as the relay sends it.
CALLER = "x-caller-id"
#: Daemons that log little: a failing test prints their logs.
QUIET = {"SHARDD_LOG_LEVEL": "WARNING"}


@dataclass(frozen=True)
class Answer:
    """What a caller got: OK with the response's bytes, or the failure, and the trailers."""

    code: grpc.StatusCode
    response: bytes | None
    trailers: tuple[tuple[str, str | bytes], ...]
    details: str = ""

    @property
    def replayed(self) -> bool:
        """Whether the answer is a completed key's stored outcome."""
        return REPLAYED in self.trailers

    @property
    def reason(self) -> str:
        """The ErrorInfo reason of a failure ("" if none)."""
        for name, value in self.trailers:
            if name == "grpc-status-details-bin" and isinstance(value, bytes):
                for detail in status_pb2.Status.FromString(value).details:
                    if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                        info = error_details_pb2.ErrorInfo()
                        detail.Unpack(info)
                        return str(info.reason)
        return ""


def call(
    address: str,
    method: str,
    request: bytes,
    key: str,
    timeout_s: float = 20.0,
    caller: str | None = None,
    wait_ms: int | str | None = None,
) -> Answer:
    """One call of `method` with raw request bytes and an idempotency key (and, in dev mode, a caller
    id; with `wait_ms`, `idempotency-wait-ms` sent as given); its answer, never raised."""
    metadata = (
        ((KEY_METADATA, key),)
        + (((CALLER, caller),) if caller else ())
        + (((WAIT_METADATA, str(wait_ms)),) if wait_ms is not None else ())
    )
    with grpc.insecure_channel(address) as channel:
        rpc = channel.unary_unary(method, None, None)
        try:
            response, done = rpc.with_call(request, metadata=metadata, timeout=timeout_s)
        except grpc.RpcError as err:
            failed: grpc.Call = err  # type: ignore[assignment]  # a failed call is both
            return Answer(
                failed.code(), None, tuple(failed.trailing_metadata() or ()), failed.details() or ""
            )
        return Answer(grpc.StatusCode.OK, bytes(response), tuple(done.trailing_metadata() or ()))


def call_in_background(address: str, method: str, request: bytes, key: str) -> Future[Answer]:
    """`call` in a thread of its own (it may be paused at a failpoint): its answer, later."""
    future: Future[Answer] = Future()

    def run() -> None:
        try:
            future.set_result(call(address, method, request, key, timeout_s=60.0))
        except BaseException as exc:  # handed to the test that waits for the answer
            future.set_exception(exc)

    threading.Thread(target=run, name="call-in-flight", daemon=True).start()
    return future


def transfer_request(src: str, dst: str, amount: int) -> bytes:
    """A TransferRequest's bytes."""
    return transfer_pb2.TransferRequest(
        source_account_id=src,
        destination_account_id=dst,
        amount=transfer_pb2.Money(amount_minor=amount, currency="EUR"),
    ).SerializeToString()


def deposit_request(account: str, amount: int) -> bytes:
    """A DepositRequest's bytes."""
    return transfer_pb2.DepositRequest(
        account_id=account, amount=transfer_pb2.Money(amount_minor=amount, currency="EUR")
    ).SerializeToString()


def query(dsn: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Rows of one statement, on a connection of its own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def balances(dsn: str, *accounts: str) -> list[int]:
    """The balances of `accounts`, in order."""
    found = dict(query(dsn, "SELECT id, balance FROM accounts WHERE id = ANY(%s)", list(accounts)))
    return [int(found[a]) for a in accounts]


def entries(dsn: str, key: str) -> list[tuple[str, str, int]]:
    """(kind, account, amount) of every ledger entry written under an idempotency key."""
    rows = query(
        dsn,
        "SELECT kind, account_id, amount_minor FROM ledger_entries WHERE idempotency_key::text = %s"
        " ORDER BY kind",
        key,
    )
    return [(str(k), str(a), int(m)) for k, a, m in rows]


def stored_response(dsn: str, key: str) -> bytes | None:
    """The response bytes the key's completed record stored (None: no record)."""
    rows = query(dsn, "SELECT response FROM idempotency_record WHERE key = %s", key)
    assert len(rows) <= 1, f"{len(rows)} records of {key}"
    return bytes(rows[0][0]) if rows else None


def claim_holders(dsn: str) -> list[int]:
    """Backends holding an advisory lock (a claimed key) now."""
    return [int(r[0]) for r in query(dsn, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted")]


@dataclass
class OneShard:
    """One shard served by `daemons` over one database, and a router in front of them all."""

    dsn: str
    daemons: list[ServiceProcess]
    router: ServiceProcess
    map_path: Path

    @classmethod
    def build(
        cls,
        postgres: LocalPostgres,
        tmp_path: Path,
        count: int = 2,
        extra_env: Mapping[str, str] | None = None,
        router_env: Mapping[str, str] | None = None,
    ) -> OneShard:
        """The processes, not started (arm a daemon first if the test needs to); `extra_env` for the
        daemons, `router_env` for the router."""
        name = f"fp_{uuid.uuid4().hex[:10]}"
        postgres.create_database(name)
        dsn = postgres.dsn_for(name)
        map_path = tmp_path / "shard-map.json"
        env = {**QUIET, "SHARDD_RELAY_WORKERS": "0", "SHARDD_SHARD_MAP": str(map_path), **(extra_env or {})}
        daemons = [shardd_process(tmp_path, shard_id="shard-0", dsn=dsn, extra_env=env) for _ in range(count)]
        for i, daemon in enumerate(daemons):
            daemon.name, daemon.log_path = f"shard-0-{i}", tmp_path / f"shard-0-{i}.log"
        addresses = [d.address for d in daemons]
        map_path.write_text(
            json.dumps(
                {
                    "version": 1,
                    "shards": [{"id": "shard-0", "addresses": addresses, "slot_ranges": [[0, 16383]]}],
                }
            )
        )
        router = router_process(tmp_path, shard_map=map_path, extra_env=dict(router_env or {}))
        return cls(dsn, daemons, router, map_path)

    def start(self) -> None:
        """Every daemon, then the router."""
        for daemon in self.daemons:
            daemon.start()
        self.router.start()

    def stop(self) -> None:
        """Kill everything still running."""
        self.router.kill()
        for daemon in self.daemons:
            daemon.kill()

    def logs(self) -> str:
        """The tail of every process's log, for a failure message."""
        return "\n".join(f"--- {p.name}\n{p.log_text()[-2000:]}" for p in [*self.daemons, self.router])


@dataclass
class TwoShards:
    """Two shards of one daemon each, each over its own database, the relay on (one worker)."""

    shard_map: ShardMap
    dsns: dict[str, str]
    daemons: dict[str, ServiceProcess]
    accounts: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def build(cls, postgres: LocalPostgres, tmp_path: Path) -> TwoShards:
        """The processes, not started."""
        ports = {"shard-0": free_port(), "shard-1": free_port()}
        shard_map = even_shard_map({sid: f"127.0.0.1:{p}" for sid, p in ports.items()})
        map_path = tmp_path / "shard-map.yaml"
        map_path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
        dsns, daemons = {}, {}
        for sid, port in ports.items():
            name = f"fp_{sid.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
            postgres.create_database(name)
            dsns[sid] = postgres.dsn_for(name)
            daemons[sid] = shardd_process(
                tmp_path,
                shard_id=sid,
                dsn=dsns[sid],
                shard_map=map_path,
                port=port,
                extra_env={**QUIET, "SHARDD_RELAY_WORKERS": "1"},
            )
        return cls(shard_map, dsns, daemons)

    def account_on(self, shard_id: str) -> str:
        """A new account name the map puts on `shard_id`."""
        taken = self.accounts.setdefault(shard_id, [])
        i = len(taken)
        while True:
            name = f"acct-{shard_id}-{i}"
            if self.shard_map.shard_for(name).id == shard_id:
                taken.append(name)
                return name
            i += 1

    def dsn_of(self, account: str) -> str:
        """The database of the shard that owns `account`."""
        return self.dsns[self.shard_map.shard_for(account).id]

    def address_of(self, account: str) -> str:
        """The daemon of the shard that owns `account`."""
        return self.daemons[self.shard_map.shard_for(account).id].address

    def deposit(self, account: str, amount: int) -> None:
        """Open (or top up) an account with a fresh key."""
        answer = call(self.address_of(account), DEPOSIT, deposit_request(account, amount), str(uuid.uuid4()))
        assert answer.code is grpc.StatusCode.OK, answer

    def stop(self) -> None:
        """Kill both daemons."""
        for daemon in self.daemons.values():
            daemon.kill()

    def logs(self) -> str:
        """The tail of each daemon's log, for a failure message."""
        return "\n".join(f"--- {d.name}\n{d.log_text()[-2000:]}" for d in self.daemons.values())


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float = 15.0, logs: Callable[[], str] = str
) -> None:
    """Poll `check` until true, or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}\n{logs()}"
        time.sleep(0.05)
