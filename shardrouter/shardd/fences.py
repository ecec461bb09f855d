"""Slot fences: a slot range of this shard that takes no writes, enforced by its database.

The cut-over of a move (`shard-router reshard`) fences the moving range on its old owner before the last catch-up.
The fence is a row of `slot_fences`; a trigger on every table whose rows belong to an account's slot
(`migrations.FENCED_TABLES`) refuses any insert, update or delete of a row in a fenced slot, whoever
sends it: the API, the outbox relay, or a person with psql. shardd answers such a refused call
`UNAVAILABLE` with reason `SLOT_RANGE_MOVING` (`db.mapped_database_errors`), everything rolled back.

A transaction that wrote before the fence committed may still commit after it. `raise_fence` names
the transactions running once the fence is committed (their virtual transaction ids: every one that
began before the fence and has not ended is among them), and `drain` waits until each of those is
gone (or ends it), so once it returns nothing more can change those slots here and the log position
taken then is final. It decides by the transactions themselves, never by clocks: a stepped clock
cannot let a writer through. A prepared transaction has no session to wait for and can commit at
any time, so `drain` refuses while the database has one.
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


@dataclass(frozen=True)
class RaisedFence:
    """A fence just committed: the database time after its commit, and the transactions of other
    sessions of this database running then (virtual transaction id -> backend pid), which `drain`
    waits for."""

    at: datetime
    writers: dict[str, int]


class DrainError(RuntimeError):
    """The drain cannot prove that nothing older than the fence can still commit."""


class DrainTimeout(DrainError):
    """Transactions older than a fence were still running when the wait ran out."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(
            f"{len(pids)} transaction(s) older than the fence still running (backend pids {pids}); "
            "end them or wait longer"
        )
        self.pids = pids


class PreparedTransactions(DrainError):
    """Prepared (two-phase) transactions of this database exist: any of them may commit a write into
    the fenced range at any time, and no session holds it to wait for."""

    def __init__(self, gids: list[str]) -> None:
        super().__init__(
            f"{len(gids)} prepared transaction(s) in this database ({', '.join(gids)}): they may commit "
            "a write into the fenced range after the drain; COMMIT PREPARED or ROLLBACK PREPARED them, "
            "then resume the move"
        )
        self.gids = gids


def raise_fence(conn: psycopg.Connection[Any], fence: SlotFence) -> RaisedFence:
    """Fence the range (committed here, in its own transaction); returns what `drain` waits for.
    Raising the same fence again changes nothing (and names the transactions running now)."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO slot_fences (move_id, slots, first_slot, last_slot) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (move_id) DO NOTHING",
            (fence.move_id, fence.slots, fence.first_slot, fence.last_slot),
        )
    with conn.transaction():
        row = conn.execute("SELECT now()").fetchone()
        writers = _running_transactions(conn)
    assert row is not None
    fenced_at: datetime = row[0]
    return RaisedFence(fenced_at, writers)


def _running_transactions(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The virtual transaction ids of the client sessions of this database in a transaction now
    (each holds the lock on its own id from its first statement to its end), with their pids."""
    rows = conn.execute(
        "SELECT l.virtualxid, l.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'virtualxid' AND l.granted AND l.mode = 'ExclusiveLock'"
        " AND a.datname = current_database() AND a.backend_type = 'client backend'"
        " AND l.pid <> pg_backend_pid()"
    ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


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


def prepared_transactions(conn: psycopg.Connection[Any]) -> list[str]:
    """The global ids of this database's prepared transactions."""
    rows = conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared"
    ).fetchall()
    return [str(r[0]) for r in rows]


def drain(
    conn: psycopg.Connection[Any],
    fenced: RaisedFence,
    *,
    timeout_s: float = 10.0,
    end_stragglers: bool = False,
    poll_s: float = 0.02,
) -> None:
    """Wait until every transaction `raise_fence` named has ended.

    With `end_stragglers`, those still running when the wait runs out are terminated (their work
    rolls back; a shard call among them answers UNAVAILABLE and is retried); without, DrainTimeout.
    PreparedTransactions while the database has a prepared transaction, before and after the wait
    (a transaction named by the fence may have prepared meanwhile: its session is then gone).
    """
    _refuse_prepared(conn)
    waiting = dict(fenced.writers)
    deadline = time.monotonic() + timeout_s
    while waiting:
        with conn.transaction():
            rows = conn.execute(
                "SELECT virtualxid, pid FROM pg_locks WHERE locktype = 'virtualxid'"
                " AND mode = 'ExclusiveLock' AND granted AND virtualxid = ANY(%s)",
                (list(waiting),),
            ).fetchall()
        waiting = {str(r[0]): int(r[1]) for r in rows}
        if not waiting:
            break
        if time.monotonic() >= deadline:
            pids = sorted(set(waiting.values()))
            if not end_stragglers:
                raise DrainTimeout(pids)
            with conn.transaction():
                conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
            end_stragglers = False  # once; then they must be gone within one more wait
            deadline = time.monotonic() + timeout_s
        time.sleep(poll_s)
    _refuse_prepared(conn)


def _refuse_prepared(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        gids = prepared_transactions(conn)
    if gids:
        raise PreparedTransactions(gids)


__all__ = [
    "DrainError",
    "DrainTimeout",
    "PreparedTransactions",
    "RaisedFence",
    "SlotFence",
    "drain",
    "fences",
    "lower_fence",
    "prepared_transactions",
    "raise_fence",
]
