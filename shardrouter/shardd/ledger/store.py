"""Every SQL statement on accounts, ledger entries, transfers, the outbox and dead letters, but for
the reads of the ledger as a whole, which are in `reads`.

Functions take the caller's connection and never commit: the idempotency interceptor owns the
transaction (or, for the repairs of `shard-router reconcile` at the end, the repair's own). Accounts
are locked in id order so two transfers between the same pair cannot deadlock.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from shardrouter.shardd import answer_sql
from shardrouter.shardd.db import bigint
from shardrouter.v1 import transfer_pb2

Connection = psycopg.Connection[Any]


@dataclass(frozen=True)
class AccountRow:
    """An account as stored."""

    id: str
    currency: str
    balance: int
    state: str


@dataclass(frozen=True)
class TransferRow:
    """A transfer as stored on its source shard."""

    id: uuid.UUID
    source_account_id: str
    destination_account_id: str
    destination_shard_id: str
    amount_minor: int
    currency: str
    reference: str
    state: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class AttemptRow:
    """One delivery attempt of a transfer's credit."""

    attempted_at: datetime
    status_code: str
    message: str


@dataclass(frozen=True)
class OutboxRow:
    """A credit to deliver to another shard (the relay claims only undelivered ones)."""

    id: int
    transfer_id: uuid.UUID
    destination_shard_id: str
    idempotency_key: str
    payload: bytes
    attempts: int
    created_at: datetime
    delivered_at: datetime | None = None
    dead_lettered_at: datetime | None = None
    last_error: str | None = None

    @property
    def state(self) -> str:
        """delivered, dead_lettered or pending."""
        if self.delivered_at is not None:
            return "delivered"
        return "dead_lettered" if self.dead_lettered_at is not None else "pending"


@dataclass(frozen=True)
class DeadLetterRow:
    """A transfer whose credit failed for good, and its compensation."""

    transfer_id: uuid.UUID
    outbox_id: int
    reason: str
    refund_key: str
    created_at: datetime
    refunded_at: datetime | None
    replay_count: int
    source_account_id: str
    amount_minor: int
    currency: str


#: A deposit in one statement (`deposit`); `{answer}` adds nothing, or the noted answer's column.
_DEPOSIT = (
    "WITH account AS ("
    " INSERT INTO accounts AS a (id, currency, balance)"
    " SELECT %(id)s, %(currency)s, %(amount)s WHERE %(amount)s <= %(max)s"
    " ON CONFLICT (id) DO UPDATE SET balance = a.balance + excluded.balance"
    " WHERE a.state = 'open' AND a.currency = excluded.currency"
    " AND a.balance + excluded.balance <= %(max)s"
    " RETURNING a.balance),"
    " entry AS ("
    " INSERT INTO ledger_entries (id, account_id, amount_minor, kind, idempotency_key, reference)"
    " SELECT %(entry)s, %(id)s, %(amount)s, 'deposit', %(key)s, %(reference)s FROM account)"
    " SELECT balance{answer} FROM account"
)
_BALANCE_FIELD = transfer_pb2.DepositResponse.DESCRIPTOR.fields_by_name["balance"].number
_AMOUNT_FIELD = transfer_pb2.Money.DESCRIPTOR.fields_by_name["amount_minor"].number


def deposit_answer(balance: str) -> str:
    """A Deposit's answer, its serialised `DepositResponse`, as a bytea expression of `balance` (a
    bigint expression: the balance after it) and two parameters protobuf serialised in Python
    (`deposit_answer_parts`): the fields before the balance, and the balance's after its amount."""
    money = f"{answer_sql.int64_field(_AMOUNT_FIELD, balance)} || %(balance_tail)s::bytea"
    return f"(%(answer_head)s::bytea || {answer_sql.message_field(_BALANCE_FIELD, money)})"


def deposit_answer_parts(entry_id: str, currency: str) -> dict[str, bytes]:
    """The parameters of `deposit_answer`: the entry id's field, and the balance's currency field."""
    return {
        "answer_head": transfer_pb2.DepositResponse(entry_id=entry_id).SerializeToString(),
        "balance_tail": transfer_pb2.Money(currency=currency).SerializeToString(),
    }


_DEPOSIT_FETCHED = _DEPOSIT.format(answer="")
_DEPOSIT_NOTING_ANSWER = _DEPOSIT.format(answer=", " + answer_sql.noting_answer(deposit_answer("balance")))


def deposit(
    conn: Connection,
    *,
    account_id: str,
    currency: str,
    amount_minor: int,
    max_balance: int,
    idempotency_key: str,
    entry_id: uuid.UUID,
    reference: str,
    noting_answer: bool = False,
) -> int | None:
    """A deposit in one statement: open the account with it, or add it to an open account of the same
    currency that stays within `max_balance`, and append its ledger entry. The new balance, or None
    when nothing was written (the account is closed, holds another currency, or would pass the
    limit; the account's row stays locked, so a read in this transaction says which).

    `noting_answer`: the statement is sent without waiting for its result, and notes the call's
    answer (a `DepositResponse` of the entry and the new balance) for the record stored after it in
    this transaction (`answer_sql`), or nothing when it wrote nothing; None is returned."""
    params = {
        "id": account_id,
        "currency": currency,
        "amount": bigint(amount_minor),
        "max": bigint(max_balance),
        "entry": entry_id,
        "key": idempotency_key,
        "reference": reference,
    }
    if noting_answer:
        conn.execute(_DEPOSIT_NOTING_ANSWER, {**params, **deposit_answer_parts(str(entry_id), currency)})
        return None
    row = conn.execute(_DEPOSIT_FETCHED, params).fetchone()
    return None if row is None else int(row[0])


def lock_accounts(conn: Connection, account_ids: Sequence[str]) -> dict[str, AccountRow]:
    """Lock the existing accounts among `account_ids` (in id order) and return them."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT id, currency, balance, state FROM accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
            (sorted(set(account_ids)),),
        ).fetchall()
    return {r["id"]: AccountRow(r["id"], r["currency"], r["balance"], r["state"]) for r in rows}


def read_account(conn: Connection, account_id: str) -> AccountRow | None:
    """An account without locking it."""
    with conn.cursor(row_factory=dict_row) as cur:
        r = cur.execute(
            "SELECT id, currency, balance, state FROM accounts WHERE id = %s", (account_id,)
        ).fetchone()
    return None if r is None else AccountRow(r["id"], r["currency"], r["balance"], r["state"])


def slot_fenced(conn: Connection, account_id: str) -> bool:
    """Whether the account's slot is fenced here: moving away, or moved away for good."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM slot_fences f"
        " WHERE account_hash(%s) %% f.slots BETWEEN f.first_slot AND f.last_slot)",
        (account_id,),
    ).fetchone()
    return bool(row and row[0])


def add_to_balance(conn: Connection, account_id: str, delta: int) -> None:
    """Move an account's balance by `delta` (the CHECK constraints forbid < 0). Nothing is fetched:
    in pipeline mode it travels with the next statement whose result is, or with the COMMIT."""
    conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (bigint(delta), account_id))


def insert_entry(
    conn: Connection,
    *,
    account_id: str,
    amount_minor: int,
    kind: str,
    idempotency_key: str,
    entry_id: uuid.UUID,
    transfer_id: uuid.UUID | None = None,
    reference: str = "",
) -> None:
    """Append one ledger entry."""
    conn.execute(
        "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, transfer_id, idempotency_key, reference)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (entry_id, account_id, bigint(amount_minor), kind, transfer_id, idempotency_key, reference),
    )


def insert_entry_once(
    conn: Connection,
    *,
    account_id: str,
    amount_minor: int,
    kind: str,
    idempotency_key: str,
    entry_id: uuid.UUID,
    transfer_id: uuid.UUID,
    reference: str,
) -> bool:
    """Append a transfer's entry of one kind unless this shard holds one already (the ledger's
    unique index on (transfer_id, kind)); whether this appended it."""
    row = conn.execute(
        "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, transfer_id, idempotency_key, reference)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)"
        " ON CONFLICT (transfer_id, kind) WHERE transfer_id IS NOT NULL DO NOTHING RETURNING id",
        (entry_id, account_id, bigint(amount_minor), kind, transfer_id, idempotency_key, reference),
    ).fetchone()
    return row is not None


def entry_of_transfer(conn: Connection, transfer_id: uuid.UUID, kind: str) -> uuid.UUID | None:
    """The id of a transfer's ledger entry of one kind, if written."""
    row = conn.execute(
        "SELECT id FROM ledger_entries WHERE transfer_id = %s AND kind = %s", (transfer_id, kind)
    ).fetchone()
    return None if row is None else row[0]


def void_credit(conn: Connection, transfer_id: uuid.UUID, account_id: str, reason: str) -> None:
    """Record that a transfer's credit to `account_id` can never apply here (kept if already there)."""
    conn.execute(
        "INSERT INTO voided_credits (transfer_id, account_id, reason) VALUES (%s, %s, %s)"
        " ON CONFLICT (transfer_id) DO NOTHING",
        (transfer_id, account_id, reason),
    )


def credit_voided(conn: Connection, transfer_id: uuid.UUID) -> bool:
    """Whether a transfer's credit was voided here."""
    row = conn.execute("SELECT 1 FROM voided_credits WHERE transfer_id = %s", (transfer_id,)).fetchone()
    return row is not None


def insert_transfer(conn: Connection, transfer: TransferRow) -> None:
    """Record a transfer on its source shard."""
    conn.execute(
        "INSERT INTO transfers (id, source_account_id, destination_account_id, destination_shard_id,"
        " amount_minor, currency, reference, state, created_at, updated_at)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            transfer.id,
            transfer.source_account_id,
            transfer.destination_account_id,
            transfer.destination_shard_id,
            bigint(transfer.amount_minor),
            transfer.currency,
            transfer.reference,
            transfer.state,
            transfer.created_at,
            transfer.updated_at,
        ),
    )


_TRANSFER_SELECT = (
    "SELECT id, source_account_id, destination_account_id, destination_shard_id, amount_minor,"
    " currency, reference, state, created_at, updated_at FROM transfers"
)


def read_transfer(conn: Connection, transfer_id: uuid.UUID, *, lock: bool = False) -> TransferRow | None:
    """A transfer by id (optionally locked for update)."""
    with conn.cursor(row_factory=dict_row) as cur:
        r = cur.execute(
            _TRANSFER_SELECT + " WHERE id = %s" + (" FOR UPDATE" if lock else ""), (transfer_id,)
        ).fetchone()
    return None if r is None else TransferRow(**r)


def list_transfers(conn: Connection, transfer_ids: Sequence[uuid.UUID] | None = None) -> list[TransferRow]:
    """Every transfer recorded here (None), or those of `transfer_ids`."""
    with conn.cursor(row_factory=dict_row) as cur:
        if transfer_ids is None:
            rows = cur.execute(_TRANSFER_SELECT).fetchall()
        else:
            rows = cur.execute(_TRANSFER_SELECT + " WHERE id = ANY(%s)", (list(transfer_ids),)).fetchall()
    return [TransferRow(**r) for r in rows]


def set_transfer_state(conn: Connection, transfer_id: uuid.UUID, *, expected: str, new: str) -> bool:
    """Move a transfer from `expected` to `new`; False if it was not in `expected`."""
    # RETURNING and a fetch rather than rowcount: in pipeline mode (the guarded calls') the fetch is
    # what waits for the statement's result.
    row = conn.execute(
        "UPDATE transfers SET state = %s, updated_at = now() WHERE id = %s AND state = %s RETURNING id",
        (new, transfer_id, expected),
    ).fetchone()
    return row is not None


def attempts_of(conn: Connection, transfer_id: uuid.UUID) -> list[AttemptRow]:
    """Delivery attempts of a transfer's credit, oldest first."""
    rows = conn.execute(
        "SELECT attempted_at, status_code, message FROM delivery_attempts WHERE transfer_id = %s ORDER BY id",
        (transfer_id,),
    ).fetchall()
    return [AttemptRow(*r) for r in rows]


def insert_outbox(
    conn: Connection, *, transfer_id: uuid.UUID, destination_shard_id: str, key: str, payload: bytes
) -> None:
    """Queue a credit for another shard, in the transaction that debited the source."""
    conn.execute(
        "INSERT INTO outbox (transfer_id, destination_shard_id, idempotency_key, payload)"
        " VALUES (%s, %s, %s, %s)",
        (transfer_id, destination_shard_id, key, payload),
    )


def insert_outbox_once(
    conn: Connection,
    *,
    transfer_id: uuid.UUID,
    destination_shard_id: str,
    key: str,
    payload: bytes,
    note: str,
) -> bool:
    """Queue a transfer's credit again unless an outbox row of it exists (one per transfer), saying
    why in its last error; whether this queued it."""
    row = conn.execute(
        "INSERT INTO outbox (transfer_id, destination_shard_id, idempotency_key, payload, last_error)"
        " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (transfer_id) DO NOTHING RETURNING id",
        (transfer_id, destination_shard_id, key, payload, note),
    ).fetchone()
    return row is not None


def undeliver(conn: Connection, transfer_id: uuid.UUID, note: str) -> bool:
    """Hand a credit marked delivered (and not dead-lettered) back to the relay, due now and with its
    attempts reset; whether it was marked delivered."""
    row = conn.execute(
        "UPDATE outbox SET delivered_at = NULL, next_attempt_at = now(), attempts = 0, last_error = %s"
        " WHERE transfer_id = %s AND delivered_at IS NOT NULL AND dead_lettered_at IS NULL RETURNING id",
        (note, transfer_id),
    ).fetchone()
    return row is not None


_OUTBOX_COLUMNS = (
    "id, transfer_id, destination_shard_id, idempotency_key, payload, attempts, created_at,"
    " delivered_at, dead_lettered_at, last_error"
)


def list_outbox(conn: Connection, transfer_ids: Sequence[uuid.UUID] | None = None) -> list[OutboxRow]:
    """Every outbox row, delivered or not (None), or those of `transfer_ids`."""
    with conn.cursor(row_factory=dict_row) as cur:
        if transfer_ids is None:
            rows = cur.execute(f"SELECT {_OUTBOX_COLUMNS} FROM outbox").fetchall()
        else:
            rows = cur.execute(
                f"SELECT {_OUTBOX_COLUMNS} FROM outbox WHERE transfer_id = ANY(%s)", (list(transfer_ids),)
            ).fetchall()
    return [OutboxRow(**r) for r in rows]


def claim_due_outbox(conn: Connection, limit: int) -> list[OutboxRow]:
    """Lock up to `limit` due credits, oldest first, skipping rows other relay workers hold."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            f"SELECT {_OUTBOX_COLUMNS}"
            " FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL AND next_attempt_at <= now()"
            # A fenced slot (moving, or moved out) takes no writes here: its rows wait for the
            # move, and then for their new owner's relay.
            " AND NOT EXISTS (SELECT 1 FROM slot_fences f"
            "  WHERE outbox.account_hash %% f.slots BETWEEN f.first_slot AND f.last_slot)"
            " ORDER BY next_attempt_at, id LIMIT %s FOR UPDATE SKIP LOCKED",
            (limit,),
        ).fetchall()
    return [OutboxRow(**r) for r in rows]


def record_attempt(conn: Connection, transfer_id: uuid.UUID, status_code: str, message: str) -> None:
    """Append a delivery attempt to a transfer's history."""
    conn.execute(
        "INSERT INTO delivery_attempts (transfer_id, status_code, message) VALUES (%s, %s, %s)",
        (transfer_id, status_code, message[:500]),
    )


def mark_delivered(conn: Connection, outbox_id: int) -> None:
    """The destination confirmed the credit."""
    conn.execute("UPDATE outbox SET delivered_at = now(), last_error = NULL WHERE id = %s", (outbox_id,))


def postpone(conn: Connection, outbox_id: int, delay_s: float, error: str) -> None:
    """Try the credit again after `delay_s`."""
    conn.execute(
        "UPDATE outbox SET attempts = attempts + 1, last_error = %s,"
        " next_attempt_at = now() + make_interval(secs => %s) WHERE id = %s",
        (error[:500], delay_s, outbox_id),
    )


def dead_letter(conn: Connection, *, row: OutboxRow, reason: str, refund_key: str) -> None:
    """Move a credit to the dead letters; its refund is sent separately (and idempotently)."""
    conn.execute(
        "UPDATE outbox SET dead_lettered_at = now(), attempts = attempts + 1, last_error = %s WHERE id = %s",
        (reason[:500], row.id),
    )
    conn.execute(
        "INSERT INTO dead_letters (transfer_id, outbox_id, reason, refund_key) VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (transfer_id) DO NOTHING",
        (row.transfer_id, row.id, reason[:500], refund_key),
    )


def mark_refunded(conn: Connection, transfer_id: uuid.UUID) -> None:
    """The dead letter's refund is applied."""
    conn.execute(
        "UPDATE dead_letters SET refunded_at = coalesce(refunded_at, now()) WHERE transfer_id = %s",
        (transfer_id,),
    )


def reopen_dead_letter(conn: Connection, transfer_id: uuid.UUID) -> bool:
    """Mark a dead letter's refund as not applied, for the relay's refund pass to send it again;
    whether it was marked applied."""
    row = conn.execute(
        "UPDATE dead_letters SET refunded_at = NULL WHERE transfer_id = %s AND refunded_at IS NOT NULL"
        " RETURNING transfer_id",
        (transfer_id,),
    ).fetchone()
    return row is not None


def note_replay(conn: Connection, transfer_id: uuid.UUID) -> None:
    """Count a manual replay of a dead letter."""
    conn.execute(
        "UPDATE dead_letters SET replay_count = replay_count + 1, last_replayed_at = now()"
        " WHERE transfer_id = %s",
        (transfer_id,),
    )


_DEAD_LETTER_SELECT = (
    "SELECT d.transfer_id, d.outbox_id, d.reason, d.refund_key, d.created_at, d.refunded_at,"
    " d.replay_count, t.source_account_id, t.amount_minor, t.currency"
    " FROM dead_letters d JOIN transfers t ON t.id = d.transfer_id"
)


def list_dead_letters(
    conn: Connection,
    *,
    unrefunded_only: bool = False,
    transfer_ids: Sequence[uuid.UUID] | None = None,
    unfenced_only: bool = False,
) -> list[DeadLetterRow]:
    """Dead letters (only those of `transfer_ids`, unless None), oldest first; with `unfenced_only`,
    none of a fenced slot (moving, or moved out: as `claim_due_outbox`, they wait for their owner)."""
    conditions = ["d.refunded_at IS NULL"] if unrefunded_only else []
    if unfenced_only:
        conditions.append(
            "NOT EXISTS (SELECT 1 FROM slot_fences f WHERE d.account_hash %% f.slots BETWEEN f.first_slot AND f.last_slot)"
        )
    params: tuple[object, ...] = ()
    if transfer_ids is not None:
        conditions.append("d.transfer_id = ANY(%s)")
        params = (list(transfer_ids),)
    where = " WHERE " + " AND ".join(conditions) if conditions else ""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_DEAD_LETTER_SELECT + where + " ORDER BY d.created_at", params).fetchall()
    return [DeadLetterRow(**r) for r in rows]


def read_dead_letter(conn: Connection, transfer_id: uuid.UUID) -> DeadLetterRow | None:
    """One dead letter."""
    with conn.cursor(row_factory=dict_row) as cur:
        r = cur.execute(_DEAD_LETTER_SELECT + " WHERE d.transfer_id = %s", (transfer_id,)).fetchone()
    return None if r is None else DeadLetterRow(**r)


def outbox_backlog(conn: Connection) -> tuple[int, float]:
    """Undelivered credits and the age in seconds of the oldest."""
    row = conn.execute(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0) FROM outbox"
        " WHERE delivered_at IS NULL AND dead_lettered_at IS NULL"
    ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1])


def dead_letter_counts(conn: Connection) -> tuple[int, int, float]:
    """Dead-lettered credits (all, and those whose refund has not completed) and the age in seconds
    of the oldest unrefunded one (0: none)."""
    row = conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE refunded_at IS NULL),"
        " coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE refunded_at IS NULL)), 0)"
        " FROM dead_letters"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), float(row[2])


__all__ = [
    "AccountRow",
    "AttemptRow",
    "Connection",
    "DeadLetterRow",
    "OutboxRow",
    "TransferRow",
    "add_to_balance",
    "attempts_of",
    "claim_due_outbox",
    "credit_voided",
    "dead_letter",
    "dead_letter_counts",
    "deposit",
    "deposit_answer",
    "deposit_answer_parts",
    "entry_of_transfer",
    "insert_entry",
    "insert_entry_once",
    "insert_outbox",
    "insert_outbox_once",
    "insert_transfer",
    "list_dead_letters",
    "list_outbox",
    "list_transfers",
    "lock_accounts",
    "mark_delivered",
    "mark_refunded",
    "note_replay",
    "outbox_backlog",
    "postpone",
    "read_account",
    "read_dead_letter",
    "read_transfer",
    "record_attempt",
    "reopen_dead_letter",
    "set_transfer_state",
    "slot_fenced",
    "undeliver",
    "void_credit",
]
