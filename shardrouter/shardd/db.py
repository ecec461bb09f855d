"""The shard's PostgreSQL pool, the per-call transaction, and the mapping of database failures.

The idempotency interceptor opens the one transaction of a mutating call and publishes its connection
in a context variable; handlers take it with `current_transaction()`, so the key claim, the handler's
writes and the stored outcome commit together. Read-only handlers open their own with `read()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import psycopg
import psycopg_pool
from google.protobuf.message import Message
from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
from opentelemetry.trace import TracerProvider
from psycopg import errors
from psycopg._preparing import Key, Prepare, PrepareManager
from psycopg._queries import PostgresQuery
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.pq.abc import PGresult
from psycopg.types.numeric import Int8

from shardrouter.core import tracing
from shardrouter.core.errors import DeadlineExceeded, Internal, Reason, Unavailable

log = logging.getLogger(__name__)

Connection = psycopg.Connection[Any]
_Response = TypeVar("_Response", bound=Message)


@dataclass(slots=True)
class CallTransaction:
    """The open transaction of a guarded call and the idempotency key it claimed."""

    conn: Connection
    #: Its canonical text (a UUID's lower-case form, or an opaque key as sent).
    key: str
    #: Whether the handler may build its answer in its statement (`answer_sql`) instead of fetching
    #: what it needs to build it here: the claim, the handler's statements, the record and the
    #: COMMIT then go in one round trip. Only where the claim travels with the handler.
    answers_in_database: bool = False
    #: Whether the handler did (`answer_noted`).
    answer_noted: bool = False

    def answered_in_database(self, response_type: type[_Response]) -> _Response:
        """What a handler returns once its statement noted the call's answer (`answer_sql.noting_answer`)
        in a transaction that `answers_in_database`: an empty `response_type`, which the interceptor
        never serialises; it stores and answers the bytes the statement built. A statement that wrote
        nothing noted nothing, and the interceptor runs the handler again, answers fetched."""
        assert self.answers_in_database, (
            "the answer can be noted only where the transaction answers in the database"
        )
        self.answer_noted = True
        return response_type()


_current: contextvars.ContextVar[CallTransaction | None] = contextvars.ContextVar("shardd_txn", default=None)


class Database:
    """A connection pool to the shard's database with failures mapped to domain errors."""

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = 2,
        max_size: int = 16,
        acquire_timeout_s: float = 2.0,
        transient_retry_ms: int = 250,
        check_connections: bool = True,
        pipeline: bool = True,
        tracer_provider: TracerProvider | None = None,
        traced: bool = False,
    ) -> None:
        """`pipeline`: the handler's transaction of a guarded call runs in psycopg's pipeline mode
        (`idempotency.steps.DatabaseKeys`), so it costs two round trips, not one per statement.
        `traced`: every pooled connection's statements become spans (OpenTelemetry's psycopg
        instrumentation, to `tracer_provider` or the global provider); the SQL text is recorded,
        never the parameters."""
        if min_size < 1 or max_size < min_size:
            raise ValueError("pool sizes must satisfy 1 <= min_size <= max_size")
        if acquire_timeout_s <= 0:
            raise ValueError("acquire_timeout_s must be positive")
        self.acquire_timeout_s = acquire_timeout_s
        #: Where this database's spans go (None: the global provider); background jobs that use the
        #: pool (the outbox relay) open their job spans on the same provider.
        self.tracer_provider = tracer_provider
        self.traced = traced
        self.transient_retry_ms = transient_retry_ms
        self.pipeline = pipeline
        #: Called when a write meets a slot fence: the shard daemon re-reads its shard map then, so
        #: once a move has committed its next refusal names the new owner (ACCOUNT_MOVED).
        self.on_slot_fenced: Callable[[], object] | None = None
        configure = functools.partial(_configure, traced=traced, tracer_provider=tracer_provider)
        self.checks = ConnectionChecks()
        self.pool: psycopg_pool.ConnectionPool[Connection] = psycopg_pool.ConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            open=False,
            name="shardd",
            # A checkout after a database restart gets a fresh connection instead of a dead one; a
            # connection back from a call a moment ago is not probed again (one round trip saved).
            # No `reset` callback: with one, psycopg_pool hands every returned connection to a worker
            # thread (a thread hop and two wake-ups per call, 13% of a busy shard's GIL time), so
            # `connection()` notes the return time itself.
            check=self.checks.check if check_connections else None,
            # Autocommit: a guarded call's claim is a statement of its own, outside any transaction
            # (idempotency.store); every other use opens one with `conn.transaction()`.
            kwargs={"autocommit": True, "application_name": "shardd"},
            reconnect_timeout=3600,
            configure=configure,
        )

    def open(self, wait_s: float = 30.0) -> None:
        """Open the pool and wait until `min_size` connections are up."""
        self.pool.open(wait=True, timeout=wait_s)

    def close(self) -> None:
        """Close every connection."""
        self.pool.close()

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A pooled connection; pool exhaustion and connection failure become UNAVAILABLE fast.

        A user that leaves normally must leave no transaction open: psycopg_pool commits whatever is
        open when its context ends without an exception, so a path that forgot a guarded call's
        handler transaction (its writes without their record, say) would commit it there. Such a
        transaction is rolled back instead and the user gets Internal (`_refuse_open_transaction`).
        """
        try:
            with self.pool.connection(timeout=self.acquire_timeout_s) as conn:
                try:
                    yield conn
                    _refuse_open_transaction(conn)
                finally:
                    self.checks.returned(conn)
        except psycopg_pool.PoolTimeout as exc:
            raise Unavailable(
                f"the shard's database connections are all busy (waited {self.acquire_timeout_s:g} s); "
                "nothing was applied, retry with the same idempotency key",
                reason=Reason.DATABASE_BUSY,
                retry_after_ms=self.transient_retry_ms,
            ) from exc

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection in a read-only transaction, with database failures mapped."""
        with mapped_database_errors(self.transient_retry_ms), self.connection() as conn:
            with conn.transaction():
                conn.execute("SET TRANSACTION READ ONLY")
                yield conn


def _refuse_open_transaction(conn: Connection) -> None:
    """Roll back a transaction left open (or failed) on a connection about to go back to the pool,
    and raise Internal: nothing of it is applied. Idle (or closed): nothing to do."""
    if conn.closed or conn.info.transaction_status not in _OPEN:
        return
    try:
        rollback_keeping_prepared(conn)  # the connection's prepared statements stay for its next calls
    except psycopg.Error:
        conn.close()  # its session ends, and the transaction with it
    raise Internal(
        "a database transaction was left open when the call ended; it was rolled back, nothing of it applied"
    )


_OPEN = frozenset({TransactionStatus.INTRANS, TransactionStatus.INERROR})


class ConnectionChecks:
    """The pool's liveness probe, only for connections idle in the pool for a while.

    A connection that came back from a call less than `idle_s` ago was alive then; probing it again
    costs a round trip on every call. One idle longer (across a database restart, say) is probed,
    so a dead one is replaced before a call gets it. A connection that breaks during a call is
    discarded by the pool when it is returned.
    """

    def __init__(self, idle_s: float = 1.0) -> None:
        self.idle_s = idle_s
        self.probes = 0  # how many probes ran (for tests and curiosity)
        self._returned: weakref.WeakKeyDictionary[Connection, float] = weakref.WeakKeyDictionary()

    def returned(self, conn: Connection) -> None:
        """The connection goes back to the pool from a call (if it broke there, the pool drops it)."""
        self._returned[conn] = time.monotonic()

    def check(self, conn: Connection) -> None:
        """psycopg_pool's `check` callback: probe unless the connection was in use a moment ago."""
        back = self._returned.get(conn)
        if back is not None and time.monotonic() - back < self.idle_s:
            return
        self.probes += 1
        _check_connection(conn)


def _check_connection(conn: Connection) -> None:
    """psycopg_pool's `check_connection`, through a plain cursor: a liveness probe at every checkout
    is not a statement worth a span (a traced connection's own cursors would make one)."""
    was_autocommit = conn.autocommit
    conn.autocommit = True
    try:
        with psycopg.Cursor(conn) as probe:
            probe.execute("")
    finally:
        with contextlib.suppress(Exception):  # a closed connection must not hide the first error
            conn.autocommit = was_autocommit


def _configure(conn: Connection, *, traced: bool, tracer_provider: TracerProvider | None) -> None:
    """A new pooled connection: generic plans, and its statements traced when asked.

    Generic plans: a custom plan of a statement on the partitioned key table is made again on every
    call (the planner prices the generic plan with every partition in it, so `auto` keeps choosing
    custom ones), about 0.1 ms of the database's time per claim; a generic plan prunes partitions
    when it starts. The shard's statements are short lookups by key, where a custom plan buys
    nothing.
    """
    conn.execute("SET plan_cache_mode = force_generic_plan")
    if isinstance(conn._prepared, PrepareManager):
        conn._prepared = PipelineSafePrepares()
    if traced:
        _trace_statements(conn, tracer_provider=tracer_provider)


class PipelineSafePrepares(PrepareManager):
    """psycopg's cache of a connection's prepared statements, kept true across aborted pipelines.

    A guarded call's claim stops its pipeline when the key is taken (`store.ClaimAhead`), so the
    statements queued after it are skipped, a Parse among them too. psycopg 3.3 does not check the
    result of a statement it prepares on reaching the threshold (its count moves to a name) and
    keeps a name the server never made: "prepared statement _pg3_N does not exist" on the next call
    of that connection. Here that first preparation is checked like any other; and one whose
    statement failed when run keeps its name, since in a pipeline a Parse that fails makes its
    Execute skipped, not failed: the server holds it (psycopg would forget it, and make it again
    under a new name at each failure, one more on the server each time).
    """

    def maybe_add_to_cache(self, query: PostgresQuery, prep: Prepare, name: bytes) -> Key | None:
        """psycopg's, and the key of a statement prepared for the first time, so that its result
        is validated."""
        key = super().maybe_add_to_cache(query, prep, name)
        return self.key(query) if key is None and prep is Prepare.SHOULD else key

    def validate(self, key: Key, prep: Prepare, name: bytes, results: Sequence[PGresult]) -> None:
        """psycopg's, except that a statement prepared by this call which then failed keeps its name."""
        if prep is Prepare.SHOULD and len(results) == 1 and results[0].status == ExecStatus.FATAL_ERROR:
            self._rotate()
            return
        super().validate(key, prep, name, results)


def _trace_statements(conn: Connection, *, tracer_provider: TracerProvider | None) -> None:
    # Swaps the connection's cursor factory for a traced one; it sends nothing to the server.
    PsycopgInstrumentor.instrument_connection(conn, tracer_provider=tracer_provider)


def trace_connection(conn: Connection, *, tracer_provider: TracerProvider | None = None) -> bool:
    """Statement spans for a connection outside the pool (the partition keeper's, the retention
    job's), when tracing is on (`tracer_provider` given, or an SDK provider installed globally).

    True if the connection is now traced. Pooled connections get theirs from `Database(traced=True)`.
    """
    if not tracing.tracing_active(tracer_provider):
        return False
    _trace_statements(conn, tracer_provider=tracer_provider)
    return True


def bigint(value: int) -> Int8:
    """An integer parameter sent as a bigint whatever its size. psycopg sends a Python int as int2,
    int4 or int8 by its value, and PostgreSQL and psycopg's statement cache take each type as a
    statement of its own: amounts of any size, or account hashes above 2**31, would otherwise make
    two or three prepared statements (and plans, and pg_stat_statements rows) of one SQL text."""
    return Int8(value)


def rollback_keeping_prepared(conn: Connection) -> None:
    """Send ROLLBACK on `conn` (in pipeline mode too) without losing its prepared statements.

    psycopg forgets every prepared statement of a connection when it sees a ROLLBACK go through its
    statement cache, and deallocates them on the server (`DEALLOCATE ALL`): each later statement is
    then parsed and planned again until it is prepared anew. A guarded call rolls back its
    handler's writes for every stored refusal and every failed handler, and nothing a prepared
    statement depends on changes in those transactions (no DDL), so the ROLLBACK bypasses the
    cache: with the threshold unset for its one statement, psycopg neither counts nor checks it."""
    threshold = conn.prepare_threshold
    conn.prepare_threshold = None
    try:
        conn.execute("ROLLBACK")
    finally:
        conn.prepare_threshold = threshold


@contextmanager
def bind_transaction(
    conn: Connection, key: str, *, answers_in_database: bool = False
) -> Iterator[CallTransaction]:
    """Make `conn` (which claimed `key`) the current call's transaction for the handlers below, and
    yield it (`answer_noted` tells, after the handler, whether it noted its answer in the database).

    While it is bound, psycopg's transaction control on it (`transaction()`, `commit()`,
    `rollback()`) is refused: in the middle of the call's pipeline psycopg cannot see the
    transaction already open (libpq learns it only at a Sync), so `transaction()` would send a BEGIN
    and a COMMIT of its own, committing the handler's writes before the call's record, `commit()`
    would do nothing, and `rollback()` would drop the writes and leave the record to be stored
    alone. A handler's statements are the call's transaction.
    """
    transaction = CallTransaction(conn, key, answers_in_database)
    token = _current.set(transaction)
    for name in _TRANSACTION_CONTROL:
        setattr(conn, name, _refuse_transaction_control)
    try:
        yield transaction
    finally:
        for name in _TRANSACTION_CONTROL:
            delattr(conn, name)
        _current.reset(token)


#: psycopg's methods that end or open a transaction, refused to a handler (`bind_transaction`).
_TRANSACTION_CONTROL = ("transaction", "commit", "rollback")


def _refuse_transaction_control(*_args: object, **_kwargs: object) -> NoReturn:
    raise Internal(
        "a handler opened, committed or rolled back a transaction itself inside the call's; it must only"
        " run statements on current_transaction().conn",
        reason=Reason.INTERNAL,
    )


def current_transaction() -> CallTransaction:
    """The transaction the idempotency interceptor opened for this call."""
    call = _current.get()
    if call is None:
        raise Internal("a mutating handler ran outside the idempotency interceptor", reason=Reason.INTERNAL)
    return call


@contextmanager
def mapped_database_errors(
    retry_after_ms: int, on_slot_fenced: Callable[[], object] | None = None
) -> Iterator[None]:
    """Turn transient psycopg failures into UNAVAILABLE / DEADLINE_EXCEEDED (nothing committed)."""
    try:
        yield
    except errors.QueryCanceled as exc:
        raise DeadlineExceeded(
            "the call's deadline ran out while the database worked; nothing was applied",
            reason=Reason.DEADLINE_EXCEEDED,
        ) from exc
    except errors.ObjectNotInPrerequisiteState as exc:
        if not _slot_fenced(exc):
            raise
        if on_slot_fenced is not None:
            on_slot_fenced()
        raise Unavailable(
            "the account's slot range is moving to another shard and takes no writes here now; nothing "
            "was applied, retry with the same idempotency key (the new owner will answer it)",
            reason=Reason.SLOT_RANGE_MOVING,
            retry_after_ms=retry_after_ms,
        ) from exc
    except errors.InternalError_ as exc:
        if not _publication_dropped(exc):
            raise
        raise Unavailable(
            "a slot range move dropped its publication while this call wrote; nothing was applied, "
            "retry with the same idempotency key",
            reason=Reason.DATABASE_BUSY,
            retry_after_ms=retry_after_ms,
        ) from exc
    except (errors.SerializationFailure, errors.DeadlockDetected, errors.LockNotAvailable) as exc:
        raise Unavailable(
            f"the database could not order this call against a concurrent one ({exc.sqlstate}); "
            "nothing was applied, retry with the same idempotency key",
            reason=Reason.DATABASE_BUSY,
            retry_after_ms=retry_after_ms,
        ) from exc
    except psycopg.OperationalError as exc:
        log.warning("database unavailable: %s", exc.__class__.__name__)
        raise Unavailable(
            "the shard's database is unavailable; nothing was applied, retry with the same idempotency key",
            reason=Reason.DATABASE_UNAVAILABLE,
            retry_after_ms=retry_after_ms,
        ) from exc


#: The HINT of the error a slot fence raises (migration 6, `refuse_fenced_write`).
SLOT_FENCED_HINT = "shardrouter:slot-fenced"


def _slot_fenced(exc: psycopg.Error) -> bool:
    return exc.diag.message_hint == SLOT_FENCED_HINT


def _publication_dropped(exc: psycopg.Error) -> bool:
    """PostgreSQL's internal error when a write to a published table meets a publication being
    dropped (a move's clean-up): the table's cached publications name one that is gone. The
    statement fails and the transaction rolls back, so the call can be retried as it is."""
    return (exc.diag.message_primary or str(exc)).startswith("cache lookup failed for publication")


__all__ = [
    "SLOT_FENCED_HINT",
    "CallTransaction",
    "Connection",
    "ConnectionChecks",
    "Database",
    "PipelineSafePrepares",
    "bigint",
    "bind_transaction",
    "current_transaction",
    "mapped_database_errors",
    "rollback_keeping_prepared",
    "trace_connection",
]
