"""Schema migrations: bounded lock waits, and no daemon started on a schema newer than it knows."""

from __future__ import annotations

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


def test_a_schema_newer_than_the_code_is_refused_by_serve_and_migrate(database):
    prepare_database(database, timedelta(days=30))
    newer = migrations.LATEST_VERSION + 1
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schema_version (version, description) VALUES (%s, 'from the future')", (newer,)
        )
        with pytest.raises(SchemaNewerThanCode, match=f"version {newer}, newer than this release knows"):
            migrations.apply_migrations(conn)
    for command in ("migrate", "serve"):
        result = run_shardd(
            command, "--dsn", database, "--dev-mode", "true", "--listen", "127.0.0.1:0", "--metrics-port", "0"
        )
        assert result.returncode == 2, (command, result.stderr)
        assert f"schema is at version {newer}" in result.stderr
        assert "Traceback" not in result.stderr


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
