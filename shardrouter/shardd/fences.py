"""Slot fences: a slot range of this shard that takes no writes, enforced by its database.

The cut-over of a move (`shard-router reshard`) fences the moving range on its old owner before the last catch-up.
The fence is a row of `slot_fences`; a trigger on every table whose rows belong to an account's slot
(`migrations.FENCED_TABLES`) refuses any insert, update or delete of a row in a fenced slot, whoever
sends it: the API, the outbox relay, or a person with psql. shardd answers such a refused call
`UNAVAILABLE` with reason `SLOT_RANGE_MOVING` (`db.mapped_database_errors`), everything rolled back.

A transaction that checked before the fence committed may still commit after it; `drain` waits for
(or ends) every transaction older than the fence, so once it returns, nothing more can change those
slots here and the log position taken then is final.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg


@dataclass(frozen=True)
class SlotFence:
    """A fenced slot range (`first_slot`..`last_slot` of `slots`), named by the move that made it."""

    move_id: str
    slots: int
    first_slot: int
    last_slot: int


class DrainTimeout(RuntimeError):
    """Transactions older than a fence were still running when the wait ran out."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(
            f"{len(pids)} transaction(s) older than the fence still running (backend pids {pids}); "
            "end them or wait longer"
        )
        self.pids = pids


def raise_fence(conn: psycopg.Connection[Any], fence: SlotFence) -> datetime:
    """Fence the range (committed here, in its own transaction); returns the database time just
    after the commit, which `drain` waits past. Raising the same fence again changes nothing."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO slot_fences (move_id, slots, first_slot, last_slot) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (move_id) DO NOTHING",
            (fence.move_id, fence.slots, fence.first_slot, fence.last_slot),
        )
    with conn.transaction():
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    fenced_at: datetime = row[0]
    return fenced_at


def lower_fence(conn: psycopg.Connection[Any], move_id: str) -> bool:
    """Remove a move's fence (an aborted move); True if there was one."""
    with conn.transaction():
        cur = conn.execute("DELETE FROM slot_fences WHERE move_id = %s", (move_id,))
    return cur.rowcount == 1


def fences(conn: psycopg.Connection[Any]) -> list[SlotFence]:
    """Every fence of this shard."""
    with conn.transaction():
        rows = conn.execute(
            "SELECT move_id, slots, first_slot, last_slot FROM slot_fences ORDER BY first_slot"
        ).fetchall()
    return [SlotFence(str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows]


def drain(
    conn: psycopg.Connection[Any],
    fenced_at: datetime,
    *,
    timeout_s: float = 10.0,
    end_stragglers: bool = False,
    poll_s: float = 0.02,
) -> None:
    """Wait until no other transaction on this database began before `fenced_at`.

    With `end_stragglers`, those still running when the wait runs out are terminated (their work
    rolls back; a shard call among them answers UNAVAILABLE and is retried); without, DrainTimeout.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with conn.transaction():
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND xact_start < %s"
                " ORDER BY pid",
                (fenced_at,),
            ).fetchall()
        pids = [int(r[0]) for r in rows]
        if not pids:
            return
        if time.monotonic() >= deadline:
            if not end_stragglers:
                raise DrainTimeout(pids)
            with conn.transaction():
                conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
            end_stragglers = False  # once; then they must be gone within one more wait
            deadline = time.monotonic() + timeout_s
        time.sleep(poll_s)


__all__ = ["DrainTimeout", "SlotFence", "drain", "fences", "lower_fence", "raise_fence"]
