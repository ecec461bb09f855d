"""Every SQL statement on `idempotency_record`. The interceptor calls these; it never builds SQL.

A record's `key_time` dates it and picks its monthly partition. A UUIDv7 key dates itself, so its
record is found by its full primary key (scope, key, key_time) in one partition, and the primary key
alone makes a claim unique. Any other key (another UUID version, an opaque key) is dated by its first
receipt: its record is found by (scope, key) across the live partitions, and the primary key cannot
keep a twin out (the twin, received at another time, has another `key_time`, perhaps in another
partition); the advisory lock on hash(scope, key), and a lookup in a statement started after it was
taken, do.

Timeline of a UUIDv7 key inside the claiming transaction:

    BEGIN
      one statement: the call's statement_timeout, the claim's bounded lock wait, the key's committed
        record (scope, key, key_time) if there is one, and only if there is none
        pg_try_advisory_xact_lock(scope, key)
        record found -> EXISTING: replayed (or refused as reused); no lock taken, nothing written
        lock refused -> a twin is in flight; re-read once (it may have just committed) -> IN_FLIGHT
      INSERT ... ON CONFLICT DO NOTHING RETURNING  (lock_timeout = claim bound, 55P03 -> IN_FLIGHT)
        one row  -> CLAIMED: the handler runs in this same transaction, then `complete_key`
        no rows  -> EXISTING: the twin committed just now; its record is read and replayed
    COMMIT   -- the record becomes visible together with the handler's writes, or not at all

Timeline of any other key (dated by receipt: key_time = now), the same number of round trips:

    BEGIN
      one statement: as above, but the committed record is looked up by (scope, key) in every
        partition; record found -> EXISTING (no lock); lock refused -> re-read -> IN_FLIGHT
      INSERT ... SELECT ... WHERE NOT EXISTS (a record of (scope, key) in any state, any partition)
        ON CONFLICT DO NOTHING RETURNING
        This is a new statement, so it reads a snapshot taken after the lock was granted. The first
        statement's snapshot was taken before its lock attempt: a twin that committed (and so
        released the lock) in between is invisible to it, but not to this one. A twin holding the
        lock now has refused ours, so every twin that could have inserted has committed or rolled back.
        one row  -> CLAIMED (record dated now)
        no rows  -> EXISTING: that twin's record, read by (scope, key), is replayed
    COMMIT

The interceptor runs the transaction in psycopg's pipeline mode unless `SHARDD_DB_PIPELINE=false`:
a statement whose result nobody fetches (BEGIN, SAVEPOINT, an INSERT without RETURNING, the outcome
UPDATE, COMMIT) travels with the next one that is fetched, so a Deposit costs 5 round trips, not 12.

A replay of a completed key is therefore a plain read: it never waits for, nor takes, a lock, so any
number of concurrent replays of one key all get the stored answer. The advisory lock answers an
in-flight duplicate without waiting; for a UUIDv7 key the unique primary key is what actually decides
the winner, and the bounded lock wait is the backstop if the two ever disagree.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from shardrouter.shardd.idempotency.record import (
    Claim,
    ClaimStatus,
    IdempotencyRecord,
    RecordState,
    StoredOutcome,
)

_COLUMNS = (
    "scope, key, key_time, method, request_hash, state, status_code, status_message,"
    " status_details, response, trailers, created_at, completed_at, first_traceparent"
)
_RECORD_COLUMNS = ", ".join(f"r.{c.strip()}" for c in _COLUMNS.split(","))


def claim_key(
    conn: psycopg.Connection[Any],
    *,
    scope: str,
    key: str,
    key_time: datetime,
    dated_by_key: bool = True,
    method: str,
    request_hash: bytes,
    account_id: str | None = None,
    claim_lock_timeout_ms: int,
    handler_lock_timeout_ms: int,
    statement_timeout_ms: int | None = None,
    traceparent: str | None = None,
) -> Claim:
    """Try to claim a key in the caller's open transaction. Never SELECT-then-INSERT.

    `key_time`: the record's date; `dated_by_key`: whether the key carries it (a UUIDv7), so its
    record can only be in that partition, or it is this receipt's time (any other key), so a
    record of the key may be anywhere (the module's timelines).
    `statement_timeout_ms` bounds every later statement of the transaction (the caller's deadline).
    `account_id`: the account the call is routed by; the record stores its hash, so it moves with
    the account's slot.
    """
    row = _read_or_lock(
        conn,
        scope=scope,
        key=key,
        key_time=key_time if dated_by_key else None,
        claim_lock_timeout_ms=claim_lock_timeout_ms,
        statement_timeout_ms=statement_timeout_ms,
    )
    found_time = key_time if dated_by_key else None
    if row["key"] is not None:
        return Claim(ClaimStatus.EXISTING, _record(row))
    if not row["locked"]:
        # The twin holding the lock may have committed between the read and the lock attempt (a
        # transaction's locks are released just after its commit becomes visible).
        return _committed_or_in_flight(conn, scope=scope, key=key, key_time=found_time)
    values = (scope, key, key_time, method, request_hash, traceparent, account_id)
    returning = " RETURNING created_at, set_config('lock_timeout', %s, true)"
    try:
        if dated_by_key:
            inserted = conn.execute(
                f"INSERT INTO idempotency_record ({_INSERTED})"
                " VALUES (%s, %s, %s, %s, %s, 'in_progress', %s, account_hash(nullif(%s, '')))"
                " ON CONFLICT (scope, key, key_time) DO NOTHING" + returning,
                (*values, f"{handler_lock_timeout_ms}ms"),
            ).fetchone()
        else:
            # A new statement: its snapshot sees every twin that committed before our lock.
            inserted = conn.execute(
                f"INSERT INTO idempotency_record ({_INSERTED})"
                " SELECT %s, %s, %s, %s, %s, 'in_progress', %s, account_hash(nullif(%s, ''))"
                " WHERE NOT EXISTS (SELECT 1 FROM idempotency_record WHERE scope = %s AND key = %s)"
                " ON CONFLICT (scope, key, key_time) DO NOTHING" + returning,
                (*values, scope, key, f"{handler_lock_timeout_ms}ms"),
            ).fetchone()
    except errors.LockNotAvailable:
        # The transaction is now aborted; the caller answers "in flight" and rolls it back.
        return Claim(ClaimStatus.IN_FLIGHT)
    if inserted is not None:
        return Claim(ClaimStatus.CLAIMED, created_at=inserted[0])
    return _committed_or_in_flight(conn, scope=scope, key=key, key_time=found_time)


_INSERTED = "scope, key, key_time, method, request_hash, state, first_traceparent, account_hash"


def _read_or_lock(
    conn: psycopg.Connection[Any],
    *,
    scope: str,
    key: str,
    key_time: datetime | None,
    claim_lock_timeout_ms: int,
    statement_timeout_ms: int | None,
) -> dict[str, Any]:
    """The claim's first statement: the settings, the key's committed record (by its full primary
    key when `key_time` is known, else by (scope, key) in every partition), and the advisory lock
    only if there is no such record. One round trip: round trips are most of a call's cost."""
    timeouts = (
        f"{claim_lock_timeout_ms}ms",
        f"{statement_timeout_ms}ms" if statement_timeout_ms else None,
        f"{scope} {key}",
    )
    with conn.cursor(row_factory=dict_row) as cur:
        if key_time is not None:
            row = cur.execute(
                _READ_OR_LOCK + " AND r.key_time = %s AND r.state = 'completed'",
                (*timeouts, scope, key, key_time),
            ).fetchone()
        else:
            row = cur.execute(
                _READ_OR_LOCK + " AND r.state = 'completed'", (*timeouts, scope, key)
            ).fetchone()
    assert row is not None  # the VALUES row is always there
    return row


_READ_OR_LOCK = (
    "SELECT set_config('lock_timeout', %s, true) AS lock_timeout,"
    " set_config('statement_timeout', coalesce(%s, current_setting('statement_timeout')), true)"
    " AS statement_timeout,"
    " CASE WHEN r.key IS NULL THEN pg_try_advisory_xact_lock(hashtextextended(%s, 0)) END AS locked,"
    f" {_RECORD_COLUMNS}"
    " FROM (VALUES (1)) AS one LEFT JOIN idempotency_record r"
    " ON r.scope = %s AND r.key = %s"
)


def _committed_or_in_flight(
    conn: psycopg.Connection[Any], *, scope: str, key: str, key_time: datetime | None
) -> Claim:
    existing = lookup_key(conn, scope=scope, key=key, key_time=key_time)
    if existing is None or existing.state is not RecordState.COMPLETED:
        # Not committed yet (or its partition was dropped between two statements).
        return Claim(ClaimStatus.IN_FLIGHT)
    return Claim(ClaimStatus.EXISTING, existing)


def complete_key(
    conn: psycopg.Connection[Any],
    *,
    scope: str,
    key: str,
    key_time: datetime,
    outcome: StoredOutcome,
) -> None:
    """Store the outcome of a claimed key, in the claiming transaction.

    Nothing is fetched, so in pipeline mode the statement travels with the COMMIT. If it does not
    match exactly the one in-progress row, the statement fails (and with it the transaction) with a
    message saying so, instead of a row count checked after a round trip.
    """
    conn.execute(
        "WITH done AS (UPDATE idempotency_record SET state = 'completed', status_code = %s,"
        " status_message = %s, status_details = %s, response = %s, trailers = %s, completed_at = now()"
        " WHERE scope = %s AND key = %s AND key_time = %s AND state = 'in_progress' RETURNING 1)"
        " SELECT CASE WHEN count(*) = 1 THEN 1"
        " ELSE ('completing a claimed key matched ' || count(*) || ' in-progress rows')::int END FROM done",
        (
            outcome.code,
            outcome.message,
            outcome.details,
            outcome.response,
            Jsonb(outcome.trailers_json()),
            scope,
            key,
            key_time,
        ),
    )


def lookup_key(
    conn: psycopg.Connection[Any], *, scope: str, key: str, key_time: datetime | None
) -> IdempotencyRecord | None:
    """The committed (or own in-progress) record of a key, if any: in the partition of `key_time`,
    or, None, in any partition (a key dated by its first receipt)."""
    with conn.cursor(row_factory=dict_row) as cur:
        if key_time is not None:
            row = cur.execute(
                f"SELECT {_COLUMNS} FROM idempotency_record WHERE scope = %s AND key = %s AND key_time = %s",
                (scope, key, key_time),
            ).fetchone()
        else:
            row = cur.execute(
                f"SELECT {_COLUMNS} FROM idempotency_record WHERE scope = %s AND key = %s"
                " ORDER BY key_time LIMIT 1",
                (scope, key),
            ).fetchone()
    return None if row is None else _record(row)


def find_key(
    conn: psycopg.Connection[Any], *, key: str, key_time: datetime | None = None
) -> list[IdempotencyRecord]:
    """Every record of a key across scopes (for support look-ups by an operator); `key_time`, when
    the key dates itself, narrows the search to its partition."""
    with conn.cursor(row_factory=dict_row) as cur:
        if key_time is not None:
            rows = cur.execute(
                f"SELECT {_COLUMNS} FROM idempotency_record WHERE key = %s AND key_time = %s ORDER BY scope",
                (key, key_time),
            ).fetchall()
        else:
            rows = cur.execute(
                f"SELECT {_COLUMNS} FROM idempotency_record WHERE key = %s ORDER BY scope, key_time",
                (key,),
            ).fetchall()
    return [_record(r) for r in rows]


def _record(row: dict[str, Any]) -> IdempotencyRecord:
    state = RecordState(str(row["state"]))
    outcome = None
    if state is RecordState.COMPLETED:
        outcome = StoredOutcome(
            code=int(row["status_code"]),
            message=str(row["status_message"] or ""),
            details=_bytes(row["status_details"]),
            response=_bytes(row["response"]),
            trailers=StoredOutcome.trailers_from_json(row["trailers"]),
        )
    return IdempotencyRecord(
        scope=str(row["scope"]),
        key=str(row["key"]),
        key_time=row["key_time"],
        method=str(row["method"]),
        request_hash=bytes(row["request_hash"]),
        state=state,
        outcome=outcome,
        created_at=row["created_at"],
        completed_at=row["completed_at"],
        first_traceparent=row["first_traceparent"],
    )


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


__all__ = [
    "claim_key",
    "complete_key",
    "find_key",
    "lookup_key",
]
