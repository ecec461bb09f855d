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
under their keys. Each wakes the shard's relays (`NOTIFY`) on commit. Every statement on the
ledger's tables is the ledger's own (`shardd.ledger.store`, `shardd.ledger.reads`).
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
from shardrouter.shardd.ledger import reads, store
from shardrouter.shardd.ledger.service import credit_key, credit_payload
from shardrouter.shardd.relay import OUTBOX_CHANNEL
from shardrouter.v1 import transfer_pb2

#: The failpoint (core/failpoints.py) reached after each repair committed, the next not begun.
REPAIRED = "reconcile.repaired"

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
        if not store.undeliver(conn, transfer_id, _NOTE):
            return False
        store.set_transfer_state(conn, transfer_id, expected="completed", new="pending")
        _wake_relays(conn)
    return True


def queue(conn: Connection, shard: str, transfer_id: uuid.UUID) -> bool:
    """CREDIT_NOT_QUEUED: queue the transfer's credit again (its original key); False if an outbox
    row exists, a credit or refund is recorded here, or the transfer is gone."""
    with conn.transaction():
        t = store.read_transfer(conn, transfer_id, lock=True)
        if t is None or t.state == "refunded" or _settled_here(conn, transfer_id):
            return False
        payload = credit_payload(
            transfer_id,
            source_shard_id=shard,
            source_account_id=t.source_account_id,
            destination_account_id=t.destination_account_id,
            amount=transfer_pb2.Money(amount_minor=t.amount_minor, currency=t.currency),
        )
        queued = store.insert_outbox_once(
            conn,
            transfer_id=transfer_id,
            destination_shard_id=t.destination_shard_id,
            key=str(credit_key(transfer_id)),
            payload=payload,
            note="reconcile: credit queued again (no outbox row held it)",
        )
        if not queued:
            return False
        # The outbox's insert trigger wakes the relays.
        store.set_transfer_state(conn, transfer_id, expected="completed", new="pending")
    return True


def _settled_here(conn: Connection, transfer_id: uuid.UUID) -> bool:
    """Whether this shard's ledger already holds the transfer's credit or its refund."""
    return any(
        store.entry_of_transfer(conn, transfer_id, kind) is not None for kind in ("transfer_in", "refund")
    )


def _wake_relays(conn: Connection) -> None:
    """Wake the shard's relays when this transaction commits (an UPDATE of the outbox, unlike an
    INSERT, fires no trigger that would). Not a statement on the ledger: the relay's own signal."""
    conn.execute("SELECT pg_notify(%s, '')", (OUTBOX_CHANNEL,))


def refund(conn: Connection, transfer_id: uuid.UUID) -> bool:
    """REFUND_MISSING: hand the dead letter back to the relay's refund pass; False if a refund
    entry exists, or the dead letter is already waiting for its refund."""
    with conn.transaction():
        if store.read_transfer(conn, transfer_id, lock=True) is None or _settled_here(conn, transfer_id):
            return False
        reopened = store.reopen_dead_letter(conn, transfer_id)
        pending = store.set_transfer_state(conn, transfer_id, expected="refunded", new="pending")
        if not (reopened or pending):
            return False
        _wake_relays(conn)
    return True


def reverse(conn: Connection, m: Mismatch) -> tuple[bool, str]:
    """Take back a credit whose debit no shard holds (or that was refunded too): a `transfer_out`
    entry on the credited account under the reversal key, and its balance; (done, what happened)."""
    assert m.transfer_id is not None and m.account is not None
    try:
        with conn.transaction():
            account = store.lock_accounts(conn, [m.account]).get(m.account)
            credit = reads.transfer_entry(conn, m.transfer_id, "transfer_in")
            if account is None or credit is None or credit.account_id != m.account:
                return False, "the credit is no longer on this shard"
            amount = credit.amount_minor
            written = store.insert_entry_once(
                conn,
                account_id=m.account,
                amount_minor=-amount,
                kind="transfer_out",
                idempotency_key=str(reversal_key(m.transfer_id)),
                entry_id=new_key(),
                transfer_id=m.transfer_id,
                reference=f"reconcile: reversal of credit without debit ({m.kind.value})"[:140],
            )
            if not written:
                return False, "a debit or reversal of this transfer is already recorded here"
            if account.balance < amount:
                raise _Refused(
                    f"account {m.account} holds {account.balance}, less than the {amount} to take back: "
                    "reverse it by hand (or re-create the debit on the source)"
                )
            store.add_to_balance(conn, m.account, -amount)
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
        failpoints.reached(REPAIRED)  # one repair committed, the next not begun
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


__all__ = ["REPAIRED", "Outcome", "apply", "queue", "refund", "requeue", "reverse"]
