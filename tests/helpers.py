"""What many tests share that is not a fixture: metadata with a key, Money, a keyed deposit, the
error details of a failed call, settings of an in-process shard daemon, a PostgreSQL server's data
folder, and the mark of tests that need the tracing UI. A plain module, imported by name; the
fixtures built on it are in `tests/conftest.py`."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardrouter.core.keys import new_key
from shardrouter.core.validation import validate_deposit
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.localcluster.tracing_ui import phoenix_installed
from shardrouter.shardd.authorization_policy import ALLOW_ALL_DOCUMENT
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency import IdempotencyConfig, IdempotencyInterceptor, MutatingMethod, store
from shardrouter.shardd.idempotency.process_keys import CompletedKeys
from shardrouter.shardd.idempotency.record import (
    Claim,
    ClaimStatus,
    IdempotencyRecord,
    RecordState,
    StoredOutcome,
)
from shardrouter.shardd.identity import IdentityPolicy
from shardrouter.shardd.server import prepare_database
from shardrouter.shardd.settings import ShardSettings
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

#: Tests against the real tracing UI need the `tracing-ui` extra; CI sets SHARD_ROUTER_REQUIRE_TRACING_UI
#: so that a missing extra fails there instead of skipping.
requires_tracing_ui = pytest.mark.skipif(
    not phoenix_installed() and not os.environ.get("SHARD_ROUTER_REQUIRE_TRACING_UI"),
    reason="needs the tracing-ui extra (pip install -e '.[dev,tracing-ui]')",
)


def pg_data_dir() -> Path:
    """A fresh folder for a PostgreSQL data directory.

    Not under pytest's tmp_path: pytest resets its root to mode 0700 whenever a session starts, which
    would lock the unprivileged server user out of a data directory in use.
    """
    return Path(tempfile.mkdtemp(prefix="shard-router-pg-")) / "data"


def own_postgres(*, delete_in_background: bool = False) -> Iterator[LocalPostgres]:
    """A fixture's body (`yield from own_postgres()`): a real PostgreSQL server of its own (embedded
    wheel, wal_level=logical) on a loopback port, in a fresh `pg_data_dir`; at teardown it is
    stopped and its data deleted, folder and all.

    `delete_in_background`: the folder is deleted by a detached `rm` the test process does not wait
    for. The session's server holds a database per test (a gigabyte or more by the end): deleting it
    took a test worker 8-10 s at the end of the suite, time nothing waited for but the clock."""
    server = LocalPostgres(pg_data_dir())
    server.start()
    yield server
    server.stop("immediate")
    folder = server.data_dir.parent
    if delete_in_background and shutil.which("rm"):
        # The shell puts `rm` in the background and exits at once, so no child is left to this
        # process (a running Popen object is a ResourceWarning when it is collected).
        subprocess.run(
            ["sh", "-c", 'rm -rf -- "$1" &', "rm-later", str(folder)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            check=False,
        )
        return
    shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def allow_all_policy_file() -> Path:
    """A policy file that allows every call (written once per test session), for daemons in production
    mode whose tests are not about authorization."""
    path = Path(tempfile.mkdtemp(prefix="shardrouter-authz-")) / "allow-all.json"
    path.write_text(ALLOW_ALL_DOCUMENT)
    return path


def make_settings(dsn: str, **overrides: object) -> ShardSettings:
    """Shard settings for an in-process test daemon on a free port (outside dev mode with an allow-all
    authorization policy unless the test gives its own)."""
    values: dict[str, object] = {
        "dsn": dsn,
        "listen": "127.0.0.1:0",
        "metrics_port": 0,
        "dev_mode": True,
        "workers": 32,
        "pool_max": 16,
        # Spare threads beyond the admission limits (16 + 8), as in production.
        "max_in_flight": 16,
        "max_waiting": 8,
        "shutdown_grace_s": 1.0,
        "relay_workers": 0,
    }
    values.update(overrides)
    if not values["dev_mode"] and "authz_policy_file" not in overrides:
        values["authz_policy_file"] = str(allow_all_policy_file())
    return ShardSettings(**values)  # type: ignore[arg-type]


def key_metadata(key: uuid.UUID | str | None = None, caller: str | None = None) -> list[tuple[str, str]]:
    """Metadata with an idempotency key (a new one unless given) and optionally a caller id."""
    md = [("idempotency-key", str(key or new_key()))]
    if caller:
        md.append(("x-caller-id", caller))
    return md


def money(amount: int, currency: str = "EUR") -> transfer_pb2.Money:
    """A Money message."""
    return transfer_pb2.Money(amount_minor=amount, currency=currency)


def deposit(
    stub: transfer_pb2_grpc.TransferServiceStub, account: str, amount: int, currency: str = "EUR"
) -> None:
    """Deposit with a fresh key (test set-up)."""
    stub.Deposit(
        transfer_pb2.DepositRequest(account_id=account, amount=money(amount, currency)),
        metadata=key_metadata(),
    )


def error_info(error: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo, bool]:
    """The ErrorInfo of a failed call (empty if none), and whether it carried RetryInfo."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, f"no rich status in {error}"
    info = error_details_pb2.ErrorInfo()
    retry = False
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        retry = retry or detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    return info, retry


__all__ = [
    "deposit",
    "error_info",
    "key_metadata",
    "make_settings",
    "money",
    "own_postgres",
    "pg_data_dir",
    "requires_tracing_ui",
]


#: The outcome `store_key` stores unless told otherwise.
STORED_OK = StoredOutcome(code=0, message="", details=None, response=b"first", trailers=())


def completed_record(
    *, scope: str, key: str, key_time: datetime, created_at: datetime, outcome: StoredOutcome = STORED_OK
) -> IdempotencyRecord:
    """The completed record a test stores for a claimed key (method "m", request hash b"h")."""
    return IdempotencyRecord(
        scope=scope,
        key=key,
        key_time=key_time,
        method="m",
        request_hash=b"h",
        state=RecordState.COMPLETED,
        outcome=outcome,
        created_at=created_at,
        completed_at=None,
    )


def store_key(
    conn: psycopg.Connection[Any],
    *,
    scope: str,
    key: str,
    key_time: datetime,
    dated_by_key: bool = True,
    outcome: StoredOutcome = STORED_OK,
) -> Claim:
    """Claim a key as a guarded call does (on an autocommit connection) and, if claimed, store its
    completed record and commit, as the call's last round trip does; the claim found."""
    claim = store.claim_key(conn, scope=scope, key=key, key_time=key_time, dated_by_key=dated_by_key)
    if claim.status is ClaimStatus.CLAIMED:
        assert claim.created_at is not None
        record = completed_record(
            scope=scope, key=key, key_time=key_time, created_at=claim.created_at, outcome=outcome
        )
        try:
            store.begin_handler(conn)
            store.complete_key(conn, record=record, account_id=None, keep_handler_writes=True)
        except BaseException:
            store.release_claim(conn, scope=scope, key=key)
            raise
    return claim


@contextmanager
def guarded_deposits(
    database: str,
    servicer: Callable[[Database], transfer_pb2_grpc.TransferServiceServicer],
    *,
    config: IdempotencyConfig,
    completed: CompletedKeys,
) -> Iterator[transfer_pb2_grpc.TransferServiceStub]:
    """A stub of a gRPC server in this process that serves `servicer(pool)` with its Deposit guarded
    by the idempotency interceptor alone (no admission, no tracing), on a migrated `database`."""
    prepare_database(database, config.retention)
    pool = Database(database, min_size=1, max_size=4)
    pool.open()
    interceptor = IdempotencyInterceptor(
        database=pool,
        methods=[MutatingMethod("/shardrouter.v1.TransferService/Deposit", validate_deposit)],
        config=config,
        identity=IdentityPolicy(dev_mode=True),
        completed=completed,
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[interceptor])
    transfer_pb2_grpc.add_TransferServiceServicer_to_server(servicer(pool), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield transfer_pb2_grpc.TransferServiceStub(channel)
    finally:
        server.stop(0)
        pool.close()
