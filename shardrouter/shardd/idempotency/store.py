"""Every SQL statement on `idempotency_record`. The interceptor calls these; it never builds SQL.

A record's `key_time` dates it and picks its monthly partition. A UUIDv7 key dates itself, so its
record is found by its full primary key (scope, key, key_time) in one partition. Any other key (another
UUID version, an opaque key) is dated by its first receipt: its record is found by (scope, key) across
the live partitions.

A guarded call takes three round trips when it applies, one when it replays; PostgreSQL runs six
statements inside them for a new-key Deposit (the record read, the session bounds, a slot fence check
per row written, the release; seven for a key dated by receipt, read twice) and one for a replay (`tests/shardd/test_statement_budget.py` pins
these, `bench/statement_cost.py` lists them):

    1  claim_key (autocommit, no transaction): `idempotency_claim` (migrations 12 and 17) reads the
       key's committed record; found -> EXISTING, replayed, no lock taken or waited for. Else it
       tries the key's session advisory lock, hash(scope, key):
         lock granted, key dated by receipt: it reads again, in a query started after the lock was
           granted, which sees every twin that committed (and so let the lock go) before it:
           nothing found -> CLAIMED, found -> EXISTING (the lock is let go at once)
         lock granted, UUIDv7 key      -> CLAIMED without a second read: a twin that committed in
           between is caught by the primary key (below)
         lock refused                  -> EXISTING if the holder has just committed, else IN_FLIGHT
    2  the handler: BEGIN and the call's timeouts (`begin_handler`) travel in the pipeline with its
       first statement; a Deposit is one statement
    3  complete_key: the completed record's INSERT, in the statement that hands the key from the
       session lock to a transaction lock (`idempotency_release`, which is let go by the COMMIT),
       and the COMMIT, sent with the pipeline's Sync

There is no in-progress row: while the handler runs, the session lock is the claim, and the record
appears, completed, with the handler's writes at COMMIT or not at all. The lock is a session lock (it
outlives the claim's own statement); the statement that stores the record exchanges it for a
transaction lock on the same key, which the COMMIT releases, so no twin can read "no record" and take
the key while the outcome is not visible yet. A handler's refusal that is stored
(`NOT_FOUND`, `FAILED_PRECONDITION`) rolls the handler's writes back and stores the refusal in its own
statement, still under the lock: no savepoint. If the call fails, `release_claim` rolls back and
releases the lock; a connection that cannot do that is closed, which ends its session and its locks.

The primary key is the backstop for a UUIDv7 key, and what decides it when a twin commits between the
claim's read and its lock: a completed record inserted twice violates it and the second COMMIT fails
(its handler's writes rolled back, answered as in flight; the retry replays the first).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from shardrouter.core.shardmap import account_hash
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
_CLAIM = "SELECT c.claim, c.claimed_at, (c.record).* FROM idempotency_claim(%s, %s, %s, %s, %s) AS c"


def claim_key(
    conn: psycopg.Connection[Any],
    *,
    scope: str,
    key: str,
    key_time: datetime,
    dated_by_key: bool = True,
    handler_lock_timeout_ms: int = 2000,
    statement_timeout_ms: int | None = None,
) -> Claim:
    """Claim a key (one statement, on an autocommit connection outside any transaction).

    `key_time`: the date of a record this call makes; `dated_by_key`: whether the key carries it (a
    UUIDv7), so its record can only be in that partition, or it is this receipt's time, so a record
    of the key may be in any partition. CLAIMED leaves the key's session lock held by `conn`, and the
    session's statements bound by `handler_lock_timeout_ms` (a row lock's wait) and
    `statement_timeout_ms` (the caller's deadline; None keeps the session's) until `complete_key` or
    `release_claim` lets the key go and puts the session's own bounds back.
    """
    bounds = (f"{handler_lock_timeout_ms}ms", f"{statement_timeout_ms}ms" if statement_timeout_ms else None)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_CLAIM, (scope, key, key_time if dated_by_key else None, *bounds)).fetchone()
    assert row is not None  # the function returns one row
    status = ClaimStatus(row["claim"])
    if status is ClaimStatus.EXISTING:
        return Claim(status, _record(row))
    return Claim(status, created_at=row["claimed_at"])


def begin_handler(conn: psycopg.Connection[Any]) -> None:
    """Open the handler's transaction (the claim has set its bounds). Nothing is fetched, so in
    pipeline mode it travels with the handler's first statement."""
    conn.execute("BEGIN")


def complete_key(
    conn: psycopg.Connection[Any],
    *,
    record: IdempotencyRecord,
    account_id: str | None,
    keep_handler_writes: bool,
) -> None:
    """Store the completed record of a claimed key, release the key at the COMMIT, and commit.

    `keep_handler_writes`: False for a stored refusal, whose handler writes are rolled back first
    (the record is then stored by a statement of its own, the key still held). Nothing is fetched:
    in pipeline mode it all goes with the Sync that ends the pipeline, and the first error is
    raised there.
    """
    if not keep_handler_writes:
        conn.execute("ROLLBACK")  # the record is then stored by an implicit transaction of its own
    outcome = record.outcome
    assert outcome is not None
    conn.execute(
        "WITH stored AS (INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state,"
        " status_code, status_message, status_details, response, trailers, created_at, completed_at,"
        " first_traceparent, account_hash)"
        " VALUES (%(scope)s, %(key)s, %(key_time)s, %(method)s, %(hash)s, 'completed', %(code)s, %(message)s,"
        " %(details)s, %(response)s, %(trailers)s, %(created_at)s, now(), %(traceparent)s, %(account_hash)s)"
        " RETURNING 1)"
        " SELECT idempotency_release(%(scope)s, %(key)s, true) FROM stored",
        {
            "scope": record.scope,
            "key": record.key,
            "key_time": record.key_time,
            "method": record.method,
            "hash": record.request_hash,
            "code": outcome.code,
            "message": outcome.message,
            "details": outcome.details,
            "response": outcome.response,
            "trailers": Jsonb(outcome.trailers_json()),
            "created_at": record.created_at,
            "traceparent": record.first_traceparent,
            "account_hash": account_hash(account_id) if account_id else None,
        },
    )
    if keep_handler_writes:
        conn.execute("COMMIT")


def release_claim(conn: psycopg.Connection[Any], *, scope: str, key: str) -> None:
    """After a failed call: roll back the handler's transaction and release the key. A connection
    that cannot is closed (its session, and the lock with it, ends)."""
    try:
        if conn.info.transaction_status is not TransactionStatus.IDLE:
            conn.execute("ROLLBACK")
        _release(conn, scope, key).fetchone()
    except psycopg.Error:
        conn.close()


def _release(conn: psycopg.Connection[Any], scope: str, key: str) -> psycopg.Cursor[Any]:
    return conn.execute("SELECT idempotency_release(%s, %s, false)", (scope, key))


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


def find_keys(conn: psycopg.Connection[Any], keys: Sequence[tuple[str, datetime]]) -> list[IdempotencyRecord]:
    """Every record of many self-dated keys (key, key_time) across scopes, in one statement: only
    their partitions are read, each once (no index leads with the key alone)."""
    if not keys:
        return []
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            f"SELECT {_COLUMNS} FROM idempotency_record WHERE key = ANY(%s) AND key_time = ANY(%s)",
            ([k for k, _ in keys], sorted({t for _, t in keys})),
        ).fetchall()
    wanted = set(keys)
    return [r for r in map(_record, rows) if (r.key, r.key_time) in wanted]


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
    "begin_handler",
    "claim_key",
    "complete_key",
    "find_key",
    "find_keys",
    "release_claim",
]
