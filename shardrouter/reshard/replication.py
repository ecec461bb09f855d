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
from psycopg.rows import dict_row

from shardrouter.reshard.plan import MovePlan
from shardrouter.shardd.migrations import FENCED_TABLES
from shardrouter.shardd.partitions import PARENT as PARTITIONED_TABLE
from shardrouter.shardd.partitions import run_ddl

#: How long one attempt to give a table the replica identity may queue the table's traffic (only a
#: table that lacks it: a database not yet at schema 15, or a partition an older daemon made).
_IDENTITY_LOCK_TIMEOUT_MS = 100
_IDENTITY_ATTEMPTS = 100
#: The table of the probe row a move publishes besides the moved rows (not fenced: the move writes
#: it while its range is fenced, and no process reads a row no transaction ever commits).
_PROBE_TABLE = "slot_fences"


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


def probe_id(plan: MovePlan) -> str:
    """The `slot_fences` key of the move's probe row (see `commit_probe`)."""
    return f"{plan.move_id}:probe"


def create_publication(conn: psycopg.Connection[Any], name: str, plan: MovePlan) -> None:
    """The publication of the moving slots' rows of every moved table (the partitioned table
    through its root, so the target's partitions may differ), and of the move's probe row."""
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone():
        return
    tables = sql.SQL(", ").join(
        [
            *(
                sql.SQL("{} WHERE {}").format(sql.Identifier(t), sql.SQL(plan.row_filter()))
                for t in FENCED_TABLES
            ),
            sql.SQL("{} WHERE (move_id = {})").format(
                sql.Identifier(_PROBE_TABLE), sql.Literal(probe_id(plan))
            ),
        ]
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
    conn: psycopg.Connection[Any],
    name: str,
    *,
    source_conninfo: str,
    publication: str,
    slot: str,
    enabled: bool = True,
) -> None:
    """The target's subscription: copies every published row under the slot's snapshot, then
    applies the changes (made disabled with `enabled=False`: nothing runs until it is enabled).
    `conn` must be in autocommit mode."""
    if conn.execute("SELECT 1 FROM pg_subscription WHERE subname = %s", (name,)).fetchone():
        return
    conn.execute(
        sql.SQL(
            "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}"
            # Streaming chosen on purpose: off, so a transaction larger than the publisher's
            # logical_decoding_work_mem is spilled there and sent whole at its commit. PostgreSQL 18's
            # default, parallel, hands such a transaction to parallel apply workers mid-stream, and a
            # move disables the subscription (to verify, to commit) at any moment of a stream; that
            # path crashed a server.
            " WITH (create_slot = false, slot_name = {}, copy_data = true, streaming = off, enabled = {})"
        ).format(
            sql.Identifier(name),
            sql.Literal(source_conninfo),
            sql.Identifier(publication),
            sql.Literal(slot),
            sql.Literal(enabled),
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


def drop_subscription_and_sync_slots(
    target: psycopg.Connection[Any], source: psycopg.Connection[Any], name: str
) -> list[str]:
    """`drop_subscription` on the new owner, then the table sync slots it left on the old owner:
    dropped while tables are still being copied, a subscription drops those only when the new
    owner's server reaches the old owner, and each left there keeps the old owner's WAL. Returns
    the sync slots dropped."""
    subscription = subscription_oid(target, name)
    drop_subscription(target, name)
    return [] if subscription is None else drop_sync_slots(source, subscription)


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


def subscription_oid(conn: psycopg.Connection[Any], name: str) -> int | None:
    """The subscription's oid in this database (None: there is none)."""
    row = conn.execute(
        "SELECT oid FROM pg_subscription WHERE subname = %s"
        " AND subdbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (name,),
    ).fetchone()
    return None if row is None else int(row[0])


def _sync_slot_prefix(subscription: int, relid: int | None = None) -> str:
    """How the names of a subscription's table sync slots start: PostgreSQL names them
    `pg_<subscription oid>_sync_<table oid>_<subscriber's system id>`."""
    return f"pg_{subscription}_sync_" + ("" if relid is None else f"{relid}_")


def stranded_tables(source: psycopg.Connection[Any], target: psycopg.Connection[Any], name: str) -> list[str]:
    """The tables whose copy PostgreSQL can no longer finish: in state `f` (copied, not yet caught
    up) on the new owner while their table sync slot is gone from the old owner.

    A table sync worker in state `f` only ever streams from that slot (it never copies again, nor
    makes the slot anew), so without it the worker fails at each start, for good. The slot goes
    when the worker, caught up, drops it in the same transaction that records the table synced;
    if the old owner's server dies after the drop is done but before the worker hears so, that
    transaction rolls back and leaves `f` without a slot. A worker between its drop and its commit
    looks the same for a moment: callers look twice, some time apart."""
    subscription = subscription_oid(target, name)
    if subscription is None:
        return []
    finished = target.execute(
        "SELECT c.relname, r.srrelid FROM pg_subscription_rel r JOIN pg_class c ON c.oid = r.srrelid"
        " WHERE r.srsubid = %s AND r.srsubstate = 'f' ORDER BY 1",
        (subscription,),
    ).fetchall()
    if not finished:
        return []
    slots = {
        str(r[0])
        for r in source.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
            " AND starts_with(slot_name, %s)",
            (_sync_slot_prefix(subscription),),
        ).fetchall()
    }
    return [
        str(table)
        for table, relid in finished
        if not any(s.startswith(_sync_slot_prefix(subscription, int(relid))) for s in slots)
    ]


def drop_sync_slots(conn: psycopg.Connection[Any], subscription: int) -> list[str]:
    """Drop the table sync slots a dropped subscription left on the old owner (DROP SUBSCRIPTION
    drops them only when it reaches the old owner); returns their names."""
    names = [
        str(r[0])
        for r in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
            " AND starts_with(slot_name, %s) ORDER BY 1",
            (_sync_slot_prefix(subscription),),
        ).fetchall()
    ]
    for slot in names:
        drop_slot(conn, slot)
    return names


def release_slot(conn: psycopg.Connection[Any], name: str, timeout_s: float = 10.0) -> None:
    """Wait until no walsender streams from the slot (one whose subscriber went away lets go when
    it notices), ending the walsender once `timeout_s` ran out."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (name,)
        ).fetchone()
        if row is None or row[0] is None:
            return
        if time.monotonic() >= deadline:
            conn.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        time.sleep(0.05)


def apply_errors(conn: psycopg.Connection[Any], name: str) -> int:
    """Errors the subscription's workers met so far (a conflict stalls the stream)."""
    row = conn.execute(
        "SELECT coalesce(apply_error_count, 0) + coalesce(sync_error_count, 0)"
        " FROM pg_stat_subscription_stats WHERE subname = %s",
        (name,),
    ).fetchone()
    return int(row[0]) if row else 0


def probe_published(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether the publication carries the move's probe row (moves prepared by older versions do not)."""
    row = conn.execute(
        "SELECT 1 FROM pg_publication_tables WHERE pubname = %s AND tablename = %s", (name, _PROBE_TABLE)
    ).fetchone()
    return row is not None


def commit_probe(conn: psycopg.Connection[Any], plan: MovePlan) -> None:
    """Commit, on the old owner, a transaction the subscription applies and that changes nothing:
    the probe row of `slot_fences`, inserted and deleted at once (no other transaction ever sees it).
    Committed after the final position, it moves the subscription's origin past that position once
    applied: the subscriber's own proof that it applied every change before it (transactions that
    touch no published row are never sent, so nothing else need move the origin that far)."""
    fence = (probe_id(plan), plan.slots, plan.first_slot, plan.last_slot)
    with conn.transaction():
        conn.execute(
            sql.SQL("INSERT INTO {} (move_id, slots, first_slot, last_slot) VALUES (%s, %s, %s, %s)").format(
                sql.Identifier(_PROBE_TABLE)
            ),
            fence,
        )
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE move_id = %s").format(sql.Identifier(_PROBE_TABLE)), fence[:1]
        )


def origin_lsn(conn: psycopg.Connection[Any], name: str) -> str | None:
    """How far the subscription's origin has applied the old owner's WAL (the end of the last
    transaction it applied), or None."""
    row = conn.execute(
        "SELECT o.remote_lsn::text FROM pg_subscription s"
        " JOIN pg_replication_origin_status o ON o.external_id = 'pg_' || s.oid"
        " WHERE s.subname = %s AND s.subdbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (name,),
    ).fetchone()
    return None if row is None or row[0] is None else str(row[0])


def lsn_at_least(conn: psycopg.Connection[Any], lsn: str | None, than: str) -> bool:
    """Whether WAL position `lsn` is at or past `than`."""
    if lsn is None:
        return False
    row = conn.execute("SELECT %s::pg_lsn >= %s::pg_lsn", (lsn, than)).fetchone()
    return bool(row and row[0])


def set_enabled(conn: psycopg.Connection[Any], name: str, enabled: bool) -> None:
    """Enable or disable the subscription (if it exists)."""
    row = conn.execute("SELECT subenabled FROM pg_subscription WHERE subname = %s", (name,)).fetchone()
    if row is None or bool(row[0]) == enabled:
        return
    verb = sql.SQL("ENABLE" if enabled else "DISABLE")
    conn.execute(sql.SQL("ALTER SUBSCRIPTION {} {}").format(sql.Identifier(name), verb))


def workers(conn: psycopg.Connection[Any], name: str) -> list[int]:
    """The pids of the subscription's running workers (apply, table sync, parallel apply)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_subscription WHERE subname = %s AND pid IS NOT NULL ORDER BY pid", (name,)
    ).fetchall()
    return [int(r[0]) for r in rows]


def stop_subscription(conn: psycopg.Connection[Any], name: str, timeout_s: float = 30.0) -> list[int]:
    """Disable the subscription and wait until its workers have exited; the pids still running when
    the wait ran out (none, normally).

    Gone from `pg_stat_subscription` is not enough: a worker leaves it before it flushes its
    statistics on the way out, so the conflict counters a verification reads could still miss its
    last skipped change. A worker is waited for until its process has left `pg_stat_activity`."""
    seen = set(workers(conn, name))
    set_enabled(conn, name, False)
    deadline = time.monotonic() + timeout_s
    while True:
        running = workers(conn, name)
        seen.update(running)
        exiting = _alive(conn, seen.difference(running))
        if not (running or exiting) or time.monotonic() >= deadline:
            return sorted({*running, *exiting})
        time.sleep(0.02)


def _alive(conn: psycopg.Connection[Any], pids: set[int]) -> list[int]:
    """Those of `pids` whose processes still run on the server."""
    if not pids:
        return []
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (sorted(pids),)).fetchall()
    return [int(r[0]) for r in rows]


@dataclass(frozen=True)
class SubscriberState:
    """What the new owner's subscription says about itself: whether it is still (disabled, no
    worker), each table's state, how far its origin applied, and its error and conflict counters
    (PostgreSQL's `pg_stat_subscription_stats`: `apply_error_count`, `sync_error_count`, `confl_*`)."""

    exists: bool
    enabled: bool
    workers: tuple[int, ...]
    tables: dict[str, str]
    origin_lsn: str | None
    counters: dict[str, int]

    @property
    def incidents(self) -> dict[str, int]:
        """The counters that are not zero: errors or conflicts since the subscription was made."""
        return {k: v for k, v in self.counters.items() if v}

    def describe(self) -> str:
        """The state in words."""
        return (
            f"subscription {'enabled' if self.enabled else 'disabled'}, workers {list(self.workers)}, "
            f"origin applied up to {self.origin_lsn}, tables {self.tables}, counters {self.counters}"
        )


def subscriber_state(conn: psycopg.Connection[Any], name: str) -> SubscriberState:
    """The subscription's state as the new owner's server sees it now."""
    row = conn.execute("SELECT subenabled FROM pg_subscription WHERE subname = %s", (name,)).fetchone()
    if row is None:
        return SubscriberState(False, False, (), {}, None, {})
    with conn.cursor(row_factory=dict_row) as cur:
        stats = cur.execute("SELECT * FROM pg_stat_subscription_stats WHERE subname = %s", (name,)).fetchone()
    counters = {
        str(k): int(v or 0)
        for k, v in (stats or {}).items()
        if str(k).endswith("_error_count") or str(k).startswith("confl_")
    }
    return SubscriberState(
        True,
        bool(row[0]),
        tuple(workers(conn, name)),
        copy_state(conn, name).states,
        origin_lsn(conn, name),
        counters,
    )


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
    "SubscriberState",
    "apply_errors",
    "commit_probe",
    "copy_state",
    "create_publication",
    "create_slot",
    "create_subscription",
    "current_lsn",
    "drop_publication",
    "drop_slot",
    "drop_subscription",
    "drop_subscription_and_sync_slots",
    "drop_sync_slots",
    "ensure_replica_identity",
    "lacking_replica_identity",
    "lsn_at_least",
    "origin_lsn",
    "point_subscription",
    "probe_id",
    "probe_published",
    "release_slot",
    "replicated_relations",
    "set_enabled",
    "slot_lag_bytes",
    "slot_streaming",
    "stop_subscription",
    "stranded_tables",
    "subscriber_state",
    "subscription_oid",
    "wake_stream",
    "workers",
]
