"""Monthly partitions of `idempotency_record`: creating them ahead of time and dropping expired ones.

There is deliberately no DEFAULT partition. A key whose month has no partition must fail loudly at
start-up checks, not land in a catch-all: rows in a default partition would never expire by a DROP,
and attaching the missing month later would have to scan and move them under a lock on the parent.

Both operations avoid long locks on the parent table while traffic flows:
- a new month is created as a standalone table with a CHECK constraint matching its bounds and then
  `ATTACH PARTITION`ed (SHARE UPDATE EXCLUSIVE on the parent: inserts keep flowing, and the CHECK
  lets PostgreSQL skip the validation scan);
- an expired month is `DETACH PARTITION ... CONCURRENTLY`ed, then dropped.
Each DDL statement runs with a short lock_timeout, so it never queues in front of the traffic.

Creators run concurrently (every replica at start-up, each daemon's partition keeper, the retention
job), and the catalog is not safe for that: two `CREATE TABLE IF NOT EXISTS` of one name can fail on
pg_type's unique index, and the second ATTACH fails with "already a partition". So creating a month
holds a session advisory lock, and re-checks the catalog once it has it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors, sql

Connection = psycopg.Connection[Any]

log = logging.getLogger(__name__)

PARENT = "idempotency_record"
_NAME = re.compile(rf"{PARENT}_(\d{{4}})_(\d{{2}})")
DDL_LOCK_TIMEOUT_MS = 1000
DDL_ATTEMPTS = 20
# Serializes partition creators within one database (each shard has its own); "PARTIT".
_CREATE_LOCK = 0x5041_5254_4954


@dataclass(frozen=True, order=True)
class Month:
    """A calendar month; partition `idempotency_record_YYYY_MM` holds keys of that month."""

    year: int
    month: int

    @classmethod
    def of(cls, moment: datetime) -> Month:
        """The month that contains `moment` (in UTC)."""
        utc = moment.astimezone(UTC)
        return cls(utc.year, utc.month)

    def next(self) -> Month:
        """The following month."""
        return Month(self.year + self.month // 12, self.month % 12 + 1)

    def start(self) -> datetime:
        """First instant of the month, UTC."""
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    def end(self) -> datetime:
        """First instant of the next month, UTC (exclusive upper bound)."""
        return self.next().start()

    @property
    def table(self) -> str:
        """The partition's table name."""
        return f"{PARENT}_{self.year:04d}_{self.month:02d}"


@dataclass(frozen=True)
class PartitionInfo:
    """A partition as found in the catalog, with its size."""

    month: Month
    rows: int
    bytes: int


def months_to_keep(now: datetime, retention: timedelta, months_ahead: int) -> list[Month]:
    """Every month from the oldest still inside the retention window to `months_ahead` past now."""
    month = Month.of(now - retention)
    last = Month.of(now)
    for _ in range(months_ahead):
        last = last.next()
    months = []
    while month <= last:
        months.append(month)
        month = month.next()
    return months


def expired_months(existing: list[Month], now: datetime, retention: timedelta) -> list[Month]:
    """Partitions wholly older than the window: every key in them is past retention."""
    cutoff = now - retention
    return [m for m in existing if m.end() <= cutoff]


def existing_partitions(conn: Connection) -> list[Month]:
    """Months that have an attached partition, oldest first."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_inherits i"
        " JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent"
        " WHERE p.relname = %s",
        (PARENT,),
    ).fetchall()
    months = []
    for (name,) in rows:
        match = _NAME.fullmatch(str(name))
        if match:
            months.append(Month(int(match.group(1)), int(match.group(2))))
    return sorted(months)


def partition_sizes(conn: Connection) -> list[PartitionInfo]:
    """Estimated rows (planner statistics, cheap) and on-disk bytes of each partition."""
    rows = conn.execute(
        "SELECT c.relname, greatest(c.reltuples, 0)::bigint, pg_total_relation_size(c.oid)"
        " FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s",
        (PARENT,),
    ).fetchall()
    result = []
    for name, count, size in rows:
        match = _NAME.fullmatch(str(name))
        if match:
            month = Month(int(match.group(1)), int(match.group(2)))
            result.append(PartitionInfo(month, int(count), int(size)))
    return sorted(result, key=lambda p: p.month)


def create_partition(conn: Connection, month: Month) -> bool:
    """Create and attach one month's partition if missing; True if it was created.

    `conn` must be in autocommit mode: each step is its own short transaction.
    """
    with _creation_lock(conn):
        # Checked under the lock: another creator may have attached it while we waited.
        if month in existing_partitions(conn):
            return False
        _create_and_attach(conn, month)
    log.info("created partition %s", month.table)
    return True


def _create_and_attach(conn: Connection, month: Month) -> None:
    """The DDL of `create_partition`; each step tolerates a half-done earlier attempt."""
    table = sql.Identifier(month.table)
    start, end = sql.Literal(month.start()), sql.Literal(month.end())
    run_ddl(
        conn,
        sql.SQL("CREATE TABLE IF NOT EXISTS {t} (LIKE {p} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)").format(
            t=table, p=sql.Identifier(PARENT)
        ),
    )
    # A move's publication filters rows by account_hash, which the primary key lacks, so every
    # partition needs REPLICA IDENTITY FULL (migration 15 gave it to the partitions it found; LIKE
    # does not copy it). Set while the table stands alone: its lock then stops no one.
    run_ddl(conn, sql.SQL("ALTER TABLE {t} REPLICA IDENTITY FULL").format(t=table))
    bounds = sql.Identifier(f"{month.table}_bounds")
    run_ddl(
        conn,
        sql.SQL(
            "DO $$ BEGIN ALTER TABLE {t} ADD CONSTRAINT {c} CHECK (key_time >= {s} AND key_time < {e});"
            " EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        ).format(t=table, c=bounds, s=start, e=end),
    )
    run_ddl(
        conn,
        sql.SQL("ALTER TABLE {p} ATTACH PARTITION {t} FOR VALUES FROM ({s}) TO ({e})").format(
            p=sql.Identifier(PARENT), t=table, s=start, e=end
        ),
    )
    # The bounds CHECK only served to skip the attach scan; the partition constraint replaces it.
    run_ddl(conn, sql.SQL("ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {c}").format(t=table, c=bounds))


@contextmanager
def _creation_lock(conn: Connection) -> Iterator[None]:
    """Hold the partition-creation advisory lock (session level: `conn` is autocommit).

    If the connection dies while holding it, the server releases it with the session.
    """
    conn.execute("SELECT pg_advisory_lock(%s)", (_CREATE_LOCK,))
    try:
        yield
    finally:
        if not conn.broken:  # a dead session has released it; unlocking would hide the real error
            conn.execute("SELECT pg_advisory_unlock(%s)", (_CREATE_LOCK,))


def drop_partition(conn: Connection, month: Month) -> None:
    """Detach (concurrently) and drop one month's partition. `conn` must be in autocommit mode."""
    table = sql.Identifier(month.table)
    if month in existing_partitions(conn):
        try:
            run_ddl(
                conn,
                sql.SQL("ALTER TABLE {p} DETACH PARTITION {t} CONCURRENTLY").format(
                    p=sql.Identifier(PARENT), t=table
                ),
            )
        except errors.ObjectNotInPrerequisiteState:
            # An earlier run was interrupted between the two phases of DETACH CONCURRENTLY.
            run_ddl(
                conn,
                sql.SQL("ALTER TABLE {p} DETACH PARTITION {t} FINALIZE").format(
                    p=sql.Identifier(PARENT), t=table
                ),
            )
    run_ddl(conn, sql.SQL("DROP TABLE IF EXISTS {t}").format(t=table))
    log.info("dropped partition %s", month.table)


def ensure_partitions(
    conn: Connection, *, now: datetime, retention: timedelta, months_ahead: int
) -> list[Month]:
    """Create every partition a key inside the retention window could need; returns those created."""
    return [m for m in months_to_keep(now, retention, months_ahead) if create_partition(conn, m)]


def first_missing_month(conn: Connection, needed: list[Month]) -> Month | None:
    """The first needed month without a partition, if any."""
    have = set(existing_partitions(conn))
    return next((m for m in needed if m not in have), None)


def today() -> date:
    """Today's date in UTC."""
    return datetime.now(UTC).date()


def run_ddl(
    conn: Connection,
    statement: sql.Composed,
    *,
    lock_timeout_ms: int = DDL_LOCK_TIMEOUT_MS,
    attempts: int = DDL_ATTEMPTS,
) -> None:
    """Run DDL with a short lock wait, retrying: waiting long would queue the traffic behind us."""
    for attempt in range(1, attempts + 1):
        try:
            conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{lock_timeout_ms}ms")))
            conn.execute(statement)
            return
        except errors.LockNotAvailable:
            if attempt == attempts:
                raise
            log.warning("DDL waited over %d ms for a lock; retrying (%d)", lock_timeout_ms, attempt)
            time.sleep(min(0.05 * attempt, 1.0))
        finally:
            conn.execute("RESET lock_timeout")


__all__ = [
    "DDL_ATTEMPTS",
    "DDL_LOCK_TIMEOUT_MS",
    "PARENT",
    "Connection",
    "Month",
    "PartitionInfo",
    "create_partition",
    "drop_partition",
    "ensure_partitions",
    "existing_partitions",
    "expired_months",
    "first_missing_month",
    "months_to_keep",
    "partition_sizes",
    "run_ddl",
    "today",
]
