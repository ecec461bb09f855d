"""Every SQL statement on `idempotency_record`. The interceptor calls these; it never builds SQL.

Timeline of one key inside the claiming transaction:

    BEGIN
      one statement: the call's statement_timeout, the claim's bounded lock wait, the key's committed
        record if there is one, and only if there is none pg_try_advisory_xact_lock(scope, key)
        record found -> EXISTING: replayed (or refused as reused); no lock taken, nothing written
        lock refused -> a twin is in flight; re-read once (it may have just committed) -> IN_FLIGHT
      INSERT ... ON CONFLICT DO NOTHING RETURNING  (lock_timeout = claim bound, 55P03 -> IN_FLIGHT)
        one row  -> CLAIMED: the handler runs in this same transaction, then `complete_key`
        no rows  -> EXISTING: the twin committed just now; its record is read and replayed
    COMMIT   -- the record becomes visible together with the handler's writes, or not at all

The interceptor runs the transaction in psycopg's pipeline mode unless `SHARDD_DB_PIPELINE=false`:
a statement whose result nobody fetches (BEGIN, SAVEPOINT, an INSERT without RETURNING, the outcome
UPDATE, COMMIT) travels with the next one that is fetched, so a Deposit costs 5 round trips, not 12.

A replay of a completed key is therefore a plain read: it never waits for, nor takes, a lock, so any
number of concurrent replays of one key all get the stored answer. The advisory lock answers an
in-flight duplicate without waiting; the unique primary key is what actually decides the winner, and
the bounded lock wait is the backstop if the two ever disagree.
"""

from __future__ import annotations

import uuid
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
    key: uuid.UUID,
    key_time: datetime,
    method: str,
    request_hash: bytes,
    account_id: str | None = None,
    claim_lock_timeout_ms: int,
    handler_lock_timeout_ms: int,
    statement_timeout_ms: int | None = None,
    traceparent: str | None = None,
) -> Claim:
    """Try to claim a key in the caller's open transaction. Never SELECT-then-INSERT.

    `statement_timeout_ms` bounds every later statement of the transaction (the caller's deadline).
    `account_id`: the account the call is routed by; the record stores its hash, so it moves with
    the account's slot.
    """
    # One round trip for the settings, the replay read and the advisory lock: round trips are most
    # of a call's cost. The lock is only tried when no committed record exists, so a replay takes none.
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            "SELECT set_config('lock_timeout', %s, true) AS lock_timeout,"
            " set_config('statement_timeout', coalesce(%s, current_setting('statement_timeout')), true)"
            " AS statement_timeout,"
            " CASE WHEN r.key IS NULL THEN pg_try_advisory_xact_lock(hashtextextended(%s, 0)) END AS locked,"
            f" {_RECORD_COLUMNS}"
            " FROM (VALUES (1)) AS one LEFT JOIN idempotency_record r"
            " ON r.scope = %s AND r.key = %s AND r.key_time = %s AND r.state = 'completed'",
            (
                f"{claim_lock_timeout_ms}ms",
                f"{statement_timeout_ms}ms" if statement_timeout_ms else None,
                f"{scope} {key}",
                scope,
                key,
                key_time,
            ),
        ).fetchone()
    assert row is not None  # the VALUES row is always there
    if row["key"] is not None:
        return Claim(ClaimStatus.EXISTING, _record(row))
    if not row["locked"]:
        # The twin holding the lock may have committed between the read and the lock attempt (a
        # transaction's locks are released just after its commit becomes visible).
        return _committed_or_in_flight(conn, scope=scope, key=key, key_time=key_time)
    try:
        inserted = conn.execute(
            "INSERT INTO idempotency_record"
            " (scope, key, key_time, method, request_hash, state, first_traceparent, account_hash)"
            " VALUES (%s, %s, %s, %s, %s, 'in_progress', %s, account_hash(nullif(%s, '')))"
            " ON CONFLICT (scope, key, key_time) DO NOTHING"
            " RETURNING created_at, set_config('lock_timeout', %s, true)",
            (
                scope,
                key,
                key_time,
                method,
                request_hash,
                traceparent,
                account_id,
                f"{handler_lock_timeout_ms}ms",
            ),
        ).fetchone()
    except errors.LockNotAvailable:
        # The transaction is now aborted; the caller answers "in flight" and rolls it back.
        return Claim(ClaimStatus.IN_FLIGHT)
    if inserted is not None:
        return Claim(ClaimStatus.CLAIMED, created_at=inserted[0])
    return _committed_or_in_flight(conn, scope=scope, key=key, key_time=key_time)


def _committed_or_in_flight(
    conn: psycopg.Connection[Any], *, scope: str, key: uuid.UUID, key_time: datetime
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
    key: uuid.UUID,
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
    conn: psycopg.Connection[Any], *, scope: str, key: uuid.UUID, key_time: datetime
) -> IdempotencyRecord | None:
    """The committed (or own in-progress) record of a key, if any."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            f"SELECT {_COLUMNS} FROM idempotency_record WHERE scope = %s AND key = %s AND key_time = %s",
            (scope, key, key_time),
        ).fetchone()
    return None if row is None else _record(row)


def find_key(conn: psycopg.Connection[Any], *, key: uuid.UUID, key_time: datetime) -> list[IdempotencyRecord]:
    """Every record of a key across scopes (for support look-ups by an operator)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            f"SELECT {_COLUMNS} FROM idempotency_record WHERE key = %s AND key_time = %s ORDER BY scope",
            (key, key_time),
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
        key=row["key"],
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
