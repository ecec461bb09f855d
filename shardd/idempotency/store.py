"""Every SQL statement on `idempotency_record`. The interceptor calls these; it never builds SQL.

Timeline of one key inside the claiming transaction:

    BEGIN
      pg_try_advisory_xact_lock(scope, key)   -- false: a twin is in flight -> IN_FLIGHT at once
      INSERT ... ON CONFLICT DO NOTHING RETURNING  (lock_timeout = claim bound, 55P03 -> IN_FLIGHT)
        one row  -> CLAIMED: the handler runs in this same transaction, then `complete_key`
        no rows  -> EXISTING: the committed record is read and replayed (or refused as reused)
    COMMIT   -- the record becomes visible together with the handler's writes, or not at all

The advisory lock answers an in-flight duplicate without waiting; the unique primary key is what
actually decides the winner, and the bounded lock wait is the backstop if the two ever disagree.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from shardd.idempotency.record import (
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


def claim_key(
    conn: psycopg.Connection[Any],
    *,
    scope: str,
    key: uuid.UUID,
    key_time: datetime,
    method: str,
    request_hash: bytes,
    claim_lock_timeout_ms: int,
    handler_lock_timeout_ms: int,
    traceparent: str | None = None,
) -> Claim:
    """Try to claim a key in the caller's open transaction. Never SELECT-then-INSERT."""
    # One round trip: the claim's bounded lock wait, then the advisory lock. Round trips are most of
    # a call's cost (scripts/bench_concurrency_model.py).
    row = conn.execute(
        "SELECT set_config('lock_timeout', %s, true), pg_try_advisory_xact_lock(hashtextextended(%s, 0))",
        (f"{claim_lock_timeout_ms}ms", f"{scope} {key}"),
    ).fetchone()
    if row is None or not row[1]:
        return Claim(ClaimStatus.IN_FLIGHT)
    try:
        inserted = conn.execute(
            "INSERT INTO idempotency_record"
            " (scope, key, key_time, method, request_hash, state, first_traceparent)"
            " VALUES (%s, %s, %s, %s, %s, 'in_progress', %s)"
            " ON CONFLICT (scope, key, key_time) DO NOTHING RETURNING key",
            (scope, key, key_time, method, request_hash, traceparent),
        ).fetchone()
    except errors.LockNotAvailable:
        # The transaction is now aborted; the caller answers "in flight" and rolls it back.
        return Claim(ClaimStatus.IN_FLIGHT)
    _set_lock_timeout(conn, handler_lock_timeout_ms)
    if inserted is not None:
        return Claim(ClaimStatus.CLAIMED)
    existing = lookup_key(conn, scope=scope, key=key, key_time=key_time)
    if existing is None or existing.state is not RecordState.COMPLETED:
        # Only possible if the record vanished (partition dropped) between the two statements.
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
    """Store the outcome of a claimed key, in the claiming transaction."""
    result = conn.execute(
        "UPDATE idempotency_record SET state = 'completed', status_code = %s, status_message = %s,"
        " status_details = %s, response = %s, trailers = %s, completed_at = now()"
        " WHERE scope = %s AND key = %s AND key_time = %s AND state = 'in_progress'",
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
    if result.rowcount != 1:
        raise RuntimeError(f"completing key {key} in scope {scope!r} matched {result.rowcount} rows")


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


def count_records(conn: psycopg.Connection[Any]) -> int:
    """Exact number of records (tests and small tables only; metrics use estimates)."""
    row = conn.execute("SELECT count(*) FROM idempotency_record").fetchone()
    return int(row[0]) if row else 0


def _set_lock_timeout(conn: psycopg.Connection[Any], ms: int) -> None:
    conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{ms}ms",))


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
