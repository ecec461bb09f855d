"""Shared fixtures and hooks: one real PostgreSQL per test session, a fresh database per test (a copy
of a template migrated once per session), shard daemons, and the test tiers. The plain helpers they
use, and tests import by name, are in `tests/helpers.py`."""

from __future__ import annotations

import os

# grpc's C core prints INFO lines ("Got goaway [2] ... Cancelling all calls", when a
# server stops under a channel) straight to file descriptor 2, so one written between pytest's
# captured phases lands among the progress dots. It reads GRPC_VERBOSITY when it initialises: set
# before anything imports grpc. Processes the tests start inherit it; errors are still printed.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# Every PostgreSQL server the tests start (here or in a process they start) runs without fsync:
# a killed process loses nothing that way, and no test cuts the power (see localcluster/postgres.py).
os.environ.setdefault("SHARD_ROUTER_PG_FSYNC", "off")

import fcntl
import functools
import itertools
import re
import tempfile
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import psycopg
import pytest
from psycopg import sql

from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.server import ShardDaemon, prepare_database, start_shard
from shardrouter.v1 import transfer_pb2_grpc
from tests.helpers import make_settings, own_postgres
from tests.processes import ServiceProcess

#: Test runs one machine holds at once, each in its own part of the ports (`_run_slot`). A worker
#: of a full run hands out up to about 1,000 ports; each gets 2,500 this way.
_RUN_SLOTS = 3
#: The run's slot, which the controlling process takes and its xdist workers inherit.
_RUN_SLOT_ENV = "SHARD_ROUTER_TEST_RUN_SLOT"
#: The descriptor of the lock file of the slot this process holds (open for the whole run).
_held_slot: list[int] = []


def _run_slot() -> int:
    """This run's slot: the first of `_RUN_SLOTS` that no other run on this machine holds (a lock
    file held until this process exits), so two suites at once (a clone's CI beside the working
    copy's) draw their ports from different parts. All taken: the first, shared."""
    inherited = os.environ.get(_RUN_SLOT_ENV)
    if inherited is not None:
        return int(inherited)
    for slot in range(_RUN_SLOTS):
        lock = os.open(
            Path(tempfile.gettempdir()) / f"shard-router-tests-ports-{slot}.lock", os.O_CREAT | os.O_RDWR
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue
        _held_slot.append(lock)
        os.environ[_RUN_SLOT_ENV] = str(slot)  # before xdist starts the workers, which inherit it
        return slot
    os.environ[_RUN_SLOT_ENV] = "0"
    return 0


def _worker_port_range() -> str | None:
    """Under pytest-xdist, this worker's share of its run's part of the ports below the kernel's
    ephemeral range, so that no two workers (nor the processes they start), of this run or of
    another on the machine, hand out the same port."""
    slot = _run_slot()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count:
        return None
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_low = int(ranges.read().split()[0])
    run_span = (min(ephemeral_low, 32768) - 10_000) // _RUN_SLOTS
    span = run_span // int(count)
    low = 10_000 + slot * run_span + int(worker.removeprefix("gw")) * span
    return f"{low}-{low + span - 1}"


if (_ports := _worker_port_range()) is not None:
    os.environ["SHARD_ROUTER_PORT_RANGE"] = _ports

_counter = itertools.count()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run long soak / chaos variants")


#: Folders whose tests start processes of their own (daemons, routers, clusters, kubectl, promtool,
#: the bench, another release's daemons) or servers beyond the session's PostgreSQL.
_PROCESS_FOLDERS = frozenset(
    {"bench", "deploy", "e2e", "faults", "localcluster", "reconcile", "reshard", "upgrade"}
)
#: Words in a test module's source that mean it starts processes or servers of its own.
_PROCESS_WORDS = re.compile(
    r"\b(subprocess|tests\.processes|run_shardd|ServiceProcess|LocalCluster|own_postgres|sys\.executable|Popen)\b"
)


@functools.cache
def _starts_processes(path: Path) -> bool:
    relative = path.relative_to(Path(__file__).parent)
    if relative.parts[0] in _PROCESS_FOLDERS or path.name == "test_readme.py":
        return True
    return _PROCESS_WORDS.search(path.read_text()) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Derive the tiers from what a test needs: `fast` unless its module starts processes (by its
    folder or its source) or the test is a slow variant. `pytest -m fast` is the inner loop."""
    run_slow = config.getoption("--run-slow")
    skip = pytest.mark.skip(reason="long variant: run with --run-slow")
    for item in items:
        slow = "slow" in item.keywords
        if slow and not run_slow:
            item.add_marker(skip)
        if not slow and not _starts_processes(item.path):
            item.add_marker(pytest.mark.fast)
    # Modules that start processes first, the quick in-process ones after them: test workers take
    # modules in this order, so the many short modules fill in at the end while the long ones run,
    # instead of a long module starting last on one worker while the other has finished. A stable
    # sort: each module's tests keep their order, next to each other.
    items.sort(key=lambda item: not _starts_processes(item.path))


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    """A real PostgreSQL server (embedded wheel) on a loopback port, for the whole session."""
    yield from own_postgres(delete_in_background=True)


#: The session server's database that every `database` is copied from: migrated, partitions made.
TEMPLATE_DATABASE = "shard_template"


@pytest.fixture(scope="session")
def migrated_template(postgres: LocalPostgres) -> str:
    """Name of a database migrated once per session (schema and partitions, as a daemon's start-up
    leaves them), for `database` to copy: a copy costs one statement, a migration sixteen."""
    postgres.create_database(TEMPLATE_DATABASE)
    prepare_database(postgres.dsn_for(TEMPLATE_DATABASE), timedelta(days=30))
    return TEMPLATE_DATABASE


@pytest.fixture
def database(postgres: LocalPostgres, migrated_template: str) -> str:
    """DSN of a fresh database on the session server, already migrated (a copy of the template):
    what a shard daemon's start-up would make of an empty one."""
    name = f"t{next(_counter)}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(migrated_template)
            )
        )
    return postgres.dsn_for(name)


@pytest.fixture
def empty_database(postgres: LocalPostgres) -> str:
    """DSN of a fresh, empty database on the session server (no schema: for migration tests)."""
    name = f"e{next(_counter)}_{uuid.uuid4().hex[:8]}"
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
