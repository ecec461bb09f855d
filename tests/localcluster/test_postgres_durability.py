"""The test servers' durability switch: `SHARD_ROUTER_PG_FSYNC` (see `localcluster/postgres.py`)."""

from __future__ import annotations

import psycopg
import pytest

from shardrouter.localcluster import postgres as local_postgres
from shardrouter.localcluster.postgres import FSYNC_ENV, LocalPostgres


@pytest.mark.parametrize(
    ("value", "options"),
    [
        ("on", ""),
        (" ON ", ""),
        ("off", " -c fsync=off -c full_page_writes=off"),
        ("Off", " -c fsync=off -c full_page_writes=off"),
    ],
)
def test_the_switch_reads_on_and_off(monkeypatch: pytest.MonkeyPatch, value: str, options: str) -> None:
    monkeypatch.setenv(FSYNC_ENV, value)
    assert local_postgres._durability_options() == options


def test_unset_means_durable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FSYNC_ENV, raising=False)
    assert local_postgres._durability_options() == ""


def test_anything_else_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FSYNC_ENV, "no")
    with pytest.raises(ValueError, match=r"SHARD_ROUTER_PG_FSYNC must be 'on' or 'off', not 'no'"):
        local_postgres._durability_options()


def test_the_session_server_runs_without_fsync(postgres: LocalPostgres) -> None:
    """tests/conftest.py turns fsync off for every server the tests start."""
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        assert conn.execute("SHOW fsync").fetchone() == ("off",)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
