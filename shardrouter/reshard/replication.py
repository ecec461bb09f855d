"""PostgreSQL's logical replication of one move: a publication with row filters on the moving
slots and a logical slot on the old owner, a subscription on the target that copies under the
slot's snapshot and then follows the changes.

The slot is made on the old owner first (not by CREATE SUBSCRIPTION), so the old and new owner may
even be two databases of one server, where a subscription cannot create its own slot. Every
function here tolerates the object being there already, or gone already: a resumed move repeats
its last step, and an abort removes what the journal lists whether or not it got made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors, sql

from shardrouter.reshard.plan import MovePlan
from shardrouter.shardd.migrations import FENCED_TABLES
from shardrouter.shardd.partitions import PARENT as PARTITIONED_TABLE
from shardrouter.shardd.partitions import run_ddl

#: How long one attempt to give a table the replica identity may queue the table's traffic (only a
#: table that lacks it: a database not yet at schema 15, or a partition an older daemon made).
_IDENTITY_LOCK_TIMEOUT_MS = 100
_IDENTITY_ATTEMPTS = 100


@dataclass(frozen=True)
class CopyState:
    """How far a subscription's initial copy is: tables done, of all."""

    ready: int
    tables: int
    states: dict[str, str]

    @property
    def copied(self) -> bool:
        """Every table copied and following the stream."""
        return self.tables > 0 and self.ready == self.tables


def replicated_relations(conn: psycopg.Connection[Any]) -> list[str]:
    """The tables a move publishes and whose replica identity must hold account_hash: the moved
    tables, and the partitions of the partitioned one (an UPDATE is checked against its
    partition's identity)."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s ORDER BY 1",
        (PARTITIONED_TABLE,),
    ).fetchall()
    return [*FENCED_TABLES, *(str(r[0]) for r in rows)]


def lacking_replica_identity(conn: psycopg.Connection[Any]) -> list[str]:
    """The replicated relations whose replica identity is not FULL (none, normally: migration 15
    sets it on every moved table and `partitions.create_partition` on every new partition)."""
    rows = conn.execute(
        "SELECT relname FROM pg_class WHERE relname = ANY(%s) AND relkind IN ('r', 'p')"
        " AND relnamespace = current_schema()::regnamespace AND relreplident <> 'f'",
        (replicated_relations(conn),),
    ).fetchall()
    return sorted(str(r[0]) for r in rows)


def ensure_replica_identity(conn: psycopg.Connection[Any]) -> list[str]:
    """Give REPLICA IDENTITY FULL to the replicated relations that lack it; returns those changed.

    A move's row filter reads account_hash, which no primary key holds, and PostgreSQL refuses an
    UPDATE or DELETE of a published table whose identity does not cover the filter. The identity
    is permanent since migration 15, so this only reads the catalog and takes no lock; only a
    table that lacks it (a database not migrated yet, a partition made by an older daemon) is
    altered, and that ALTER takes the table's strongest lock: queued behind a long transaction it
    would stall every call behind it, so it waits at most a moment at a time and tries again.
    """
    lacking = lacking_replica_identity(conn)
    for table in lacking:
        run_ddl(
            conn,
            sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(sql.Identifier(table)),
            lock_timeout_ms=_IDENTITY_LOCK_TIMEOUT_MS,
            attempts=_IDENTITY_ATTEMPTS,
        )
    return lacking


def create_publication(conn: psycopg.Connection[Any], name: str, plan: MovePlan) -> None:
    """The publication of the moving slots' rows of every moved table (the partitioned table
    through its root, so the target's partitions may differ)."""
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone():
        return
    tables = sql.SQL(", ").join(
        sql.SQL("{} WHERE {}").format(sql.Identifier(t), sql.SQL(plan.row_filter())) for t in FENCED_TABLES
    )
    conn.execute(
        sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)").format(
            sql.Identifier(name), tables
        )
    )


def drop_publication(conn: psycopg.Connection[Any], name: str) -> None:
    """Remove the publication if it exists."""
    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(name)))


def create_slot(conn: psycopg.Connection[Any], name: str) -> None:
    """The logical replication slot the subscription streams from (pgoutput)."""
    if conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (name,)).fetchone():
        return
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))


def drop_slot(conn: psycopg.Connection[Any], name: str, timeout_s: float = 10.0) -> None:
    """Remove the slot if it exists, waiting for its walsender to let go of it."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (name,)
        ).fetchone()
        if row is None:
            return
        if row[0] is None:
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
                return
            except errors.ObjectInUse:
                pass
        elif time.monotonic() >= deadline:
            conn.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        time.sleep(0.05)


def create_subscription(
    conn: psycopg.Connection[Any], name: str, *, source_conninfo: str, publication: str, slot: str
) -> None:
    """The target's subscription: copies every published row under the slot's snapshot, then
    applies the changes. `conn` must be in autocommit mode."""
    if conn.execute("SELECT 1 FROM pg_subscription WHERE subname = %s", (name,)).fetchone():
        return
    conn.execute(
        sql.SQL(
            "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}"
            " WITH (create_slot = false, slot_name = {}, copy_data = true)"
        ).format(
            sql.Identifier(name), sql.Literal(source_conninfo), sql.Identifier(publication), sql.Literal(slot)
        )
    )


def point_subscription(conn: psycopg.Connection[Any], name: str, *, source_conninfo: str) -> bool:
    """Give an existing subscription this connection string if it has another; True if changed."""
    row = conn.execute("SELECT subconninfo FROM pg_subscription WHERE subname = %s", (name,)).fetchone()
    if row is None or row[0] == source_conninfo:
        return False
    conn.execute(
        sql.SQL("ALTER SUBSCRIPTION {} CONNECTION {}").format(
            sql.Identifier(name), sql.Literal(source_conninfo)
        )
    )
    return True


def drop_subscription(conn: psycopg.Connection[Any], name: str) -> None:
    """Stop and remove the subscription, leaving the slot on the old owner to `drop_slot` (a
    subscription dropping its own remote slot would need the old owner reachable)."""
    if not conn.execute("SELECT 1 FROM pg_subscription WHERE subname = %s", (name,)).fetchone():
        return
    ident = sql.Identifier(name)
    conn.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(ident))
    conn.execute(sql.SQL("ALTER SUBSCRIPTION {} SET (slot_name = NONE)").format(ident))
    conn.execute(sql.SQL("DROP SUBSCRIPTION {}").format(ident))


def copy_state(conn: psycopg.Connection[Any], name: str) -> CopyState:
    """The initial copy's progress on the target (`r`: copied and streaming)."""
    rows = conn.execute(
        "SELECT c.relname, r.srsubstate FROM pg_subscription_rel r"
        " JOIN pg_subscription s ON s.oid = r.srsubid JOIN pg_class c ON c.oid = r.srrelid"
        " WHERE s.subname = %s ORDER BY 1",
        (name,),
    ).fetchall()
    states = {str(t): str(s) for t, s in rows}
    return CopyState(sum(1 for s in states.values() if s == "r"), len(states), states)


def apply_errors(conn: psycopg.Connection[Any], name: str) -> int:
    """Errors the subscription's workers met so far (a conflict stalls the stream)."""
    row = conn.execute(
        "SELECT coalesce(apply_error_count, 0) + coalesce(sync_error_count, 0)"
        " FROM pg_stat_subscription_stats WHERE subname = %s",
        (name,),
    ).fetchone()
    return int(row[0]) if row else 0


def current_lsn(conn: psycopg.Connection[Any]) -> str:
    """The old owner's current WAL position."""
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def slot_lag_bytes(conn: psycopg.Connection[Any], slot: str, upto: str | None = None) -> int | None:
    """Bytes of WAL between what the subscriber confirmed and `upto` (default: now); None when
    the slot does not exist."""
    row = conn.execute(
        "SELECT greatest(0, coalesce(%s::pg_lsn, pg_current_wal_lsn()) - confirmed_flush_lsn)::bigint"
        " FROM pg_replication_slots WHERE slot_name = %s",
        (upto, slot),
    ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def slot_streaming(conn: psycopg.Connection[Any], slot: str) -> bool:
    """Whether a walsender is streaming from the slot now (the subscriber is connected)."""
    row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return bool(row and row[0])


def wake_stream(conn: psycopg.Connection[Any]) -> None:
    """Write a (non-transactional, unpublished) WAL record, so an idle walsender has a position
    past the final one to confirm."""
    conn.execute("SELECT pg_logical_emit_message(false, 'shardrouter-move', 'tick')")


__all__ = [
    "CopyState",
    "apply_errors",
    "copy_state",
    "create_publication",
    "create_slot",
    "create_subscription",
    "current_lsn",
    "drop_publication",
    "drop_slot",
    "drop_subscription",
    "ensure_replica_identity",
    "lacking_replica_identity",
    "point_subscription",
    "replicated_relations",
    "slot_lag_bytes",
    "slot_streaming",
    "wake_stream",
]
