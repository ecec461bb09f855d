"""A move's preparation takes no lock that traffic on the moved tables holds up.

The replica identity a move's row filter needs (REPLICA IDENTITY FULL) is set once, by migration
15, and on every partition before it is attached; a move used to set it in its prepare (and reset
it in its clean-up), an ACCESS EXCLUSIVE lock per table that queued behind every open transaction
on it. Here transactions that hold the locks writers and readers hold stay open on both shards
while the move prepares: it must finish in moments, with them still open.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from shardrouter.reshard import journal, replication
from shardrouter.reshard.journal import MoveObject
from shardrouter.reshard.move import Move, MoveSettings, find_move, start_move
from shardrouter.reshard.plan import Phase
from shardrouter.shardd import partitions
from shardrouter.shardd.migrations import FENCED_TABLES
from tests.reshard.cluster import FIRST, LAST, Pair, accounts, assert_no_leftovers, check_ledger, seed

QUICK = MoveSettings(copy_timeout_s=30, catch_up_timeout_s=30, final_sync_timeout_s=30)
#: A month no shard makes by itself (they make the months around now): only the old owner has it,
#: so the prepare must create it on the new owner, under its traffic.
OLD_MONTH = partitions.Month(2021, 1)


@contextmanager
def _held(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A transaction holding, on every moved table, the lock every writer takes (ROW EXCLUSIVE,
    which any ACCESS EXCLUSIVE request must wait for) and the lock every reader takes, left open.
    It writes nothing: a transaction with an xid would also hold back the logical slot's snapshot,
    which waits for writers of the moment however the tables are locked."""
    conn = psycopg.connect(dsn)
    try:
        tables = sql.SQL(", ").join(sql.Identifier(t) for t in FENCED_TABLES)
        conn.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(tables))
        conn.execute("SELECT count(*) FROM accounts").fetchone()
        yield conn
    finally:
        conn.rollback()
        conn.close()


def _still_open(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND mode = 'RowExclusiveLock'"
    )
    found = row.fetchone()
    return found is not None and int(found[0]) >= len(FENCED_TABLES)


def test_a_prepare_waits_for_no_lock_the_traffic_holds(pair: Pair) -> None:
    moving, staying = accounts(pair, 3)
    seed(pair, moving + staying)
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        partitions.create_partition(conn, OLD_MONTH)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with _held(pair.dsns["shard-0"]) as source_traffic, _held(pair.dsns["shard-1"]) as target_traffic:
        started = time.monotonic()
        with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
            move.run(until=Phase.PREPARED)
        took = time.monotonic() - started
        # Before migration 15 the prepare's ALTER TABLE ... REPLICA IDENTITY waited here for
        # 100 attempts of 100 ms and more, and then failed.
        assert took < 3.0, f"the prepare took {took:.1f} s beside open transactions"
        assert _still_open(source_traffic) and _still_open(target_traffic)
    assert record.phase is Phase.PREPARED
    assert not record.has("replica_identity", "shard-0")
    with psycopg.connect(pair.dsns["shard-1"], autocommit=True) as conn:
        assert OLD_MONTH in partitions.existing_partitions(conn)
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run()
    assert all(pair.owner(a) == "shard-1" for a in moving)
    check_ledger(pair, len(moving) + len(staying), 0)
    assert_no_leftovers(pair)  # every moved table still FULL, on both sides, the new partition too


def test_a_journal_that_lists_a_replica_identity_resumes_and_aborts(pair: Pair) -> None:
    """Moves of older versions journaled the identity they set; the identity now stays as it is."""
    moving, _ = accounts(pair, 2)
    seed(pair, moving)
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
        journal.record_object(conn, record, MoveObject("replica_identity", "full", "shard-0"))
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.COPIED)
    resumed = find_move(pair.databases, record.plan.move_id)
    assert resumed.has("replica_identity", "shard-0")
    with Move(resumed, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.abort()
    assert resumed.phase is Phase.ABORTED
    assert_no_leftovers(pair)
    again = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        journal.record_object(conn, again, MoveObject("replica_identity", "full", "shard-0"))
    with Move(again, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.FENCED)
    with Move(
        find_move(pair.databases, again.plan.move_id),
        map_store=pair.map_path,
        databases=pair.databases,
        settings=QUICK,
    ) as move:
        assert move.run().phase is Phase.DONE
    assert all(pair.owner(a) == "shard-1" for a in moving)
    assert_no_leftovers(pair)


def test_a_table_without_the_identity_gets_it_from_the_prepare(pair: Pair) -> None:
    """A database not migrated yet, or a partition an older daemon made: the prepare sets what is
    missing (and only that), so the publication's filter never refuses an UPDATE."""
    moving, _ = accounts(pair, 2)
    seed(pair, moving)
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        conn.execute("ALTER TABLE accounts REPLICA IDENTITY DEFAULT")
        assert replication.lacking_replica_identity(conn) == ["accounts"]
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        assert move.run().phase is Phase.DONE
    assert all(pair.owner(a) == "shard-1" for a in moving)
    assert_no_leftovers(pair)


def test_a_new_partition_is_full_before_it_is_attached(pair: Pair) -> None:
    with psycopg.connect(pair.dsns["shard-1"], autocommit=True) as conn:
        assert replication.lacking_replica_identity(conn) == []  # migration 15, and start-up's months
        assert partitions.create_partition(conn, OLD_MONTH)
        row = conn.execute(
            "SELECT relreplident FROM pg_class WHERE relname = %s", (OLD_MONTH.table,)
        ).fetchone()
        assert row == ("f",)
        assert replication.lacking_replica_identity(conn) == []
