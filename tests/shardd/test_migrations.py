"""Schema migrations: bounded lock waits, and no daemon started on a schema newer than it knows."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import psycopg
import pytest

from shardrouter.shardd import migrations
from shardrouter.shardd.migrations import MigrationLockTimeout, SchemaNewerThanCode
from shardrouter.shardd.server import prepare_database
from tests.processes import run_shardd


@pytest.fixture
def database(empty_database: str) -> str:
    """These tests migrate themselves: an empty database, not a copy of the migrated template."""
    return empty_database


def test_migrating_twice_applies_nothing_the_second_time(database):
    with psycopg.connect(database, autocommit=True) as conn:
        first = migrations.apply_migrations(conn)
        assert first == [version for version, _, _ in migrations.MIGRATIONS]
        assert migrations.apply_migrations(conn) == []
        assert migrations.schema_version(conn) == migrations.LATEST_VERSION


def _record_newer_version(database: str, served_from: int | None) -> int:
    """What a newer release's migration leaves in `schema_version` (without its SQL: this code would
    not read what it made anyway)."""
    newer = migrations.LATEST_VERSION + 1
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schema_version (version, description, serves_code_from)"
            " VALUES (%s, 'from the future', %s)",
            (newer, served_from),
        )
    return newer


@pytest.mark.parametrize("served_from", [migrations.LATEST_VERSION + 1, None], ids=["contract", "unrecorded"])
def test_a_newer_schema_past_a_contract_step_is_refused_by_serve_and_migrate(database, served_from):
    prepare_database(database, timedelta(days=30))
    newer = _record_newer_version(database, served_from)
    with psycopg.connect(database, autocommit=True) as conn:
        with pytest.raises(SchemaNewerThanCode, match=f"version {newer}, newer than this release's"):
            migrations.apply_migrations(conn)
    for command in ("migrate", "serve"):
        result = run_shardd(
            command, "--dsn", database, "--dev-mode", "true", "--listen", "127.0.0.1:0", "--metrics-port", "0"
        )
        assert result.returncode == 2, (command, result.stderr)
        # One line naming both versions and what to do.
        assert f"schema is at version {newer}, newer than this release's {migrations.LATEST_VERSION}" in (
            result.stderr
        )
        assert (
            f"serves schema versions {migrations.OLDEST_SCHEMA_SERVED} to {migrations.LATEST_VERSION}"
            in result.stderr
        )
        assert "Run the release that migrated it" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_newer_schema_of_expand_steps_only_is_served(database):
    """A newer release migrated, and every step past this release's is an expand step: this release's
    daemon starts and serves (what a rolling update needs when an old pod restarts mid-way)."""
    prepare_database(database, timedelta(days=30))
    newer = _record_newer_version(database, migrations.serves_code_from(migrations.LATEST_VERSION))
    with psycopg.connect(database, autocommit=True) as conn:
        assert migrations.apply_migrations(conn) == []
        assert migrations.schema_version(conn) == newer
    result = run_shardd("migrate", "--dsn", database)
    assert result.returncode == 0, result.stderr
    assert "schema up to date" in result.stdout


def test_a_database_migrated_before_the_compatibility_record_gets_it_filled_in(database):
    """Releases before the record wrote no `serves_code_from`: the versions this code knows get it."""
    prepare_database(database, timedelta(days=30))
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE schema_version DROP COLUMN serves_code_from")
        conn.execute("DELETE FROM schema_version WHERE version = %s", (migrations.LATEST_VERSION,))
        assert migrations.apply_migrations(conn) == [migrations.LATEST_VERSION]
        rows = conn.execute(
            "SELECT version, serves_code_from FROM schema_version ORDER BY version"
        ).fetchall()
    assert rows == [
        (version, migrations.serves_code_from(version)) for version, _, _ in migrations.MIGRATIONS
    ]
    assert rows[-1] == (migrations.LATEST_VERSION, migrations.OLDEST_SCHEMA_SERVED)


#: What an expand step may not do: drop, rename or retype what an older release reads, or change a
#: function's signature (a function is replaced with the same one, or added beside it).
_CONTRACTING = re.compile(
    r"\bDROP\s+(COLUMN|TABLE|FUNCTION|INDEX|TRIGGER|CONSTRAINT|VIEW|TYPE)\b|\bRENAME\b|"
    r"\bALTER\s+COLUMN\s+\w+\s+(SET\s+DATA\s+)?TYPE\b|\bDROP\s+DEFAULT\b",
    re.IGNORECASE,
)


def contracting_statements(sql: str) -> list[str]:
    """The statements of `sql` that only a contract step may hold (comments left out)."""
    code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    return [match.group(0) for match in _CONTRACTING.finditer(code)]


def misdeclared(all_migrations=None, compatibility=None) -> dict[int, list[str]]:
    """Expand steps whose SQL holds a contracting statement, by number."""
    found = {}
    for version, _, sql in all_migrations or migrations.MIGRATIONS:
        declared = (compatibility or migrations.COMPATIBILITY)[version]
        if declared.step is migrations.Step.EXPAND and (statements := contracting_statements(sql)):
            found[version] = statements
    return found


def test_every_expand_step_drops_renames_and_retypes_nothing():
    assert misdeclared() == {}
    # The contract steps say so: migration 10 retypes the key columns.
    assert contracting_statements(migrations.MIGRATIONS[9][2])
    assert migrations.COMPATIBILITY[10].step is migrations.Step.CONTRACT


def test_a_planted_expand_step_that_drops_a_column_is_caught():
    planted = (*migrations.MIGRATIONS, (18, "drop what older releases read", PLANTED_DROP))
    compatibility = {
        **migrations.COMPATIBILITY,
        18: migrations.Compatibility(migrations.Step.EXPAND, "wrong"),
    }
    assert misdeclared(planted, compatibility) == {18: ["DROP COLUMN"]}


#: A contract step declared as an expand step: the column every release's Deposit writes.
PLANTED_DROP = "ALTER TABLE ledger_entries DROP COLUMN reference;"


def test_the_compatibility_record_follows_the_contract_steps():
    assert migrations.serves_code_from(9) == 1
    assert migrations.serves_code_from(10) == 10
    assert migrations.serves_code_from(migrations.LATEST_VERSION) == migrations.OLDEST_SCHEMA_SERVED


def test_a_migration_behind_a_held_lock_gives_up_after_the_lock_timeout(database):
    """Another session holds the migrations' lock (a stuck migration): the next one waits at most its
    lock timeout, applies nothing, and a later start applies it."""
    prepare_database(database, timedelta(days=30))
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DELETE FROM schema_version WHERE version = %s", (migrations.LATEST_VERSION,))
        blocker = psycopg.connect(database, autocommit=True)
        try:
            blocker.execute("SELECT pg_advisory_lock(%s)", (migrations._MIGRATION_LOCK,))
            started = time.monotonic()
            with pytest.raises(MigrationLockTimeout, match=r"waited 0\.3 s for a lock and gave up"):
                migrations.apply_migrations(conn, lock_timeout_s=0.3)
            waited = time.monotonic() - started
            assert 0.25 <= waited < 5, waited
        finally:
            blocker.close()
        assert migrations.schema_version(conn) == migrations.LATEST_VERSION - 1  # nothing applied
        assert migrations.apply_migrations(conn) == [migrations.LATEST_VERSION]  # the retry applies it


def test_migrate_command_reports_a_lock_timeout_in_one_line(database):
    prepare_database(database, timedelta(days=30))
    blocker = psycopg.connect(database, autocommit=True)
    try:
        blocker.execute("SELECT pg_advisory_lock(%s)", (migrations._MIGRATION_LOCK,))
        result = run_shardd("migrate", "--dsn", database, "--migration-lock-timeout-s", "0.2")
    finally:
        blocker.close()
    assert result.returncode == 1, result.stderr
    assert "shardd: cannot migrate: a schema migration waited 0.2 s for a lock" in result.stderr
    assert "Traceback" not in result.stderr


def test_concurrent_migrations_apply_each_version_once(database):
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            with psycopg.connect(database, autocommit=True) as conn:
                results.append(migrations.apply_migrations(conn, lock_timeout_s=60))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    applied = sorted(version for result in results for version in result)
    assert applied == [version for version, _, _ in migrations.MIGRATIONS]


def locked_hot_tables(sql: str) -> set[str]:
    """The hot tables a migration's statements lock by name (ALTER TABLE, CREATE TRIGGER ... ON)."""
    code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    named = re.findall(r"ALTER TABLE\s+(\w+)", code) + re.findall(
        r"CREATE (?:OR REPLACE )?TRIGGER[^;]*?\bON\s+(\w+)", code
    )
    return set(named) & set(migrations.WRITER_LOCK_ORDER)


def test_a_migration_that_locks_several_hot_tables_takes_them_first_in_the_writers_order():
    """Otherwise it holds one while it waits for another that a writer holding rows of the second wants
    next: a deadlock with the load (migration 10 deadlocked under load before it declared its locks)."""
    for version, _, sql in migrations.MIGRATIONS:
        tables = locked_hot_tables(sql)
        declared = migrations.COMPATIBILITY[version].locks_first
        if len(tables) > 1:
            assert tables <= set(declared), (version, tables, declared)
        assert set(declared) <= set(migrations.WRITER_LOCK_ORDER), version
    assert locked_hot_tables(migrations.MIGRATIONS[9][2]) == {
        "idempotency_record",
        "ledger_entries",
        "outbox",
        "dead_letters",
    }
