"""Verification of a move before the old rows are deleted: the moved rows on the new owner equal
the old owner's, table by table, and every moved account's balance is the sum of its ledger.

A table's digest is its row count and an order-independent checksum (the sum of a 60-bit slice
of each row's md5 over its whole text, stored responses included), slot by slot, so a mismatch
names the slots it is in; taken with the same session
settings on both sides so a row prints the same wherever it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from shardrouter.reshard.plan import MovePlan
from shardrouter.shardd.migrations import FENCED_TABLES


@dataclass(frozen=True)
class TableDigest:
    """Rows of the moving slots in one table and their checksum, slot by slot (`by_slot`: slot ->
    (rows, checksum), slots with rows only) and in all."""

    by_slot: dict[int, tuple[int, int]]

    @property
    def rows(self) -> int:
        """Rows of all the moving slots."""
        return sum(n for n, _ in self.by_slot.values())

    @property
    def checksum(self) -> int:
        """The checksum of all the moving slots' rows."""
        return sum(c for _, c in self.by_slot.values())

    def slots_that_differ(self, other: TableDigest) -> list[int]:
        """The slots whose rows or checksum differ between the two sides."""
        return sorted(
            s
            for s in self.by_slot.keys() | other.by_slot.keys()
            if self.by_slot.get(s) != other.by_slot.get(s)
        )


@dataclass(frozen=True)
class Verification:
    """The comparison of both sides; `problems` is empty when the move may commit."""

    source: dict[str, TableDigest]
    target: dict[str, TableDigest]
    unbalanced_accounts: int

    @property
    def problems(self) -> list[str]:
        """Each difference, in words."""
        found = [
            f"{t}: {self.source[t].rows} rows (checksum {self.source[t].checksum}) on the old owner, "
            f"{self.target[t].rows} (checksum {self.target[t].checksum}) on the new; slots that differ: "
            + _some(self.source[t].slots_that_differ(self.target[t]))
            for t in FENCED_TABLES
            if self.source[t] != self.target[t]
        ]
        if self.unbalanced_accounts:
            found.append(
                f"{self.unbalanced_accounts} moved account(s) whose balance is not the sum of their ledger"
            )
        return found

    @property
    def rows(self) -> int:
        """Rows moved, all tables."""
        return sum(d.rows for d in self.target.values())


def digests(conn: psycopg.Connection[Any], plan: MovePlan) -> dict[str, TableDigest]:
    """The digest of every moved table's rows in the plan's slots."""
    out: dict[str, TableDigest] = {}
    with conn.transaction():
        # One snapshot for all tables, and a row's text independent of the server's settings.
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SET LOCAL TimeZone = 'UTC'")
        conn.execute("SET LOCAL DateStyle = 'ISO, YMD'")
        conn.execute("SET LOCAL IntervalStyle = 'postgres'")
        conn.execute("SET LOCAL bytea_output = 'hex'")
        for table in FENCED_TABLES:
            rows = conn.execute(
                sql.SQL(
                    "SELECT t.account_hash % {slots}, count(*),"
                    " sum(('x' || left(md5(t::text), 15))::bit(60)::bigint::numeric)"
                    " FROM {table} t WHERE {where} GROUP BY 1"
                ).format(
                    slots=sql.Literal(plan.slots),
                    table=sql.Identifier(table),
                    where=sql.SQL(plan.row_filter("t.account_hash")),
                )
            ).fetchall()
            out[table] = TableDigest({int(slot): (int(n), int(checksum)) for slot, n, checksum in rows})
    return out


def _some(slots: list[int], shown: int = 8) -> str:
    more = f" and {len(slots) - shown} more" if len(slots) > shown else ""
    return ", ".join(str(s) for s in slots[:shown]) + more


def unbalanced_accounts(conn: psycopg.Connection[Any], plan: MovePlan) -> int:
    """Moved accounts whose balance differs from the sum of their ledger entries."""
    with conn.transaction():
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM accounts a WHERE {} AND a.balance <> coalesce("
                "(SELECT sum(l.amount_minor) FROM ledger_entries l WHERE l.account_id = a.id), 0)"
            ).format(sql.SQL(plan.row_filter("a.account_hash")))
        ).fetchone()
    return int(row[0]) if row else 0


def verify(source: psycopg.Connection[Any], target: psycopg.Connection[Any], plan: MovePlan) -> Verification:
    """Compare both sides (the old owner is fenced, so its side no longer changes)."""
    return Verification(digests(source, plan), digests(target, plan), unbalanced_accounts(target, plan))


def rows_in_range(conn: psycopg.Connection[Any], plan: MovePlan) -> dict[str, int]:
    """Row counts of the plan's slots, table by table (progress, and the target's emptiness)."""
    counts: dict[str, int] = {}
    with conn.transaction():
        for table in FENCED_TABLES:
            row = conn.execute(
                sql.SQL("SELECT count(*) FROM {} t WHERE {}").format(
                    sql.Identifier(table), sql.SQL(plan.row_filter("t.account_hash"))
                )
            ).fetchone()
            counts[table] = int(row[0]) if row else 0
    return counts


__all__ = ["TableDigest", "Verification", "digests", "rows_in_range", "unbalanced_accounts", "verify"]
