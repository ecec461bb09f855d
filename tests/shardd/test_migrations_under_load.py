"""Each migration applied under load: the longest time any statement of the load waited, per migration.

A database at version k-1, writers on the hot tables (accounts, ledger_entries, idempotency_record)
running a Deposit's statements (the account's row, its balance, its ledger entry, its key's record,
and a replay's read of a record), then migration k applied through the daemon's own runner
(`apply_migrations`, its bounded and retried lock waits included). What is recorded per migration:
the longest transaction of the load that overlapped it (the stall, against the load's own longest
before it; under the bound, `STALL_BOUND_S`, for every migration but the two released before the rule
that rewrite hot tables), whether the load saw any error (an older release's statements failing is a contract step,
not an expand step), and which hot tables it rewrote (their relfilenode changed: a count that does not
depend on the machine's load), checked against what `COMPATIBILITY` declares.

The load is SQL written here, not the shard's store functions: those of this release need schema 16,
and the load must run against every version from 2 on. Its statements are a Deposit's, on the same
tables and rows, so they take the same locks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from shardrouter.shardd import migrations, partitions

#: The longest a load statement may wait while a migration is applied (s).
STALL_BOUND_S = 1.0
#: The hot tables a rewrite is looked for on.
HOT_TABLES = ("accounts", "ledger_entries", "idempotency_record")
#: Rows put in before the load, so a rewrite has something to copy (and shows in the stall).
PRELOADED_ROWS = 20_000


@pytest.fixture
def database(empty_database: str) -> str:
    """An empty database: the test migrates it one version at a time."""
    return empty_database


@dataclass
class Writer:
    """One load thread: a Deposit's statements in a transaction, again and again, timed."""

    dsn: str
    index: int
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each transaction
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            n = 0
            while not self.stop.is_set():
                n += 1
                account, key = f"load-{self.index}-{n % 40}", str(uuid.uuid4())
                started = time.monotonic()
                try:
                    self._deposit(conn, account, key)
                except psycopg.Error as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}".strip())
                    time.sleep(0.01)
                self.spans.append((started, time.monotonic()))

    @staticmethod
    def _deposit(conn: psycopg.Connection, account: str, key: str) -> None:
        with conn.transaction():
            conn.execute(
                "INSERT INTO accounts (id, currency) VALUES (%s, 'EUR') ON CONFLICT (id) DO NOTHING",
                (account,),
            )
            conn.execute("UPDATE accounts SET balance = balance + 1 WHERE id = %s", (account,))
            conn.execute(
                "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, idempotency_key)"
                " VALUES (gen_random_uuid(), %s, 1, 'deposit', %s)",
                (account, key),
            )
            conn.execute(
                "INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state,"
                " status_code, response, completed_at)"
                " VALUES ('Deposit|load', %s, now(), 'Deposit', '\\x00', 'completed', 0, '\\x00', now())",
                (key,),
            )
        # A replay's read of its record.
        conn.execute(
            "SELECT response FROM idempotency_record WHERE scope = 'Deposit|load' AND key = %s", (key,)
        ).fetchone()


@dataclass(frozen=True)
class Figures:
    """What one migration did to the load."""

    version: int
    applied_s: float
    stall_s: float  # the longest load transaction overlapping the migration
    before_s: float  # the longest load transaction in the moment before it
    transactions: int
    errors: list[str]
    rewrote: list[str]


def _apply_up_to(dsn: str, version: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """Apply the migrations up to `version` through the daemon's runner; the seconds it took."""
    monkeypatch.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:version])
    try:
        started = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrations.apply_migrations(conn, lock_timeout_s=30)
        return time.monotonic() - started
    finally:
        monkeypatch.undo()


def _relfilenodes(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname, c.relfilenode FROM pg_class c WHERE c.relname = ANY(%s)"
            " UNION ALL SELECT parent.relname, c.relfilenode FROM pg_inherits i"
            " JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class parent ON parent.oid = i.inhparent"
            " WHERE parent.relname = ANY(%s)",
            (list(HOT_TABLES), list(HOT_TABLES)),
        ).fetchall()
    nodes: dict[str, int] = {}
    for name, node in rows:
        nodes[name] = nodes.get(name, 0) ^ int(node)  # a partitioned table: its partitions' files
    return nodes


def _preload(dsn: str) -> None:
    """Rows for a rewrite to copy, and the partitions the load's records need."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        partitions.ensure_partitions(
            conn, now=datetime.now(UTC), retention=timedelta(days=30), months_ahead=1
        )
        conn.execute(
            "INSERT INTO accounts (id, currency, balance) SELECT 'pre-' || n, 'EUR', 1"
            " FROM generate_series(1, 1000) n"
        )
        conn.execute(
            "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, idempotency_key)"
            " SELECT gen_random_uuid(), 'pre-' || (n %% 1000 + 1), 1, 'deposit', gen_random_uuid()"
            " FROM generate_series(1, %s) n",
            (PRELOADED_ROWS,),
        )
        conn.execute(
            "INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state, status_code,"
            " response, completed_at) SELECT 'Deposit|pre', gen_random_uuid(), now(), 'Deposit', '\\x00',"
            " 'completed', 0, '\\x00', now() FROM generate_series(1, %s)",
            (PRELOADED_ROWS,),
        )
        conn.execute("ANALYZE")


def _under_load(dsn: str, version: int, monkeypatch: pytest.MonkeyPatch) -> Figures:
    writers = [Writer(dsn, index) for index in range(3)]
    threads = [threading.Thread(target=w.run, name=f"load-{w.index}", daemon=True) for w in writers]
    nodes = _relfilenodes(dsn)
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.4)  # the load's own figures before the migration
        started = time.monotonic()
        applied_s = _apply_up_to(dsn, version, monkeypatch)
        ended = time.monotonic()
        time.sleep(0.15)
    finally:
        for writer in writers:
            writer.stop.set()
        for thread in threads:
            thread.join(30)
    spans = [span for writer in writers for span in writer.spans]
    during = [end - start for start, end in spans if start <= ended and end >= started]
    before = [end - start for start, end in spans if end < started]
    after = _relfilenodes(dsn)
    return Figures(
        version,
        applied_s,
        max(during, default=0.0),
        max(before, default=0.0),
        len(spans),
        [error for writer in writers for error in writer.errors],
        sorted(table for table in HOT_TABLES if nodes.get(table) != after.get(table)),
    )


def test_each_migration_under_load_stalls_no_statement_beyond_the_bound(database, monkeypatch, capsys):
    _apply_up_to(database, 2, monkeypatch)  # the hot tables exist from migration 2 on
    _preload(database)
    figures = [
        _under_load(database, version, monkeypatch) for version in range(3, migrations.LATEST_VERSION + 1)
    ]
    with capsys.disabled():
        print("\nmigration  step      applied_s  longest_stall_s  before_s  load_tx  errors  rewrote")
        for f in figures:
            step = migrations.COMPATIBILITY[f.version].step.value
            print(
                f"{f.version:>9}  {step:<8}  {f.applied_s:9.3f}  {f.stall_s:15.3f}  {f.before_s:8.3f}"
                f"  {f.transactions:7d}  {len(f.errors):6d}  {','.join(f.rewrote) or '-'}"
            )
            for error in sorted({e.split(chr(10))[0][:110] for e in f.errors}):
                print(f"           load error: {error}")
    for f in figures:
        declared = migrations.COMPATIBILITY[f.version]
        # Migrations 6 and 10, released before the rule, rewrite hot tables under their exclusive
        # lock: their stall grows with the tables (here with PRELOADED_ROWS), and no bound holds.
        if not declared.rewrites_hot_tables:
            assert f.stall_s < STALL_BOUND_S, f
        # The load's statements are an older release's: an expand step leaves them working.
        if declared.step is migrations.Step.EXPAND:
            assert f.errors == [], f
        assert bool(f.rewrote) == declared.rewrites_hot_tables, f
        assert f.transactions > 20, f  # the load ran


#: An index added the way the rule says: built concurrently, outside the migration's transaction.
PLANTED_INDEX = (
    migrations.LATEST_VERSION + 1,
    "planted: an index on the ledger entries' reference, built concurrently",
    """
    -- Writers keep writing while it is built.
    CREATE INDEX CONCURRENTLY IF NOT EXISTS ledger_entries_reference ON ledger_entries (reference);
    """,
)


def test_an_index_built_concurrently_under_load_stalls_nothing_and_survives_a_failed_build(
    database, monkeypatch, capsys, caplog
):
    """A transaction holding an old snapshot makes the build wait: each attempt gives up after its lock
    timeout and leaves an INVALID index, which the next attempt drops; once the snapshot is gone the
    index is built, and no load statement waited on any of it."""
    with psycopg.connect(database, autocommit=True) as conn:
        migrations.apply_migrations(conn)
    _preload(database)
    monkeypatch.setattr(migrations, "MIGRATIONS", (*migrations.MIGRATIONS, PLANTED_INDEX))
    monkeypatch.setitem(
        migrations.COMPATIBILITY,
        PLANTED_INDEX[0],
        migrations.Compatibility(migrations.Step.EXPAND, "an index", outside_transaction=True),
    )
    blocker = psycopg.connect(database)
    blocker.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    blocker.execute("SELECT count(*) FROM accounts").fetchone()  # a snapshot the build must outwait
    threading.Timer(1.5, blocker.close).start()
    with caplog.at_level(logging.INFO, logger=migrations.__name__):
        figures = _under_load(database, PLANTED_INDEX[0], monkeypatch)
    with capsys.disabled():
        print(f"\nconcurrent index: {figures}")
    # It waited out the snapshot, attempt after attempt, each leaving an index the next one dropped.
    assert "dropped index ledger_entries_reference, left INVALID by a failed build" in caplog.text
    assert figures.stall_s < STALL_BOUND_S and figures.errors == [] and figures.rewrote == [], figures
    with psycopg.connect(database) as conn:
        indexes = conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname LIKE 'ledger_entries_reference%'"
        ).fetchall()
        assert indexes == [("ledger_entries_reference", True)]
        assert migrations.schema_version(conn) == PLANTED_INDEX[0]
