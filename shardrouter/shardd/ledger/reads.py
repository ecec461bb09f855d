"""Reads of a shard's ledger as a whole: the entries of its transfers or of a set of accounts, the
accounts whose balance is not the sum of their ledger, the money per currency, and which transfers changed since a time.

The daemon's own handlers never need these (they read one row at a time, in `store`); a comparison
of several shards' databases does (`shard-router reconcile`, `shard-router check`). They live here so that every SQL
statement on the ledger's tables is the ledger's, and a schema change finds them all in one package.
Like `store`, they take the caller's connection and never commit: the caller picks the snapshot.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from psycopg.rows import dict_row

from shardrouter.shardd.ledger.store import Connection


@dataclass(frozen=True)
class TransferEntryRow:
    """One ledger entry of a transfer (`transfer_out`, `transfer_in` or `refund`), with the currency
    of its account (an entry has none of its own)."""

    entry_id: uuid.UUID
    transfer_id: uuid.UUID
    kind: str
    account_id: str
    amount_minor: int
    currency: str
    idempotency_key: str
    created_at: datetime


@dataclass(frozen=True)
class UnbalancedAccountRow:
    """An account whose balance is not the sum of its ledger entries."""

    account_id: str
    currency: str
    balance: int
    ledger: int


_ENTRY_SELECT = (
    "SELECT l.id AS entry_id, l.transfer_id, l.kind, l.account_id, l.amount_minor,"
    " a.currency::text AS currency, l.idempotency_key, l.created_at"
    " FROM ledger_entries l JOIN accounts a ON a.id = l.account_id"
)


def transfer_entries(
    conn: Connection, transfer_ids: Sequence[uuid.UUID] | None = None
) -> list[TransferEntryRow]:
    """The entries of every transfer (None), or of those of `transfer_ids`."""
    with conn.cursor(row_factory=dict_row) as cur:
        if transfer_ids is None:
            rows = cur.execute(_ENTRY_SELECT + " WHERE l.transfer_id IS NOT NULL").fetchall()
        else:
            rows = cur.execute(
                _ENTRY_SELECT + " WHERE l.transfer_id = ANY(%s)", (list(transfer_ids),)
            ).fetchall()
    return [TransferEntryRow(**r) for r in rows]


def transfer_entry(conn: Connection, transfer_id: uuid.UUID, kind: str) -> TransferEntryRow | None:
    """A transfer's entry of one kind, if written here (one at most: the ledger's unique index)."""
    with conn.cursor(row_factory=dict_row) as cur:
        r = cur.execute(
            _ENTRY_SELECT + " WHERE l.transfer_id = %s AND l.kind = %s", (transfer_id, kind)
        ).fetchone()
    return None if r is None else TransferEntryRow(**r)


@dataclass(frozen=True)
class AccountEntryRow:
    """One ledger entry of an account, of any kind (a deposit's too, which has no transfer)."""

    id: uuid.UUID
    account_id: str
    amount_minor: int
    kind: str
    transfer_id: uuid.UUID | None
    idempotency_key: str


def account_entries(conn: Connection, account_ids: Collection[str]) -> list[AccountEntryRow]:
    """Every ledger entry of the accounts `account_ids`, whatever its kind."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT id, account_id, amount_minor, kind, transfer_id, idempotency_key"
            " FROM ledger_entries WHERE account_id = ANY(%s)",
            (sorted(account_ids),),
        ).fetchall()
    return [AccountEntryRow(**r) for r in rows]


def accounts_off_ledger(conn: Connection) -> list[UnbalancedAccountRow]:
    """The accounts whose balance differs from the sum of their ledger entries, by id."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT a.id AS account_id, a.currency::text AS currency, a.balance,"
            " coalesce(s.total, 0)::bigint AS ledger FROM accounts a"
            " LEFT JOIN (SELECT account_id, sum(amount_minor) AS total FROM ledger_entries GROUP BY 1) s"
            " ON s.account_id = a.id WHERE a.balance <> coalesce(s.total, 0) ORDER BY a.id"
        ).fetchall()
    return [UnbalancedAccountRow(**r) for r in rows]


def balances_by_currency(conn: Connection) -> dict[str, tuple[int, int]]:
    """Currency -> (the sum of the accounts' balances, how many accounts)."""
    rows = conn.execute(
        "SELECT currency::text, sum(balance)::bigint, count(*) FROM accounts GROUP BY 1"
    ).fetchall()
    return {str(currency): (int(total), int(n)) for currency, total, n in rows}


def deposits_by_currency(conn: Connection) -> dict[str, int]:
    """Currency -> the sum of every deposit entry (the money that came in from outside)."""
    rows = conn.execute(
        "SELECT a.currency::text, sum(l.amount_minor)::bigint"
        " FROM ledger_entries l JOIN accounts a ON a.id = l.account_id WHERE l.kind = 'deposit'"
        " GROUP BY 1"
    ).fetchall()
    return {str(currency): int(total) for currency, total in rows}


def transfers_touched_since(conn: Connection, since: datetime) -> set[uuid.UUID]:
    """The transfers made here, or with an entry, a delivery, a dead letter or a refund recorded
    here, at or after `since`."""
    rows = conn.execute(
        "SELECT id FROM transfers WHERE created_at >= %(t)s UNION"
        " SELECT transfer_id FROM ledger_entries WHERE transfer_id IS NOT NULL AND created_at >= %(t)s"
        " UNION SELECT transfer_id FROM outbox WHERE delivered_at >= %(t)s OR dead_lettered_at >= %(t)s"
        " UNION SELECT transfer_id FROM dead_letters WHERE created_at >= %(t)s OR refunded_at >= %(t)s",
        {"t": since},
    ).fetchall()
    return {r[0] for r in rows}


__all__ = [
    "AccountEntryRow",
    "TransferEntryRow",
    "UnbalancedAccountRow",
    "account_entries",
    "accounts_off_ledger",
    "balances_by_currency",
    "deposits_by_currency",
    "transfer_entries",
    "transfer_entry",
    "transfers_touched_since",
]
