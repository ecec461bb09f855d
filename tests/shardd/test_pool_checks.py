"""The pool probes a connection only after it sat idle, and still replaces one that died meanwhile."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from shardrouter.core.errors import Internal
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.db import Database


def test_a_connection_back_a_moment_ago_is_not_probed_again(database: str) -> None:
    db = Database(database, min_size=1, max_size=1)
    db.checks.idle_s = 0.3
    db.open()
    try:
        with db.connection() as conn:  # first checkout of a new connection: probed
            conn.execute("SELECT 1")
            conn.commit()
        probed = db.checks.probes
        for _ in range(5):  # straight back out: no probe, no round trip
            with db.connection() as conn:
                conn.execute("SELECT 1")
                conn.commit()
        assert db.checks.probes == probed
        time.sleep(0.4)  # idle longer than idle_s: probed again
        with db.connection() as conn:
            conn.execute("SELECT 1")
            conn.commit()
        assert db.checks.probes == probed + 1
    finally:
        db.close()


def test_a_connection_that_died_while_idle_is_replaced_before_a_call_gets_it(
    postgres: LocalPostgres, database: str
) -> None:
    db = Database(database, min_size=1, max_size=1)
    db.checks.idle_s = 0.2
    db.open()
    try:
        with db.connection() as conn:
            conn.execute("SELECT 1")
            conn.commit()
        postgres.restart()
        time.sleep(0.3)
        with db.connection() as conn:  # the dead connection failed its probe; this one is new
            assert conn.execute("SELECT 1").fetchone() == (1,)
            conn.commit()
    finally:
        db.close()


def test_a_connection_is_back_in_the_pool_as_soon_as_the_call_leaves_it(database: str) -> None:
    # Without a `reset` callback psycopg_pool returns a connection in the caller's thread; with one,
    # every return went through a worker thread (measured: 13% of a busy shard's GIL time).
    db = Database(database, min_size=1, max_size=1)
    db.open()
    try:
        for _ in range(20):
            with db.connection() as conn:
                conn.execute("SELECT 1")
                conn.commit()
            assert db.pool.get_stats()["pool_available"] == 1
    finally:
        db.close()


def test_a_transaction_left_open_is_rolled_back_not_committed_by_the_pool(database: str) -> None:
    # psycopg_pool commits what is open when its context ends normally: a forgotten handler
    # transaction would land its writes without their record. The pool's user gets Internal instead.
    db = Database(database, min_size=1, max_size=1)
    db.open()
    try:
        with db.connection() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS left_open (n int)")
        with pytest.raises(Internal, match="left open"), db.connection() as conn:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO left_open VALUES (1)")
        with pytest.raises(Internal, match="left open"), db.connection() as conn:
            conn.execute("BEGIN")
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute("INSERT INTO left_open VALUES (1 / 0)")
        with db.connection() as conn:
            assert conn.execute("SELECT count(*) FROM left_open").fetchone() == (0,)
            assert conn.info.transaction_status is TransactionStatus.IDLE
    finally:
        db.close()
