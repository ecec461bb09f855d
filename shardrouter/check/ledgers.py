"""What the shard databases say about the checker's accounts: their balances, every ledger entry on
them, the transfers those entries belong to, and which accounts are off their ledger.

Read through the ledger's own store functions and row types (`shardd.ledger.store` and `.reads`), each
shard in one REPEATABLE READ, READ ONLY transaction; no SQL of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

from shardrouter.shardd.ledger import reads, store
from shardrouter.shardd.ledger.reads import UnbalancedAccountRow
from shardrouter.shardd.ledger.store import AccountRow, TransferRow

Connection = psycopg.Connection[Any]


@dataclass(frozen=True)
class EntryRow:
    """A ledger entry of one of the checker's accounts, and the shard whose database holds it."""

    shard: str
    id: uuid.UUID
    account_id: str
    amount_minor: int
    kind: str
    transfer_id: uuid.UUID | None
    idempotency_key: str


@dataclass
class Ledgers:
    """Every shard's word on the checker's accounts, read at one moment per shard."""

    entries: list[EntryRow] = field(default_factory=list)
    #: account -> (shard, row) for each shard that holds the account.
    accounts: dict[str, list[tuple[str, AccountRow]]] = field(default_factory=dict)
    #: transfer id -> (shard, row) for each shard that holds the transfer.
    transfers: dict[uuid.UUID, list[tuple[str, TransferRow]]] = field(default_factory=dict)
    #: The checker's accounts whose balance is not the sum of their ledger, with their shard.
    off_ledger: list[tuple[str, UnbalancedAccountRow]] = field(default_factory=list)

    def balance(self, account: str) -> int:
        """The account's balance: 0 if no shard holds it; one copy's if every shard that holds it holds
        the same (a move copies an account before the old owner deletes it); else their sum, which the
        proofs then report."""
        balances = [row.balance for _, row in self.accounts.get(account, [])]
        return balances[0] if len(set(balances)) == 1 else sum(balances)


def _entries_of(conn: Connection, shard: str, accounts: Collection[str]) -> list[EntryRow]:
    return [EntryRow(shard=shard, **dataclasses.asdict(e)) for e in reads.account_entries(conn, accounts)]


def _read_shard(conn: Connection, shard: str, accounts: Collection[str], into: Ledgers) -> None:
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        entries = _entries_of(conn, shard, accounts)
        # An entry another shard holds too (same id) is a move's copy, not a second effect.
        seen = {e.id for e in into.entries}
        into.entries += [e for e in entries if e.id not in seen]
        for account in sorted(accounts):
            row = store.read_account(conn, account)
            if row is not None:
                into.accounts.setdefault(account, []).append((shard, row))
        ids = sorted({e.transfer_id for e in entries if e.transfer_id is not None})
        for transfer in store.list_transfers(conn, ids):
            into.transfers.setdefault(transfer.id, []).append((shard, transfer))
        into.off_ledger += [(shard, r) for r in reads.accounts_off_ledger(conn) if r.account_id in accounts]


def read_ledgers(dsns: Mapping[str, str], accounts: Collection[str]) -> Ledgers:
    """Every shard's entries, balances and transfers of `accounts` (one snapshot per shard, the
    shards one after another)."""
    ledgers = Ledgers()
    with contextlib.ExitStack() as stack:
        for shard, dsn in sorted(dsns.items()):
            conn = stack.enter_context(_connect(shard, dsn))
            _read_shard(conn, shard, accounts, ledgers)
    return ledgers


def owners(dsns: Mapping[str, str], accounts: Collection[str]) -> dict[str, str]:
    """account -> the shard whose database holds it (accounts no shard holds are left out)."""
    found: dict[str, str] = {}
    for shard, dsn in sorted(dsns.items()):
        with _connect(shard, dsn) as conn, conn.transaction():
            for account in accounts:
                if store.read_account(conn, account) is not None:
                    found[account] = shard
    return found


def _connect(shard: str, dsn: str) -> Connection:
    try:
        return psycopg.connect(dsn, connect_timeout=10)
    except psycopg.OperationalError as exc:
        reason = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
        raise psycopg.OperationalError(f"{shard}: {reason}") from exc


__all__ = ["EntryRow", "Ledgers", "owners", "read_ledgers"]
