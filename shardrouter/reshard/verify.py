"""Verification of a move before the old rows are deleted: the moved rows on the new owner equal
the old owner's, table by table and account by account, and every moved account's balance is the
sum of its ledger, on both sides.

A table's digest is its row count and an order-independent checksum (the sum of a 60-bit slice
of each row's md5 over its whole text, stored responses included), slot by slot, so a mismatch
names the slots it is in; taken with the same session
settings on both sides so a row prints the same wherever it is. Each side is read in one snapshot
(one REPEATABLE READ transaction per side): its digests, every moved account's balance and ledger
sum, and the rows of the accounts a difference names, so what the report shows of one side is one
moment of it. The accounts are compared across the sides one by one (both read in id order), and
every account named is shown as both sides hold it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from shardrouter.reshard.plan import MovePlan
from shardrouter.reshard.replication import SubscriberState
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
    """One ledger entry of an account the report names."""

    kind: str
    amount_minor: int
    transfer_id: str | None


@dataclass(frozen=True)
class UnbalancedAccount:
    """A moved account as one side holds it: its balance, the sum of its ledger, and its latest
    entries (newest first, up to `ENTRIES_SHOWN`; `entry_count` counts them all, `foreign_hash`
    those whose routing hash is not the account's, which a move would leave behind). Named so for
    the accounts whose balance is not their ledger's sum; verification shows any account this way."""

    account_id: str
    balance: int
    ledger_sum: int
    entry_count: int
    entries: tuple[LedgerEntry, ...]
    foreign_hash: int = 0

    def describe(self, *, with_id: bool = True) -> str:
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
        off = f" (off by {self.balance - self.ledger_sum})" if self.balance != self.ledger_sum else ""
        return (
            (f"{self.account_id}: " if with_id else "")
            + f"balance {self.balance}, ledger sum {self.ledger_sum}{off}, {self.entry_count} entries"
            + f"{foreign}, newest first: [{shown}{more}]"
        )


#: How many accounts of each kind (unbalanced on either side, different across them) a
#: verification names, and how many entries of each it shows.
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
class AccountSides:
    """One account a verification names, as each side holds it (None: not there)."""

    account_id: str
    source: UnbalancedAccount | None
    target: UnbalancedAccount | None

    def describe(self) -> str:
        """Both sides in words."""

        def side(account: UnbalancedAccount | None) -> str:
            return "no such account" if account is None else account.describe(with_id=False)

        return f"{self.account_id}: old owner {side(self.source)}; new owner {side(self.target)}"


@dataclass(frozen=True)
class Verification:
    """The comparison of both sides; `problems` is empty when the move may commit."""

    source: dict[str, TableDigest]
    target: dict[str, TableDigest]
    #: The moved accounts unbalanced on the new owner.
    unbalanced: Unbalanced
    #: The same on the old owner (None: not looked at).
    unbalanced_at_source: Unbalanced | None = None
    #: How many moved accounts differ between the sides (balance, ledger sum, entries, presence).
    differing: int = 0
    #: The accounts named (unbalanced on either side, or different across them), both sides each.
    named: tuple[AccountSides, ...] = ()
    #: What the subscription said of itself, still, and what is wrong with it.
    subscriber: SubscriberState | None = None
    subscriber_problems: tuple[str, ...] = field(default=())

    @property
    def unbalanced_accounts(self) -> int:
        """How many moved accounts are unbalanced on the new owner."""
        return self.unbalanced.count

    @property
    def problems(self) -> list[str]:
        """Each difference, in words."""
        found = list(self.subscriber_problems)
        found += [
            f"{t}: {self.source[t].rows} rows (checksum {self.source[t].checksum}) on the old owner, "
            f"{self.target[t].rows} (checksum {self.target[t].checksum}) on the new; slots that differ: "
            + _some(self.source[t].slots_that_differ(self.target[t]))
            for t in FENCED_TABLES
            if self.source[t] != self.target[t]
        ]
        at_source = self.unbalanced_at_source
        if self.unbalanced or at_source:
            found.append(
                f"{self.unbalanced.count} moved account(s) whose balance is not the sum of their ledger"
                + ("" if self.named else _named(self.unbalanced))
                + ("" if at_source is None else f"; on the old owner {at_source.count}")
                + ("" if self.named or at_source is None else _named(at_source))
            )
        if self.differing:
            found.append(f"{self.differing} moved account(s) differ between the old owner and the new")
        if self.named and (self.unbalanced or at_source or self.differing):
            found.append("the accounts, both sides: " + " | ".join(a.describe() for a in self.named))
        return found

    @property
    def rows(self) -> int:
        """Rows moved, all tables."""
        return sum(d.rows for d in self.target.values())


@contextmanager
def snapshot(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """One REPEATABLE READ transaction on `conn` (every read in it sees one moment), with the
    session settings that make a row print the same on every server."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SET LOCAL TimeZone = 'UTC'")
        conn.execute("SET LOCAL DateStyle = 'ISO, YMD'")
        conn.execute("SET LOCAL IntervalStyle = 'postgres'")
        conn.execute("SET LOCAL bytea_output = 'hex'")
        yield


def digests(conn: psycopg.Connection[Any], plan: MovePlan) -> dict[str, TableDigest]:
    """The digest of every moved table's rows in the plan's slots, in one snapshot."""
    with snapshot(conn):
        return digests_now(conn, plan)


def digests_now(conn: psycopg.Connection[Any], plan: MovePlan) -> dict[str, TableDigest]:
    """The same, read in the transaction `conn` is in (opened by `snapshot`)."""
    out: dict[str, TableDigest] = {}
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


#: Every moved account with its balance, ledger sum, entries and entries of another routing hash.
_ACCOUNTS = (
    "SELECT a.id, a.balance, s.total, s.entries, s.foreign_hash FROM accounts a"
    " CROSS JOIN LATERAL (SELECT coalesce(sum(l.amount_minor), 0) AS total, count(*) AS entries,"
    "  count(*) FILTER (WHERE l.account_hash <> a.account_hash) AS foreign_hash"
    "  FROM ledger_entries l WHERE l.account_id = a.id) s WHERE {}"
)

#: An account's figures as `_ACCOUNTS` reads them: balance, ledger sum, entries, foreign entries.
_Figures = tuple[int, int, int, int]


def _account_rows(conn: psycopg.Connection[Any], plan: MovePlan, name: str) -> Iterator[tuple[str, _Figures]]:
    """Every moved account, in byte order of its id, read through a server-side cursor (the range
    may hold millions) in the transaction `conn` is in."""
    query = sql.SQL(_ACCOUNTS + ' ORDER BY a.id COLLATE "C"').format(
        sql.SQL(plan.row_filter("a.account_hash"))
    )
    with conn.cursor(name=name) as cur:
        cur.itersize = 5000
        cur.execute(query)
        for account_id, balance, total, entries, foreign in cur:
            yield str(account_id), (int(balance), int(total), int(entries), int(foreign))


@dataclass
class _Comparison:
    """The account-by-account comparison: counts, and the ids to name (a few of each kind)."""

    unbalanced_target: int = 0
    unbalanced_source: int = 0
    differing: int = 0
    named: dict[str, None] = field(default_factory=dict)
    _shown: dict[str, int] = field(default_factory=dict)

    def note(self, kind: str, account_id: str) -> None:
        if self._shown.get(kind, 0) < ACCOUNTS_SHOWN:
            self._shown[kind] = self._shown.get(kind, 0) + 1
            self.named[account_id] = None

    def add(self, account_id: str, source: _Figures | None, target: _Figures | None) -> None:
        if source is not None and source[0] != source[1]:
            self.unbalanced_source += 1
            self.note("source", account_id)
        if target is not None and target[0] != target[1]:
            self.unbalanced_target += 1
            self.note("target", account_id)
        if source != target:
            self.differing += 1
            self.note("differing", account_id)


def _compare_accounts(
    source: psycopg.Connection[Any], target: psycopg.Connection[Any], plan: MovePlan
) -> _Comparison:
    """Both sides' moved accounts, merged by id (each side in its open snapshot)."""
    found = _Comparison()
    ours = _account_rows(source, plan, "verify_source_accounts")
    theirs = _account_rows(target, plan, "verify_target_accounts")
    a, b = next(ours, None), next(theirs, None)
    while a is not None or b is not None:
        if b is None or (a is not None and a[0].encode() < b[0].encode()):
            assert a is not None
            found.add(a[0], a[1], None)
            a = next(ours, None)
        elif a is None or b[0].encode() < a[0].encode():
            found.add(b[0], None, b[1])
            b = next(theirs, None)
        else:
            found.add(a[0], a[1], b[1])
            a, b = next(ours, None), next(theirs, None)
    return found


def _pictures(conn: psycopg.Connection[Any], plan: MovePlan, ids: list[str]) -> dict[str, UnbalancedAccount]:
    """The named accounts as this side holds them, with their latest entries (in its open snapshot)."""
    if not ids:
        return {}
    rows = conn.execute(
        # The filter's `%` is an operator, not a placeholder, in a query that has parameters.
        sql.SQL(_ACCOUNTS + " AND a.id = ANY(%s)").format(
            sql.SQL(plan.row_filter("a.account_hash").replace("%", "%%"))
        ),
        (ids,),
    ).fetchall()
    out = {}
    for account_id, balance, total, count, foreign in rows:
        entries = conn.execute(
            "SELECT kind, amount_minor, transfer_id FROM ledger_entries WHERE account_id = %s"
            " ORDER BY created_at DESC, id DESC LIMIT %s",
            (account_id, ENTRIES_SHOWN),
        ).fetchall()
        out[str(account_id)] = UnbalancedAccount(
            str(account_id),
            int(balance),
            int(total),
            int(count),
            tuple(LedgerEntry(str(k), int(a), None if t is None else str(t)) for k, a, t in entries),
            int(foreign),
        )
    return out


def unbalanced_accounts(conn: psycopg.Connection[Any], plan: MovePlan) -> Unbalanced:
    """Moved accounts whose balance differs from the sum of their ledger entries: how many, and the
    first `ACCOUNTS_SHOWN` of them (by id) with their entries, read in one snapshot."""
    with snapshot(conn):
        rows = conn.execute(
            sql.SQL(_ACCOUNTS + " AND a.balance <> s.total ORDER BY a.id").format(
                sql.SQL(plan.row_filter("a.account_hash"))
            )
        ).fetchall()
        named = _pictures(conn, plan, [str(r[0]) for r in rows[:ACCOUNTS_SHOWN]])
    return Unbalanced(len(rows), tuple(named[str(r[0])] for r in rows[:ACCOUNTS_SHOWN]))


def verify(
    source: psycopg.Connection[Any],
    target: psycopg.Connection[Any],
    plan: MovePlan,
    *,
    subscriber: SubscriberState | None = None,
    subscriber_problems: tuple[str, ...] = (),
) -> Verification:
    """Compare both sides, each in one snapshot (the old owner is fenced and the subscription
    stopped, so neither changes): the table digests, and the moved accounts one by one; every
    account named (unbalanced on either side, or different across them) is read on both sides."""
    with snapshot(source), snapshot(target):
        on_source, on_target = digests_now(source, plan), digests_now(target, plan)
        found = _compare_accounts(source, target, plan)
        ids = list(found.named)
        at_source, at_target = _pictures(source, plan, ids), _pictures(target, plan, ids)
    named = tuple(AccountSides(i, at_source.get(i), at_target.get(i)) for i in ids)

    def unbalanced(count: int, side: dict[str, UnbalancedAccount]) -> Unbalanced:
        some = tuple(a for a in side.values() if a.balance != a.ledger_sum)[:ACCOUNTS_SHOWN]
        return Unbalanced(count, some)

    return Verification(
        on_source,
        on_target,
        unbalanced(found.unbalanced_target, at_target),
        unbalanced(found.unbalanced_source, at_source),
        found.differing,
        named,
        subscriber,
        subscriber_problems,
    )


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
    "AccountSides",
    "LedgerEntry",
    "TableDigest",
    "Unbalanced",
    "UnbalancedAccount",
    "Verification",
    "digests",
    "digests_now",
    "rows_in_range",
    "snapshot",
    "unbalanced_accounts",
    "verify",
]
