"""What one shard's database says: its transfers, outbox rows, dead letters, the ledger legs of
transfers, its accounts' balances against their ledgers, and the keys it holds outcomes of.

Every read goes through the shard daemon's own stores (`shardd.ledger.store` and `.reads`,
`shardd.idempotency.store`), in their row types: reconcile compares what the daemons wrote with the
daemons' own queries. Each shard is read in one REPEATABLE READ, READ ONLY transaction (one snapshot
per shard; the shards are read one after another, so `check` reads everything twice and keeps only
what both reads show).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

import psycopg

from shardrouter.core.keys import derived_key, parse_key
from shardrouter.core.moves import ACTIVE_PHASES
from shardrouter.shardd.idempotency import store as idempotency_store
from shardrouter.shardd.idempotency.record import RecordState
from shardrouter.shardd.ledger import reads, store
from shardrouter.shardd.ledger.reads import TransferEntryRow, UnbalancedAccountRow
from shardrouter.shardd.ledger.service import credit_key, refund_key
from shardrouter.shardd.ledger.store import DeadLetterRow, OutboxRow, TransferRow

Connection = psycopg.Connection[Any]


def reversal_key(transfer_id: uuid.UUID) -> uuid.UUID:
    """The key of the entry `reconcile --reverse-orphan-credits` writes to take back a credit whose
    debit no shard holds (derived like the credit's and the refund's: one key per transfer)."""
    return derived_key(transfer_id, "reversal")


R = TypeVar("R")


@dataclass(frozen=True)
class OnShard(Generic[R]):
    """A row of the ledger, and the shard whose database holds it (a transfer's rows are spread
    over shards, and a restore can leave copies of one on two)."""

    shard: str
    row: R


def is_reversal(entry: TransferEntryRow) -> bool:
    """A `transfer_out` written by `--reverse-orphan-credits`, not a transfer's debit."""
    return entry.kind == "transfer_out" and entry.idempotency_key == str(reversal_key(entry.transfer_id))


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
    """Everything read from one shard, as its ledger's rows."""

    shard: str
    transfers: list[TransferRow] = field(default_factory=list)
    outbox: list[OutboxRow] = field(default_factory=list)
    dead_letters: list[DeadLetterRow] = field(default_factory=list)
    #: The ledger entries of transfers (debits, credits, refunds, reversals).
    legs: list[TransferEntryRow] = field(default_factory=list)
    unbalanced: list[UnbalancedAccountRow] = field(default_factory=list)
    #: currency -> (sum of balances, accounts)
    balances: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: currency -> sum of deposits
    deposits: dict[str, int] = field(default_factory=dict)
    #: Moves journaled on this shard that have not finished: (move id, phase).
    active_moves: list[tuple[str, str]] = field(default_factory=list)


def read_shard(conn: Connection, shard: str, transfer_ids: Iterable[uuid.UUID] | None = None) -> ShardFacts:
    """One shard's facts in one snapshot: every transfer's (or only those of `transfer_ids`)."""
    ids = None if transfer_ids is None else sorted(set(transfer_ids))
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        return ShardFacts(
            shard,
            transfers=store.list_transfers(conn, ids),
            outbox=store.list_outbox(conn, ids),
            dead_letters=store.list_dead_letters(conn, transfer_ids=ids),
            legs=reads.transfer_entries(conn, ids),
            unbalanced=reads.accounts_off_ledger(conn),
            balances=reads.balances_by_currency(conn),
            deposits=reads.deposits_by_currency(conn),
            active_moves=_active_moves(conn),
        )


def _active_moves(conn: Connection) -> list[tuple[str, str]]:
    """The moves journaled here that have not finished. The journal (`slot_moves`) is `reshard`'s,
    which reconcile may not import, and the daemon's reader of it (`observability.read_moves`) also
    asks for the replication slots' lag from the WAL position, which a standby refuses: so this one
    statement stays here."""
    rows = conn.execute("SELECT move_id, phase FROM slot_moves ORDER BY created_at").fetchall()
    return [(str(move_id), str(phase)) for move_id, phase in rows if phase in ACTIVE_PHASES]


def transfers_since(conn: Connection, since: datetime) -> set[uuid.UUID]:
    """The transfers of this shard made, or with a ledger leg written, at or after `since`."""
    with conn.transaction():
        return reads.transfers_touched_since(conn, since)


def follow_up_records(conn: Connection, shard: str, transfer_ids: Iterable[uuid.UUID]) -> list[KeyRecord]:
    """This shard's stored outcomes of the credit (or void) and refund keys of `transfer_ids`."""
    keys = [parse_key(str(f(t))) for t in transfer_ids for f in (credit_key, refund_key)]
    # A follow-up key is a UUIDv7 with its transfer's time: its record's partition is known.
    dated = [(k.text, k.dated_at) for k in keys if k.dated_at is not None]
    with conn.transaction():
        records = idempotency_store.find_keys(conn, dated)
    return [
        KeyRecord(shard, r.key, r.scope, r.method, r.outcome.code if r.outcome is not None else None)
        for r in records
        if r.state is RecordState.COMPLETED
    ]


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
    "KeyRecord",
    "OnShard",
    "ShardFacts",
    "connect",
    "follow_up_records",
    "is_reversal",
    "read_all",
    "read_shard",
    "reversal_key",
    "transfers_since",
]
