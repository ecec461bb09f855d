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
class LedgerEntry:
    """One ledger entry of an unbalanced account, as the report shows it."""

    kind: str
    amount_minor: int
    transfer_id: str | None


@dataclass(frozen=True)
class UnbalancedAccount:
    """A moved account whose balance differs from the sum of its ledger, with its latest entries
    (newest first, up to `ENTRIES_SHOWN`; `entry_count` counts them all, `foreign_hash` those whose
    routing hash is not the account's, which a move would leave behind)."""

    account_id: str
    balance: int
    ledger_sum: int
    entry_count: int
    entries: tuple[LedgerEntry, ...]
    foreign_hash: int = 0

    def describe(self) -> str:
        """The account in words: balance, ledger sum, entries."""
        shown = ", ".join(
            f"{e.kind} {e.amount_minor}" + (f" (transfer {e.transfer_id})" if e.transfer_id else "")
            for e in self.entries
        )
        more = (
            f", and {self.entry_count - len(self.entries)} more"
            if self.entry_count > len(self.entries)
            else ""
        )
        foreign = f", {self.foreign_hash} of them with another account_hash" if self.foreign_hash else ""
        return (
            f"{self.account_id}: balance {self.balance}, ledger sum {self.ledger_sum} "
            f"(off by {self.balance - self.ledger_sum}), {self.entry_count} entries{foreign}, "
            f"newest first: [{shown}{more}]"
        )


#: How many unbalanced accounts a verification names, and how many entries of each it shows.
ACCOUNTS_SHOWN = 3
ENTRIES_SHOWN = 12


@dataclass(frozen=True)
class Unbalanced:
    """The moved accounts whose balance is not the sum of their ledger: how many, and a few of them."""

    count: int
    some: tuple[UnbalancedAccount, ...] = ()

    def __bool__(self) -> bool:
        return self.count > 0


@dataclass(frozen=True)
class Verification:
    """The comparison of both sides; `problems` is empty when the move may commit."""

    source: dict[str, TableDigest]
    target: dict[str, TableDigest]
    unbalanced: Unbalanced
    #: The same look at the old owner's rows, taken only when the new owner's are unbalanced: whether
    #: the old owner committed the inconsistency or it arose on the way.
    unbalanced_at_source: Unbalanced | None = None

    @property
    def unbalanced_accounts(self) -> int:
        """How many moved accounts are unbalanced on the new owner."""
        return self.unbalanced.count

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
        if self.unbalanced:
            found.append(
                f"{self.unbalanced.count} moved account(s) whose balance is not the sum of their ledger"
                + _named(self.unbalanced)
                + (
                    ""
                    if self.unbalanced_at_source is None
                    else f"; on the old owner {self.unbalanced_at_source.count}"
                    + _named(self.unbalanced_at_source)
                )
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


def _named(unbalanced: Unbalanced) -> str:
    """The accounts an `Unbalanced` names, in words (in parentheses; empty when it names none)."""
    if not unbalanced.some:
        return ""
    more = unbalanced.count - len(unbalanced.some)
    return (
        " ("
        + "; ".join(a.describe() for a in unbalanced.some)
        + (f"; and {more} more" if more > 0 else "")
        + ")"
    )


def _some(slots: list[int], shown: int = 8) -> str:
    more = f" and {len(slots) - shown} more" if len(slots) > shown else ""
    return ", ".join(str(s) for s in slots[:shown]) + more


def unbalanced_accounts(conn: psycopg.Connection[Any], plan: MovePlan) -> Unbalanced:
    """Moved accounts whose balance differs from the sum of their ledger entries: how many, and the
    first `ACCOUNTS_SHOWN` of them (by id) with their entries, read in one snapshot."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        rows = conn.execute(
            sql.SQL(
                "SELECT a.id, a.balance, s.total, s.entries, s.foreign_hash FROM accounts a"
                " CROSS JOIN LATERAL (SELECT coalesce(sum(l.amount_minor), 0) AS total, count(*) AS entries,"
                "  count(*) FILTER (WHERE l.account_hash <> a.account_hash) AS foreign_hash"
                "  FROM ledger_entries l WHERE l.account_id = a.id) s"
                " WHERE {} AND a.balance <> s.total ORDER BY a.id"
            ).format(sql.SQL(plan.row_filter("a.account_hash")))
        ).fetchall()
        some = []
        for account_id, balance, total, count, foreign in rows[:ACCOUNTS_SHOWN]:
            entries = conn.execute(
                "SELECT kind, amount_minor, transfer_id FROM ledger_entries WHERE account_id = %s"
                " ORDER BY created_at DESC, id DESC LIMIT %s",
                (account_id, ENTRIES_SHOWN),
            ).fetchall()
            some.append(
                UnbalancedAccount(
                    str(account_id),
                    int(balance),
                    int(total),
                    int(count),
                    tuple(LedgerEntry(str(k), int(a), None if t is None else str(t)) for k, a, t in entries),
                    int(foreign),
                )
            )
    return Unbalanced(len(rows), tuple(some))


def verify(source: psycopg.Connection[Any], target: psycopg.Connection[Any], plan: MovePlan) -> Verification:
    """Compare both sides (the old owner is fenced, so its side no longer changes). Unbalanced
    accounts on the new owner are looked for on the old owner too, to say where they come from."""
    on_source, on_target = digests(source, plan), digests(target, plan)
    unbalanced = unbalanced_accounts(target, plan)
    at_source = unbalanced_accounts(source, plan) if unbalanced else None
    return Verification(on_source, on_target, unbalanced, at_source)


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


__all__ = [
    "ACCOUNTS_SHOWN",
    "ENTRIES_SHOWN",
    "LedgerEntry",
    "TableDigest",
    "Unbalanced",
    "UnbalancedAccount",
    "Verification",
    "digests",
    "rows_in_range",
    "unbalanced_accounts",
    "verify",
]
