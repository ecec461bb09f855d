"""What one shard's database says: its transfers, outbox rows, dead letters, the ledger legs of
transfers, its accounts' balances against their ledgers, and the keys it holds outcomes of.

Each shard is read in one REPEATABLE READ, READ ONLY transaction (one snapshot per shard; the shards
are read one after another, so `check` reads everything twice and keeps only what both reads show).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from shardrouter.core.keys import derived_key, parse_key
from shardrouter.core.moves import ACTIVE_PHASES
from shardrouter.shardd.ledger.service import credit_key, refund_key

Connection = psycopg.Connection[Any]


def reversal_key(transfer_id: uuid.UUID) -> uuid.UUID:
    """The key of the entry `reconcile --reverse-orphan-credits` writes to take back a credit whose
    debit no shard holds (derived like the credit's and the refund's: one key per transfer)."""
    return derived_key(transfer_id, "reversal")


@dataclass(frozen=True)
class Transfer:
    """A transfer row (it lives on its source account's shard)."""

    shard: str
    id: uuid.UUID
    source_account_id: str
    destination_account_id: str
    destination_shard_id: str
    amount_minor: int
    currency: str
    state: str
    created_at: datetime


@dataclass(frozen=True)
class Outbox:
    """A queued cross-shard credit on the source shard."""

    shard: str
    id: int
    transfer_id: uuid.UUID
    destination_shard_id: str
    idempotency_key: str
    attempts: int
    created_at: datetime
    delivered_at: datetime | None
    dead_lettered_at: datetime | None
    last_error: str | None

    @property
    def state(self) -> str:
        """delivered, dead_lettered or pending."""
        if self.delivered_at is not None:
            return "delivered"
        return "dead_lettered" if self.dead_lettered_at is not None else "pending"


@dataclass(frozen=True)
class DeadLetter:
    """A credit that failed for good, and whether its refund is recorded."""

    shard: str
    transfer_id: uuid.UUID
    outbox_id: int
    refund_key: str
    reason: str
    created_at: datetime
    refunded_at: datetime | None


@dataclass(frozen=True)
class Leg:
    """One ledger entry of a transfer: `transfer_out` (the debit), `transfer_in` (the credit) or
    `refund`."""

    shard: str
    entry_id: uuid.UUID
    transfer_id: uuid.UUID
    kind: str
    account_id: str
    amount_minor: int
    currency: str
    idempotency_key: str
    created_at: datetime

    @property
    def is_reversal(self) -> bool:
        """A `transfer_out` written by `--reverse-orphan-credits`, not a transfer's debit."""
        return self.kind == "transfer_out" and self.idempotency_key == str(reversal_key(self.transfer_id))


@dataclass(frozen=True)
class Unbalanced:
    """An account whose balance is not the sum of its ledger."""

    shard: str
    account_id: str
    currency: str
    balance: int
    ledger: int


@dataclass(frozen=True)
class KeyRecord:
    """A stored outcome of a follow-up key (a credit's, a void's or a refund's)."""

    shard: str
    key: str
    scope: str
    method: str
    status_code: int | None


@dataclass
class ShardFacts:
    """Everything read from one shard."""

    shard: str
    transfers: list[Transfer] = field(default_factory=list)
    outbox: list[Outbox] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    legs: list[Leg] = field(default_factory=list)
    unbalanced: list[Unbalanced] = field(default_factory=list)
    #: currency -> (sum of balances, accounts)
    balances: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: currency -> sum of deposits
    deposits: dict[str, int] = field(default_factory=dict)
    #: Moves journaled on this shard that have not finished: (move id, phase).
    active_moves: list[tuple[str, str]] = field(default_factory=list)


def read_shard(conn: Connection, shard: str, transfer_ids: Iterable[uuid.UUID] | None = None) -> ShardFacts:
    """One shard's facts in one snapshot: every transfer's (or only those of `transfer_ids`)."""
    facts = ShardFacts(shard)
    ids = None if transfer_ids is None else sorted(set(transfer_ids))
    only = "" if ids is None else " WHERE {col} = ANY(%(ids)s)"
    params: dict[str, object] = {} if ids is None else {"ids": ids}
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        with conn.cursor(row_factory=dict_row) as cur:
            for r in cur.execute(
                "SELECT id, source_account_id, destination_account_id, destination_shard_id, amount_minor,"
                " currency, state, created_at FROM transfers" + only.format(col="id"),
                params,
            ):
                facts.transfers.append(Transfer(shard=shard, **r))
            for r in cur.execute(
                "SELECT id, transfer_id, destination_shard_id, idempotency_key, attempts, created_at,"
                " delivered_at, dead_lettered_at, last_error FROM outbox" + only.format(col="transfer_id"),
                params,
            ):
                facts.outbox.append(Outbox(shard=shard, **r))
            for r in cur.execute(
                "SELECT transfer_id, outbox_id, refund_key, reason, created_at, refunded_at FROM dead_letters"
                + only.format(col="transfer_id"),
                params,
            ):
                facts.dead_letters.append(DeadLetter(shard=shard, **r))
            for r in cur.execute(
                "SELECT l.id AS entry_id, l.transfer_id, l.kind, l.account_id, l.amount_minor,"
                " a.currency::text AS currency, l.idempotency_key, l.created_at"
                " FROM ledger_entries l JOIN accounts a ON a.id = l.account_id"
                + (
                    " WHERE l.transfer_id IS NOT NULL"
                    if ids is None
                    else " WHERE l.transfer_id = ANY(%(ids)s)"
                ),
                params,
            ):
                facts.legs.append(Leg(shard=shard, **r))
            for r in cur.execute(
                "SELECT a.id AS account_id, a.currency::text AS currency, a.balance,"
                " coalesce(s.total, 0)::bigint AS ledger FROM accounts a"
                " LEFT JOIN (SELECT account_id, sum(amount_minor) AS total FROM ledger_entries GROUP BY 1) s"
                " ON s.account_id = a.id WHERE a.balance <> coalesce(s.total, 0) ORDER BY a.id"
            ):
                facts.unbalanced.append(Unbalanced(shard=shard, **r))
            for r in cur.execute(
                "SELECT currency::text AS currency, sum(balance)::bigint AS total, count(*) AS n"
                " FROM accounts GROUP BY 1"
            ):
                facts.balances[r["currency"]] = (int(r["total"]), int(r["n"]))
            for r in cur.execute(
                "SELECT a.currency::text AS currency, sum(l.amount_minor)::bigint AS total"
                " FROM ledger_entries l JOIN accounts a ON a.id = l.account_id WHERE l.kind = 'deposit'"
                " GROUP BY 1"
            ):
                facts.deposits[r["currency"]] = int(r["total"])
            for r in cur.execute("SELECT move_id, phase FROM slot_moves ORDER BY created_at"):
                if r["phase"] in ACTIVE_PHASES:
                    facts.active_moves.append((r["move_id"], r["phase"]))
    return facts


def transfers_since(conn: Connection, since: datetime) -> set[uuid.UUID]:
    """The transfers of this shard made, or with a ledger leg written, at or after `since`."""
    with conn.transaction():
        rows = conn.execute(
            "SELECT id FROM transfers WHERE created_at >= %(t)s UNION"
            " SELECT transfer_id FROM ledger_entries WHERE transfer_id IS NOT NULL AND created_at >= %(t)s"
            " UNION SELECT transfer_id FROM outbox WHERE delivered_at >= %(t)s OR dead_lettered_at >= %(t)s"
            " UNION SELECT transfer_id FROM dead_letters WHERE created_at >= %(t)s OR refunded_at >= %(t)s",
            {"t": since},
        ).fetchall()
    return {r[0] for r in rows}


def follow_up_records(conn: Connection, shard: str, transfer_ids: Iterable[uuid.UUID]) -> list[KeyRecord]:
    """This shard's stored outcomes of the credit (or void) and refund keys of `transfer_ids`."""
    keys = [parse_key(str(f(t))) for t in transfer_ids for f in (credit_key, refund_key)]
    if not keys:
        return []
    # A follow-up key is a UUIDv7 with its transfer's time: its record's partition is known.
    times = sorted({k.dated_at for k in keys if k.dated_at is not None})
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT key, scope, method, status_code FROM idempotency_record"
            " WHERE key = ANY(%s) AND key_time = ANY(%s) AND state = 'completed'",
            ([k.text for k in keys], times),
        ).fetchall()
    return [KeyRecord(shard=shard, **r) for r in rows]


def connect(dsn: str) -> Connection:
    """An autocommit-off connection for reading and repairing (a short connect timeout)."""
    return psycopg.connect(dsn, connect_timeout=10)


def read_all(dsns: Mapping[str, str], since: datetime | None = None) -> dict[str, ShardFacts]:
    """Every shard's facts (with `since`: of the transfers any shard touched since then)."""
    with contextlib.ExitStack() as stack:
        conns: dict[str, Connection] = {}
        for shard, dsn in dsns.items():
            try:
                conns[shard] = stack.enter_context(connect(dsn))
            except psycopg.OperationalError as exc:
                reason = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
                raise psycopg.OperationalError(f"{shard}: {reason}") from exc
        ids: set[uuid.UUID] | None = None
        if since is not None:
            ids = set()
            for conn in conns.values():
                ids |= transfers_since(conn, since)
        return {shard: read_shard(conn, shard, ids) for shard, conn in conns.items()}


__all__ = [
    "DeadLetter",
    "KeyRecord",
    "Leg",
    "Outbox",
    "ShardFacts",
    "Transfer",
    "Unbalanced",
    "connect",
    "follow_up_records",
    "read_all",
    "read_shard",
    "reversal_key",
    "transfers_since",
]
