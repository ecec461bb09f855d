"""Shared fixtures and hooks: one real PostgreSQL per test session, a fresh database per test, shard
daemons. The plain helpers they use, and tests import by name, are in `tests/helpers.py`."""

from __future__ import annotations

import os

# grpc's C core prints INFO lines ("Got goaway [2] ... Cancelling all calls", when a
# server stops under a channel) straight to file descriptor 2, so one written between pytest's
# captured phases lands among the progress dots. It reads GRPC_VERBOSITY when it initialises: set
# before anything imports grpc. Processes the tests start inherit it; errors are still printed.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2_grpc
from tests.helpers import make_settings, own_postgres
from tests.processes import ServiceProcess

_counter = itertools.count()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run long soak / chaos variants")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long variant: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
