"""A guarded call's rollbacks keep its connection's prepared statements.

psycopg forgets (and deallocates on the server) every prepared statement of a connection when a
ROLLBACK goes through its statement cache; every later statement would then be parsed and planned
again until it is prepared anew. The shard rolls back the handler's writes for each stored refusal
(inside the handler's pipeline) and for each failed handler, so both go around the cache
(`db.rollback_keeping_prepared`). Checked on a real connection: the statements PostgreSQL holds as
prepared for the session before and after, and what each rollback left in the tables.
"""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg

from shardrouter.core.keys import new_key, parse_key
from shardrouter.shardd.idempotency import store
from shardrouter.shardd.idempotency.record import ClaimStatus, StoredOutcome
from tests.helpers import completed_record

#: More runs than psycopg's prepare threshold (5): the claim's statements get prepared.
_WARM_UP = 7
#: A stored refusal (FAILED_PRECONDITION).
_REFUSED = StoredOutcome(code=9, message="refused", details=None, response=None, trailers=())


def _prepared(conn: psycopg.Connection) -> set[str]:
    """The session's prepared statements, after any deallocation psycopg has queued (it sends one
    after the statement that follows the ROLLBACK it saw)."""
    conn.execute("SELECT 1").fetchone()
    rows = conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()
    return {row[0] for row in rows}


def _claim(conn: psycopg.Connection) -> tuple[str, datetime]:
    key = str(new_key())
    key_time = parse_key(key).dated_at
    assert key_time is not None
    assert store.claim_key(conn, scope="s", key=key, key_time=key_time).status is ClaimStatus.CLAIMED
    return key, key_time


def test_a_stored_refusal_and_a_failed_handler_keep_the_prepared_statements(database):
    with psycopg.connect(database, autocommit=True) as conn:
        for _ in range(_WARM_UP):
            key, _ = _claim(conn)
            store.release_claim(conn, scope="s", key=key)
        warm = _prepared(conn)
        assert any("pg_try_advisory_lock" in statement for statement in warm), warm

        # A stored refusal: the handler's write rolled back inside its pipeline, the record stored.
        key, key_time = _claim(conn)
        with conn.pipeline():
            store.begin_handler(conn, lock_timeout_ms=1000)
            conn.execute("INSERT INTO accounts (id, currency, balance) VALUES ('refused', 'EUR', 5)")
            refusal = completed_record(
                scope="s", key=key, key_time=key_time, created_at=datetime.now(UTC), outcome=_REFUSED
            )
            store.complete_key(conn, record=refusal, account_id="refused", keep_handler_writes=False)
        assert warm <= _prepared(conn)
        stored = conn.execute("SELECT status_code FROM idempotency_record WHERE key = %s", (key,)).fetchone()
        assert stored == (9,)

        # A failed handler: its transaction rolled back, its key let go.
        key, _ = _claim(conn)
        store.begin_handler(conn, lock_timeout_ms=1000)
        conn.execute("INSERT INTO accounts (id, currency, balance) VALUES ('failed', 'EUR', 5)")
        store.release_claim(conn, scope="s", key=key)
        assert warm <= _prepared(conn)
        assert conn.execute("SELECT count(*) FROM accounts WHERE id IN ('refused', 'failed')").fetchone() == (
            0,
        )
        assert conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone() == (0,)
