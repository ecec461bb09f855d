"""Shared fixtures: one real PostgreSQL per test session, a fresh database per test, shard daemons."""

from __future__ import annotations

import os

# grpc's C core prints INFO lines ("Got goaway [2] ... Cancelling all calls", when a
# server stops under a channel) straight to file descriptor 2, so one written between pytest's
# captured phases lands among the progress dots. It reads GRPC_VERBOSITY when it initialises: set
# before anything imports grpc. Processes the tests start inherit it; errors are still printed.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import itertools
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardrouter.core.keys import new_key
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.localcluster.tracing_ui import phoenix_installed
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.shardd.settings import ShardSettings
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.processes import ServiceProcess, shardd_process

_counter = itertools.count()


#: Tests against the real tracing UI need the `tracing-ui` extra; CI sets SHARD_ROUTER_REQUIRE_TRACING_UI
#: so that a missing extra fails there instead of skipping.
requires_tracing_ui = pytest.mark.skipif(
    not phoenix_installed() and not os.environ.get("SHARD_ROUTER_REQUIRE_TRACING_UI"),
    reason="needs the tracing-ui extra (pip install -e '.[dev,tracing-ui]')",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run long soak / chaos variants")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long variant: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pg_data_dir() -> Path:
    """A fresh folder for a PostgreSQL data directory.

    Not under pytest's tmp_path: pytest resets its root to mode 0700 whenever a session starts, which
    would lock the unprivileged server user out of a data directory in use.
    """
    return Path(tempfile.mkdtemp(prefix="shard-router-pg-")) / "data"


def own_postgres() -> Iterator[LocalPostgres]:
    """A fixture's body (`yield from own_postgres()`): a real PostgreSQL server of its own (embedded
    wheel, wal_level=logical) on a loopback port, in a fresh `pg_data_dir`; at teardown it is
    stopped and its data deleted, folder and all."""
    server = LocalPostgres(pg_data_dir())
    server.start()
    yield server
    server.destroy()
    shutil.rmtree(server.data_dir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    """A real PostgreSQL server (embedded wheel) on a loopback port, for the whole session."""
    yield from own_postgres()


@pytest.fixture
def database(postgres: LocalPostgres) -> str:
    """DSN of a fresh, empty database on the session server."""
    name = f"t{next(_counter)}_{uuid.uuid4().hex[:8]}"
    postgres.create_database(name)
    return postgres.dsn_for(name)


def make_settings(dsn: str, **overrides: object) -> ShardSettings:
    """Shard settings for an in-process test daemon on a free port."""
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
    return ShardSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def shard(database: str) -> Iterator[ShardDaemon]:
    """A shard daemon served in this process (real gRPC server on loopback, real PostgreSQL)."""
    daemon = start_shard(make_settings(database))
    yield daemon
    daemon.stop(0.5)


@pytest.fixture(params=[True, False], ids=["pipelined", "unpipelined"])
def shard_in_each_pipeline_mode(database: str, request: pytest.FixtureRequest) -> Iterator[ShardDaemon]:
    """The `shard` fixture twice: guarded calls in psycopg's pipeline mode, and one statement per
    round trip (`SHARDD_DB_PIPELINE=false`). Modules whose claims must hold in both override `shard`."""
    daemon = start_shard(make_settings(database, db_pipeline=request.param))
    yield daemon
    daemon.stop(0.5)


@pytest.fixture
def stub(shard: ShardDaemon) -> Iterator[transfer_pb2_grpc.TransferServiceStub]:
    """A TransferService client of the `shard` fixture."""
    with grpc.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        yield transfer_pb2_grpc.TransferServiceStub(channel)


@pytest.fixture
def db(database: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to the test database, for assertions."""
    with psycopg.connect(database, autocommit=True) as conn:
        yield conn


@pytest.fixture
def shard_processes(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    """A list that end-to-end tests append started processes to; all are stopped afterwards."""
    started: list[ServiceProcess] = []
    yield started
    for process in started:
        process.kill()


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


__all__ = ["ServiceProcess", "deposit", "key_metadata", "make_settings", "money", "shardd_process"]


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
