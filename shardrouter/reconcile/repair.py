"""The repairs of `shard-router reconcile --repair`: each one transaction on one shard, written so that
running it twice, at once from two places, or after a kill midway changes nothing more than once.

- `requeue` (CREDIT_MISSING): the source's outbox row goes back to undelivered, and its transfer back
  to pending, only while the row says delivered; the relay sends the credit again under the credit's
  ORIGINAL key, so a destination that still holds the key replays it and one that lost it applies it
  once. A second requeue of a credit already re-delivered is harmless for the same reason.
- `queue` (CREDIT_NOT_QUEUED): the outbox row is rebuilt from the transfer row, under the credit's
  original key (`INSERT ... ON CONFLICT (transfer_id) DO NOTHING`: one row per transfer).
- `refund` (REFUND_MISSING): the dead letter goes back to unrefunded and the transfer to pending,
  only while no refund entry exists; the relay's refund pass sends `RefundTransfer` under the
  transfer's refund key (one refund entry per transfer: the ledger's unique index).
- `reverse` (CREDIT_WITHOUT_DEBIT, CREDITED_AND_REFUNDED; only with `--reverse-orphan-credits`): a
  `transfer_out` entry of the credit's amount on the credited account, under the key
  `reversal_key(transfer_id)`, and the balance moved with it; the ledger's unique index on
  (transfer_id, kind) makes it one per transfer and shard. Refused (nothing written) when the account
  no longer holds the amount.

A kill between two repairs (failpoint `reconcile.repaired`, reached after each one committed) leaves
the ones done done and the others for the next run.

The first three write no balance: the daemons' own calls (`CreditTransfer`, `RefundTransfer`) do,
under their keys. Each wakes the shard's relays (`NOTIFY`) on commit.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass

import psycopg

from shardrouter.core import failpoints
from shardrouter.core.keys import new_key
from shardrouter.reconcile.check import Kind, Mismatch
from shardrouter.reconcile.facts import Connection, reversal_key
from shardrouter.shardd.ledger.service import credit_key, credit_payload
from shardrouter.shardd.relay import OUTBOX_CHANNEL
from shardrouter.v1 import transfer_pb2

_NOTE = "reconcile: credit re-queued (the destination did not hold it)"


@dataclass(frozen=True)
class Outcome:
    """What one repair did: `done` if this run changed something, else why not."""

    mismatch: Mismatch
    done: bool
    said: str


def requeue(conn: Connection, transfer_id: uuid.UUID) -> bool:
    """CREDIT_MISSING: deliver the credit again under its original key; False if its outbox row was
    not marked delivered (already re-queued, or dead-lettered since)."""
    with conn.transaction():
        row = conn.execute(
            "UPDATE outbox SET delivered_at = NULL, next_attempt_at = now(), attempts = 0, last_error = %s"
            " WHERE transfer_id = %s AND delivered_at IS NOT NULL AND dead_lettered_at IS NULL RETURNING id",
            (_NOTE, transfer_id),
        ).fetchone()
        if row is None:
            return False
        conn.execute(
            "UPDATE transfers SET state = 'pending', updated_at = now() WHERE id = %s AND state = 'completed'",
            (transfer_id,),
        )
        conn.execute("SELECT pg_notify(%s, '')", (OUTBOX_CHANNEL,))
    return True


def queue(conn: Connection, shard: str, transfer_id: uuid.UUID) -> bool:
    """CREDIT_NOT_QUEUED: queue the transfer's credit again (its original key); False if an outbox
    row exists, a credit or refund is recorded here, or the transfer is gone."""
    with conn.transaction():
        t = conn.execute(
            "SELECT source_account_id, destination_account_id, destination_shard_id, amount_minor,"
            " currency::text, state FROM transfers WHERE id = %s FOR UPDATE",
            (transfer_id,),
        ).fetchone()
        if t is None or t[5] == "refunded":
            return False
        if _settled_here(conn, transfer_id):
            return False
        source, destination, destination_shard, amount, currency, _ = t
        payload = credit_payload(
            transfer_id,
            source_shard_id=shard,
            source_account_id=source,
            destination_account_id=destination,
            amount=transfer_pb2.Money(amount_minor=amount, currency=currency),
        )
        row = conn.execute(
            "INSERT INTO outbox (transfer_id, destination_shard_id, idempotency_key, payload, last_error)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (transfer_id) DO NOTHING RETURNING id",
            (
                transfer_id,
                destination_shard,
                str(credit_key(transfer_id)),
                payload,
                "reconcile: credit queued again (no outbox row held it)",
            ),
        ).fetchone()
        if row is None:
            return False
        conn.execute(
            "UPDATE transfers SET state = 'pending', updated_at = now() WHERE id = %s AND state = 'completed'",
            (transfer_id,),
        )
    return True


def _settled_here(conn: Connection, transfer_id: uuid.UUID) -> bool:
    """Whether this shard's ledger already holds the transfer's credit or its refund."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM ledger_entries WHERE transfer_id = %s AND kind IN ('transfer_in', 'refund'))",
        (transfer_id,),
    ).fetchone()
    return row is None or bool(row[0])


def refund(conn: Connection, transfer_id: uuid.UUID) -> bool:
    """REFUND_MISSING: hand the dead letter back to the relay's refund pass; False if a refund
    entry exists, or the dead letter is already waiting for its refund."""
    with conn.transaction():
        t = conn.execute("SELECT state FROM transfers WHERE id = %s FOR UPDATE", (transfer_id,)).fetchone()
        if t is None:
            return False
        if _settled_here(conn, transfer_id):
            return False
        letter = conn.execute(
            "UPDATE dead_letters SET refunded_at = NULL WHERE transfer_id = %s AND refunded_at IS NOT NULL"
            " RETURNING transfer_id",
            (transfer_id,),
        ).fetchone()
        state = conn.execute(
            "UPDATE transfers SET state = 'pending', updated_at = now() WHERE id = %s AND state = 'refunded'"
            " RETURNING id",
            (transfer_id,),
        ).fetchone()
        if letter is None and state is None:
            return False
        conn.execute("SELECT pg_notify(%s, '')", (OUTBOX_CHANNEL,))
    return True


def reverse(conn: Connection, m: Mismatch) -> tuple[bool, str]:
    """Take back a credit whose debit no shard holds (or that was refunded too): a `transfer_out`
    entry on the credited account under the reversal key, and its balance; (done, what happened)."""
    assert m.transfer_id is not None and m.account is not None
    try:
        with conn.transaction():
            account = conn.execute(
                "SELECT balance FROM accounts WHERE id = %s FOR UPDATE", (m.account,)
            ).fetchone()
            credit = conn.execute(
                "SELECT amount_minor FROM ledger_entries WHERE transfer_id = %s AND kind = 'transfer_in'"
                " AND account_id = %s",
                (m.transfer_id, m.account),
            ).fetchone()
            if account is None or credit is None:
                return False, "the credit is no longer on this shard"
            amount = int(credit[0])
            row = conn.execute(
                "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, transfer_id, idempotency_key,"
                " reference) VALUES (%s, %s, %s, 'transfer_out', %s, %s, %s)"
                " ON CONFLICT (transfer_id, kind) WHERE transfer_id IS NOT NULL DO NOTHING RETURNING id",
                (
                    new_key(),
                    m.account,
                    -amount,
                    m.transfer_id,
                    str(reversal_key(m.transfer_id)),
                    f"reconcile: reversal of credit without debit ({m.kind.value})"[:140],
                ),
            ).fetchone()
            if row is None:
                return False, "a debit or reversal of this transfer is already recorded here"
            if int(account[0]) < amount:
                raise _Refused(
                    f"account {m.account} holds {account[0]}, less than the {amount} to take back: "
                    "reverse it by hand (or re-create the debit on the source)"
                )
            conn.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, m.account))
    except _Refused as refused:
        return False, str(refused)
    except psycopg.errors.CheckViolation as exc:
        return False, f"refused by the database: {exc.diag.message_primary}"
    return (
        True,
        f"credit of {amount} {m.currency} to {m.account} reversed under key {reversal_key(m.transfer_id)}",
    )


class _Refused(Exception):
    """A reversal that would leave the account below zero: its transaction is rolled back."""


def apply(
    conns: dict[str, Connection], mismatches: list[Mismatch], *, reverse_orphans: bool
) -> list[Outcome]:
    """Apply every repair the mismatches allow; one outcome per mismatch that has one. A repair the
    database refuses (a slot range fenced by a move, say) is rolled back and reported, and the
    others go on."""
    outcomes: list[Outcome] = []
    for m in mismatches:
        if m.transfer_id is None:
            continue
        if m.kind in (Kind.CREDIT_WITHOUT_DEBIT, Kind.CREDITED_AND_REFUNDED):
            if not reverse_orphans or m.shard is None or m.account is None or m.shard not in conns:
                continue
            shard = m.shard
            step = functools.partial(reverse, conns[shard], m)
        else:
            repair = m.repair
            if repair is None or m.source_shard is None or m.source_shard not in conns:
                continue
            shard = m.source_shard
            step = functools.partial(_source_repair, repair, conns[shard], shard, m.transfer_id)
        try:
            done, said = step()
        except psycopg.Error as exc:
            done, said = False, f"refused by the database, nothing changed: {exc.diag.message_primary or exc}"
        outcomes.append(Outcome(m, done, f"{m.kind.value} {m.transfer_id} on {shard}: {said}"))
        failpoints.reached("reconcile.repaired")  # one repair committed, the next not begun
    return outcomes


def _source_repair(repair: str, conn: Connection, shard: str, transfer_id: uuid.UUID) -> tuple[bool, str]:
    if repair == "requeue":
        done = requeue(conn, transfer_id)
        return (
            done,
            "credit re-queued with its original key"
            if done
            else "already re-queued (or no longer delivered)",
        )
    if repair == "queue":
        done = queue(conn, shard, transfer_id)
        return (
            done,
            "credit queued with its original key" if done else "already queued (or settled meanwhile)",
        )
    done = refund(conn, transfer_id)
    return done, "handed back to the refund path" if done else "already handed back (or refunded meanwhile)"


__all__ = ["Outcome", "apply", "queue", "refund", "requeue", "reverse"]
