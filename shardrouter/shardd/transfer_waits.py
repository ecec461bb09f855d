"""Wakes the `GetTransfer` calls that wait for a transfer as soon as its state changes.

A caller that asks `GetTransfer` to wait (`wait_for_completion_ms`) holds a `TransferWaits.watch` on
the transfer while it re-reads it. Whoever commits a transfer's state change signals the watchers:

- in this process, the outbox relay calls `TransferWaits.notify` right after its commit (a
  transfer completed) or after the refund it sent was confirmed (a transfer refunded);
- in the other daemons of the shard (which share its database), the relay's `pg_notify` on
  `TRANSFER_CHANNEL` (`notify_in_transaction`, sent in the transaction that changes the state, so it
  is heard only after the commit) is heard by each daemon's listener (`listener.ShardListener`),
  which calls `notify`.

The signals are `waits.Waits`, keyed by transfer id (the pattern every wait of the daemon shares:
a signal only says "read again", and none is lost between a read and the following wait). Without a
listener (`listening` false: its connection is down) a waiter polls at the short step.
"""

from __future__ import annotations

import uuid

from shardrouter.shardd.db import Connection
from shardrouter.shardd.waits import Waits, Watch

#: The channel a committed state change of a transfer notifies, with the transfer's id as payload.
TRANSFER_CHANNEL = "shardrouter_transfer"

#: One waiter's interest in one transfer (from `TransferWaits.watch`).
TransferWatch = Watch[uuid.UUID]


class TransferWaits(Waits[uuid.UUID]):
    """The `GetTransfer` calls of one daemon process waiting for transfers, by transfer id."""

    def notify_payload(self, payload: str) -> None:
        """A `TRANSFER_CHANNEL` notification heard by a listener (its payload is a transfer id)."""
        try:
            transfer_id = uuid.UUID(payload)
        except ValueError:
            return  # not ours to understand: nobody waits for it
        self.notify([transfer_id])


def notify_in_transaction(conn: Connection, transfer_ids: list[uuid.UUID]) -> None:
    """Queue `pg_notify(TRANSFER_CHANNEL, id)` for each transfer, in the connection's transaction
    (one statement): the other daemons of the shard hear it when, and only if, it commits."""
    if transfer_ids:
        conn.execute(
            "SELECT pg_notify(%s, t) FROM unnest(%s::text[]) AS t",
            (TRANSFER_CHANNEL, [str(t) for t in transfer_ids]),
        )


__all__ = ["TRANSFER_CHANNEL", "TransferWaits", "TransferWatch", "notify_in_transaction"]
