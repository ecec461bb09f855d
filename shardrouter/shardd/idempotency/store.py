"""Every SQL statement on `idempotency_record`. The interceptor calls these; it never builds SQL.

A record's `key_time` dates it and picks its monthly partition. A UUIDv7 key dates itself, so its
record is found by its full primary key (scope, key, key_time) in one partition. Any other key (another
UUID version, an opaque key) is dated by its first receipt: its record is found by (scope, key) across
the live partitions.

A guarded call with a UUIDv7 key takes two round trips when it applies, the claim sent ahead of the
handler's statements in their pipeline (`ClaimAhead`), and one when its handler builds its answer in
the database (a Deposit: `shardd.answer_sql`, `complete_key_with_noted_answer`); with its claim sent
first (a key dated by receipt, or while many recent claims were duplicates: `placement.py`) three
when it applies (four for a key dated by receipt) and one when it replays.
`tests/shardd/test_statement_budget.py` pins the statements each runs, `bench/statement_cost.py`
lists them.

Claim sent ahead (pipeline mode, a UUIDv7 key), the first round trip:

    1a ClaimAhead.send: the claim's statement (as 1 below: the record, else the session lock tried),
       which also notes in the transaction whether it took the lock and sets the handler's bounds
       (`set_config(..., is_local)`); a statement that fails unless the lock was taken; BEGIN (the
       pipeline's implicit transaction, the claim's, becomes the handler's)
    2a the handler's statements, in the same pipeline: its first fetch brings the claim's row back too.
       A key already taken: PostgreSQL skips everything after the failing statement until the Sync,
       which rolls the implicit transaction back; what the claim's row says decides the answer
       (EXISTING replayed; a refused lock read once more after the pipeline: EXISTING or IN_FLIGHT)
    3  as below, the second round trip; or, when the handler noted its answer in the database
       (its statement built the serialised response and set it in a transaction-local setting),
       the record's insert storing what was noted and the COMMIT go in the same pipeline, so the
       call is one round trip. A statement that wrote nothing noted nothing: no record is stored,
       the COMMIT commits nothing, the session lock still holds the key, and the handler runs again
       as after a claim sent first (2 and 3 below), fetching what it needs to say why

Claim sent first, the three round trips:

    1  claim_key (autocommit, no transaction): one plain statement reads the key's committed record
       and, only when there is none, tries the key's session advisory lock, hash(scope, key):
         record found                  -> EXISTING, replayed, no lock taken or waited for
         lock granted, UUIDv7 key      -> CLAIMED without a second read: a twin that committed in
           between is caught by the primary key (below)
         lock granted, key dated by receipt: a second statement reads again, started after the lock
           was granted, so it sees every twin that committed (and so let the lock go) before it:
           nothing found -> CLAIMED, found -> EXISTING (the lock is let go at once)
         lock refused                  -> a second read: EXISTING if the holder has just committed,
           else IN_FLIGHT
    2  the handler: BEGIN and the transaction's bounds (`begin_handler`: a row lock's wait and the
       caller's deadline, `set_config(..., is_local)`, so the COMMIT or ROLLBACK puts the session's
       back) travel in the pipeline with its first statement; a Deposit is one statement
    3  complete_key: the completed record's INSERT, in the statement that hands the key from the
       session lock to a transaction lock (`HAND_OVER`, which the COMMIT lets go), and the COMMIT,
       sent with the pipeline's Sync

The pooled connections use generic plans (`db.py`): a custom plan of the claim on the partitioned
key table was made again on every call, about 0.1 ms of the database's time. The lock's key is the
expression of migrations 12 and 17's functions (`idempotency_claim`, `idempotency_release`), which
stay for a daemon of an earlier release: both exclude each other's twins.

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
from shardrouter.shardd.answer_sql import NOTED_ANSWER
from shardrouter.shardd.db import bigint, rollback_keeping_prepared
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
_RECORD_COLUMNS = ", ".join(f"r.{column.strip()}" for column in _COLUMNS.split(","))
#: The advisory lock of a key: the same expression as the functions of migrations 12 and 17, so a
#: daemon of either release excludes the other's twins.
_KEY_LOCK = "hashtextextended(%(scope)s || ' ' || %(key)s, 0)"
#: The key's completed record, found by its full primary key (a UUIDv7: one partition).
_DATED_RECORD = (
    f"SELECT {_RECORD_COLUMNS} FROM idempotency_record r"
    " WHERE r.scope = %(scope)s AND r.key = %(key)s AND r.key_time = %(key_time)s AND r.state = 'completed'"
)
#: The key's completed record in any live partition (a key dated by its first receipt).
_UNDATED_RECORD = (
    f"SELECT {_RECORD_COLUMNS} FROM idempotency_record r"
    " WHERE r.scope = %(scope)s AND r.key = %(key)s AND r.state = 'completed' ORDER BY r.key_time LIMIT 1"
)
#: The claim: the key's record if it is there, else the key's session lock tried (CASE evaluates the
#: lock only when no record was found: a replay takes no lock).
_CLAIM_SQL = (
    f"SELECT now() AS claimed_at, CASE WHEN r.key IS NULL THEN pg_try_advisory_lock({_KEY_LOCK}) END AS locked,"
    " r.* FROM (SELECT 1) AS one LEFT JOIN LATERAL ({record}) AS r ON true"
)
#: The hand-over of a claimed key, once per row of `{rows}`: its transaction lock taken (the COMMIT
#: lets it go), then its session lock let go; OFFSET 0 keeps the two in that order. `{columns}`:
#: what else each row returns ("" or ", " and columns of `{rows}`).
HAND_OVER_RETURNING = (
    f"SELECT pg_advisory_unlock({_KEY_LOCK}){{columns}} FROM"
    f" (SELECT pg_advisory_xact_lock({_KEY_LOCK}), * FROM {{rows}} OFFSET 0) AS handed_over"
)
HAND_OVER = HAND_OVER_RETURNING.replace("{columns}", "")
_CLAIM_DATED = _CLAIM_SQL.format(record=_DATED_RECORD)
_CLAIM_UNDATED = _CLAIM_SQL.format(record=_UNDATED_RECORD)


def claim_key(
    conn: psycopg.Connection[Any],
    *,
    scope: str,
    key: str,
    key_time: datetime,
    dated_by_key: bool = True,
) -> Claim:
    """Claim a key (on an autocommit connection outside any transaction).

    `key_time`: the date of a record this call makes; `dated_by_key`: whether the key carries it (a
    UUIDv7), so its record can only be in that partition, or it is this receipt's time, so a record
    of the key may be in any partition. CLAIMED leaves the key's session lock held by `conn` until
    `complete_key` or `release_claim` lets it go.
    """
    params = {"scope": scope, "key": key, "key_time": key_time}
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_CLAIM_DATED if dated_by_key else _CLAIM_UNDATED, params).fetchone()
        assert row is not None  # one row, from the one-row left side
        if row["key"] is not None:
            return Claim(ClaimStatus.EXISTING, _record(row))
        if row["locked"] and dated_by_key:
            # No second read: a twin that committed between the read and the lock is caught by the
            # primary key when this call's record is inserted (the retry replays the twin's).
            return Claim(ClaimStatus.CLAIMED, created_at=row["claimed_at"])
        # Read again, in a statement started after the lock was granted or refused: granted (a key
        # dated by receipt) -> it sees every twin that committed and so let the lock go; refused ->
        # the holder may have just committed.
        again = cur.execute(_DATED_RECORD if dated_by_key else _UNDATED_RECORD, params).fetchone()
    if again is not None:
        if row["locked"]:
            _release(conn, scope, key)
        return Claim(ClaimStatus.EXISTING, _record(again))
    if not row["locked"]:
        return Claim(ClaimStatus.IN_FLIGHT)
    return Claim(ClaimStatus.CLAIMED, created_at=row["claimed_at"])


#: The handler transaction's bounds, for that transaction alone (`is_local`): the COMMIT or ROLLBACK
#: puts the session's own back, with no statement of ours. The caller's deadline bounds each
#: statement, and (a margin later) the transaction as a whole: a daemon that stalls mid-transaction (stopped,
#: starved, a long pause) has its session ended by PostgreSQL once the call's deadline has passed,
#: which rolls the transaction back and frees its row locks and the key for the retry, instead of
#: holding them for as long as it stalls. `transaction_timeout` (PostgreSQL 17) is a timer that
#: fires while the session waits for the client mid-pipeline; before 17, the idle-in-transaction
#: timeout, which PostgreSQL arms only after a Sync (so for unpipelined calls alone).
#: How long past the call's deadline a transaction may stay open before PostgreSQL ends its session
#: (ms): after the deadline's statement_timeout, so that a running statement is cancelled, not killed.
STALLED_SESSION_MARGIN_MS = 1000
_BOUNDS = (
    "SELECT set_config('lock_timeout', coalesce(%s, current_setting('lock_timeout')), true),"
    " set_config('statement_timeout', coalesce(%s, current_setting('statement_timeout')), true),"
    " set_config('{whole}', coalesce(%s, current_setting('{whole}')), true)"
)
_BOUNDS_17 = _BOUNDS.format(whole="transaction_timeout")
_BOUNDS_BEFORE_17 = _BOUNDS.format(whole="idle_in_transaction_session_timeout")


def begin_handler(
    conn: psycopg.Connection[Any],
    *,
    lock_timeout_ms: int | None = None,
    statement_timeout_ms: int | None = None,
) -> None:
    """Open the handler's transaction, bounded by `lock_timeout_ms` (a row lock's wait) and
    `statement_timeout_ms` (the caller's deadline, for each statement and each pause between them;
    None keeps the session's), or not at all when
    neither is given. Nothing is fetched, so in pipeline mode it travels with the handler's first
    statement."""
    conn.execute("BEGIN")
    if lock_timeout_ms is not None or statement_timeout_ms is not None:
        bounds = _BOUNDS_17 if conn.info.server_version >= 170000 else _BOUNDS_BEFORE_17
        conn.execute(bounds, _bound_values(lock_timeout_ms, statement_timeout_ms))


def _bound_values(lock_timeout_ms: int | None, statement_timeout_ms: int | None) -> tuple[str | None, ...]:
    """The three bounds' settings (None keeps the session's): a row lock's wait, each statement, and
    the whole transaction. The whole transaction's bound comes a moment after the deadline: a
    statement still running at the deadline is cancelled (DEADLINE_EXCEEDED, the connection kept),
    and only a session left waiting on a stalled daemon is ended."""
    deadline = f"{statement_timeout_ms}ms" if statement_timeout_ms else None
    whole = f"{statement_timeout_ms + STALLED_SESSION_MARGIN_MS}ms" if statement_timeout_ms else None
    return (f"{lock_timeout_ms}ms" if lock_timeout_ms is not None else None, deadline, whole)


#: The claim sent ahead of the handler (a UUIDv7 key, in pipeline mode): `_CLAIM_DATED`, whose
#: outcome is also noted in the transaction (`shardrouter.key_claimed`, local to it), and the
#: handler's bounds. OFFSET 0 evaluates the claim before the note.
_CLAIM_AHEAD = (
    "SELECT c.*, set_config('shardrouter.key_claimed', coalesce(c.locked, false)::text, true) AS noted,"
    " set_config('lock_timeout', coalesce(%(lock)s, current_setting('lock_timeout')), true) AS lock_bound,"
    " set_config('statement_timeout', coalesce(%(deadline)s, current_setting('statement_timeout')), true)"
    " AS statement_bound,"
    " set_config('{whole}', coalesce(%(whole)s, current_setting('{whole}')), true) AS whole_bound"
    f" FROM ({_CLAIM_DATED} OFFSET 0) AS c"
)
_CLAIM_AHEAD_17 = _CLAIM_AHEAD.format(whole="transaction_timeout")
_CLAIM_AHEAD_BEFORE_17 = _CLAIM_AHEAD.format(whole="idle_in_transaction_session_timeout")
#: Fails unless the claim ahead of it took the key: PostgreSQL then skips every statement after it
#: until the pipeline's Sync (the handler's, the record's, the COMMIT), and the Sync rolls the
#: implicit transaction back. Plain SQL: a text that is not a boolean, built from the note so that
#: the planner cannot evaluate it ahead of time.
_CLAIM_REQUIRED = (
    "SELECT CASE WHEN current_setting('shardrouter.key_claimed') = 'true' THEN true"
    " ELSE ('the idempotency key was not claimed: ' || current_setting('shardrouter.key_claimed'))::bool END"
)


class ClaimAhead:
    """A claim sent ahead of the handler's statements, in the same pipeline and transaction.

    The claim runs first, then a statement that fails unless the claim took the key, then BEGIN
    (which makes the pipeline's implicit transaction, the claim's, the handler's), then the
    handler's statements: a new key costs no round trip of its own, and a key already taken stops
    the pipeline before anything of the handler's reaches the database. Its outcome is read from
    the claim's row once the database has answered (`claim()`); psycopg may raise the stopping
    statement's failure from any statement sent after it, `send` included.
    """

    __slots__ = ("_claim", "_cursor", "_params", "stored")

    def __init__(self, conn: psycopg.Connection[Any], *, scope: str, key: str, key_time: datetime) -> None:
        """The claim of a key dated by itself (a UUIDv7), on `conn`, before it is sent."""
        self._cursor = conn.cursor(row_factory=dict_row)
        self._params: dict[str, Any] = {"scope": scope, "key": key, "key_time": key_time}
        self._claim: Claim | None = None
        #: The record's insert, when the handler noted its answer (`complete_key_with_noted_answer`).
        self.stored: psycopg.Cursor[Any] | None = None

    def send(self, *, lock_timeout_ms: int | None = None, statement_timeout_ms: int | None = None) -> None:
        """Queue, in the connection's pipeline, the claim, the statement that stops the pipeline
        unless it took the key, and the BEGIN of the handler's transaction with its bounds (as
        `begin_handler`). Nothing is fetched: it all travels with the handler's first statement."""
        conn = self._cursor.connection
        lock, deadline, whole = _bound_values(lock_timeout_ms, statement_timeout_ms)
        sql = _CLAIM_AHEAD_17 if conn.info.server_version >= 170000 else _CLAIM_AHEAD_BEFORE_17
        self._cursor.execute(sql, {**self._params, "lock": lock, "deadline": deadline, "whole": whole})
        conn.execute(_CLAIM_REQUIRED)
        conn.execute("BEGIN")

    def claim(self) -> Claim:
        """What the claim found: CLAIMED (the key's session lock is held), EXISTING (its committed
        record), or IN_FLIGHT (the lock was refused). Fetches the claim's row if it is not back yet
        (in the pipeline, a flush)."""
        if self._claim is None:
            row = self._cursor.fetchone()
            assert row is not None  # one row, from the one-row left side
            if row["key"] is not None:
                self._claim = Claim(ClaimStatus.EXISTING, _record(row))
            elif row["locked"]:
                self._claim = Claim(ClaimStatus.CLAIMED, created_at=row["claimed_at"])
            else:
                self._claim = Claim(ClaimStatus.IN_FLIGHT)
        return self._claim

    def noted_answer(self) -> bytes | None:
        """After the pipeline, when the handler noted its answer: the answer as stored, or None
        when it noted none (no record was stored, and the key is still held)."""
        assert self.stored is not None
        row = self.stored.fetchone()
        return None if row is None else bytes(row[-1])

    def settle(self) -> Claim:
        """After the pipeline: `claim()`, where a refused lock is read again, in a statement started
        after it was refused (as `claim_key` does): EXISTING if the holder has just committed."""
        claim = self.claim()
        if claim.status is not ClaimStatus.IN_FLIGHT:
            return claim
        with self._cursor.connection.cursor(row_factory=dict_row) as again:
            found = again.execute(_DATED_RECORD, self._params).fetchone()
        return claim if found is None else Claim(ClaimStatus.EXISTING, _record(found))


_INSERT_COMPLETED = (
    "INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state, status_code,"
    " status_message, status_details, response, trailers, created_at, completed_at, first_traceparent,"
    " account_hash)"
)
#: The completed record's insert and the key's hand-over (`HAND_OVER`), in one statement.
_STORE_COMPLETED = (
    f"WITH stored AS ({_INSERT_COMPLETED}"
    " VALUES (%(scope)s, %(key)s, %(key_time)s, %(method)s, %(hash)s, 'completed', %(code)s, %(message)s,"
    " %(details)s, %(response)s, %(trailers)s, %(created_at)s, now(), %(traceparent)s, %(account_hash)s)"
    " RETURNING 1) " + HAND_OVER.format(rows="stored")
)
#: As `_STORE_COMPLETED` for a success whose answer the handler's statement noted (`answer_sql`):
#: the record holds the noted bytes, dated by this transaction's start (the claim's, sent ahead in
#: it), and the statement returns them; no answer noted, no record and no hand-over (no row).
_STORE_NOTED_ANSWER = (
    f"WITH stored AS ({_INSERT_COMPLETED}"
    " SELECT %(scope)s, %(key)s, %(key_time)s, %(method)s, %(hash)s, 'completed', 0, '', NULL, noted.answer,"
    " %(trailers)s, now(), now(), %(traceparent)s, %(account_hash)s"
    f" FROM (SELECT {NOTED_ANSWER} AS answer) AS noted WHERE noted.answer IS NOT NULL"
    " RETURNING response) " + HAND_OVER_RETURNING.format(rows="stored", columns=", response")
)


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
        rollback_keeping_prepared(conn)  # the record is then stored by an implicit transaction of its own
    outcome = record.outcome
    assert outcome is not None
    conn.execute(
        _STORE_COMPLETED,
        {
            **_record_params(record, account_id),
            "code": outcome.code,
            "message": outcome.message,
            "details": outcome.details,
            "response": outcome.response,
            "created_at": record.created_at,
        },
    )
    if keep_handler_writes:
        conn.execute("COMMIT")


def complete_key_with_noted_answer(
    conn: psycopg.Connection[Any], *, record: IdempotencyRecord, account_id: str | None
) -> psycopg.Cursor[Any]:
    """Store the completed record of a claimed key whose handler noted its answer in this
    transaction (`answer_sql`), release the key at the COMMIT, and commit; nothing is fetched. The
    cursor's one row, once the pipeline has ended, holds the answer as stored; no row: the handler
    noted none (its statement wrote nothing), so the COMMIT stored nothing and the key stays held."""
    stored = conn.execute(_STORE_NOTED_ANSWER, _record_params(record, account_id))
    conn.execute("COMMIT")
    return stored


def _record_params(record: IdempotencyRecord, account_id: str | None) -> dict[str, Any]:
    """The parameters of a completed record's insert that do not depend on how its answer is built."""
    assert record.outcome is not None
    return {
        "scope": record.scope,
        "key": record.key,
        "key_time": record.key_time,
        "method": record.method,
        "hash": record.request_hash,
        "trailers": Jsonb(record.outcome.trailers_json()),
        "traceparent": record.first_traceparent,
        "account_hash": bigint(account_hash(account_id)) if account_id else None,
    }


def release_claim(conn: psycopg.Connection[Any], *, scope: str, key: str) -> None:
    """After a failed call: roll back the handler's transaction and release the key. A connection
    that cannot is closed (its session, and the lock with it, ends)."""
    try:
        if conn.info.transaction_status is not TransactionStatus.IDLE:
            rollback_keeping_prepared(conn)
        _release(conn, scope, key).fetchone()
    except psycopg.Error:
        conn.close()


#: The session holding a key's claim (its advisory lock, `_KEY_LOCK` split into the two halves
#: pg_locks shows), when it waits on its client (the daemon) since `stalled` ago: told to end.
#: Waiting on the client in the middle of a call means the daemon does not go on; `state_change` is
#: when the session last began a statement or went idle, so a session whose last statement ran long
#: counts from that statement's start. The terminating call waits (up to `exit_wait_ms`) until the
#: session is gone, so the key is free when it returns.
_END_STALLED_CLAIM = (
    f"WITH k AS (SELECT {_KEY_LOCK} AS h)"
    " SELECT bool_or(pg_terminate_backend(a.pid, %(exit_wait_ms)s)) FROM k, pg_locks l"
    " JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND l.classid = ((k.h >> 32) & 4294967295)::oid AND l.objid = (k.h & 4294967295)::oid"
    " AND a.pid <> pg_backend_pid() AND a.wait_event = 'ClientRead'"
    " AND a.state_change < clock_timestamp() - %(stalled)s::interval"
)


#: How long ending a stalled claim waits for its session to exit (ms): a few, normally.
_SESSION_EXIT_WAIT_MS = 1000


def end_stalled_claim(conn: psycopg.Connection[Any], *, scope: str, key: str, stalled_ms: int) -> bool:
    """End the session holding the key's claim if it has waited on its daemon for over `stalled_ms`
    (`pg_terminate_backend`: its transaction rolls back, its key and row locks go with it); whether
    one was told to end, and then it has exited (the key is free, unless a commit already under way
    completed first)."""
    params = {"scope": scope, "key": key, "stalled": f"{stalled_ms}ms", "exit_wait_ms": _SESSION_EXIT_WAIT_MS}
    row = conn.execute(_END_STALLED_CLAIM, params).fetchone()
    return bool(row and row[0])


def _release(conn: psycopg.Connection[Any], scope: str, key: str) -> psycopg.Cursor[Any]:
    return conn.execute(f"SELECT pg_advisory_unlock({_KEY_LOCK})", {"scope": scope, "key": key})


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
    "HAND_OVER",
    "STALLED_SESSION_MARGIN_MS",
    "ClaimAhead",
    "begin_handler",
    "claim_key",
    "complete_key",
    "complete_key_with_noted_answer",
    "end_stalled_claim",
    "find_key",
    "find_keys",
    "release_claim",
]
