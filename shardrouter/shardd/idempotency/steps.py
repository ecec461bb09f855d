"""The steps of a guarded call, each with one job; the interceptor chains them once per method.

    read_key -> check_key_age -> decode_and_validate      build the call's input (`GuardedCall`)
    -> wait_for_original    a duplicate in flight that asked to wait looks again (the whole chain
                            below) until its original ended or its bound (`waiting.py`)
    -> answer_from_memory   a key this process completed, or a duplicate joining its flight
    -> admit                an admission slot (left out of the chain when there are no limits)
    -> claim_or_replay      claim the key, or replay its committed record; a claimed key's handler
                            runs in one transaction on the claiming connection
    -> store_outcome        the handler's outcome stored with its writes, and committed
    -> run_handler          the real handler

Each step answers (returns, or raises a `ShardRouterError`) or hands the call to the next one; the
interceptor's entry point (`interceptor.GuardedMethod`) writes the answer. The steps know the key
table only through a `KeyStore`: `DatabaseKeys` here, over PostgreSQL and `store`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timedelta
from typing import Any

import grpc
import psycopg
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from psycopg import errors
from psycopg.pq import TransactionStatus

from shardrouter.core import failpoints
from shardrouter.core.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    Reason,
    ShardRouterError,
    to_status_proto,
)
from shardrouter.core.interceptors import MethodHandler
from shardrouter.core.keys import KEY_FORMAT_HINT, KEY_METADATA, parse_key
from shardrouter.core.tracing import SERVER_ERROR_CODES, span_context_of_traceparent, traceparent_of
from shardrouter.core.wire_names import EXPIRES_AT_TRAILER
from shardrouter.shardd.admission import Admission
from shardrouter.shardd.db import Database, bind_transaction, mapped_database_errors
from shardrouter.shardd.error_interceptor import decode_request
from shardrouter.shardd.idempotency import store
from shardrouter.shardd.idempotency.call import (
    Answered,
    AnswerNotNoted,
    FlightStep,
    GuardedCall,
    KeyNotClaimed,
    KeyRead,
    KeyStore,
    MutatingMethod,
    Settled,
    StoreStep,
    TransactionStep,
)
from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.outcomes import OutcomeKind
from shardrouter.shardd.idempotency.placement import ClaimPlacement
from shardrouter.shardd.idempotency.process_keys import CompletedKeys, KeyFlight, KeyFlights, ScopedKey
from shardrouter.shardd.idempotency.record import (
    Claim,
    ClaimStatus,
    IdempotencyRecord,
    RecordState,
    StoredOutcome,
    Trailer,
)
from shardrouter.shardd.identity import IdentityPolicy

#: A guarded call's failpoints (core/failpoints.py), where the crash tests stop a daemon: the key
#: claimed and the handler's writes sent, nothing committed; committed, the answer not yet written.
CLAIMED_BEFORE_COMMIT = "shardd.claimed_before_commit"
COMMITTED_BEFORE_ANSWER = "shardd.committed_before_answer"


# --- building the input: the key rules, the request --------------------------------------------


def read_key(
    metadata: Sequence[tuple[str, str | bytes]], config: IdempotencyConfig, now: datetime
) -> KeyRead:
    """The call's one `idempotency-key` entry, parsed (InvalidArgument if missing, repeated or bad).

    `now` is the receipt time: the date of a record made for a key that does not date itself.
    """
    values = [v for k, v in metadata if k == KEY_METADATA]
    if not values:
        raise InvalidArgument(
            f"missing idempotency-key: every mutating call needs one; {KEY_FORMAT_HINT}",
            reason=Reason.IDEMPOTENCY_KEY_MISSING,
        )
    if len(values) > 1:
        raise InvalidArgument(
            f"the idempotency-key metadata entry was sent {len(values)} times; send exactly one",
            reason=Reason.IDEMPOTENCY_KEY_INVALID,
        )
    value = values[0]
    if not isinstance(value, str):
        raise InvalidArgument(
            f"the idempotency-key must be text, not binary; {KEY_FORMAT_HINT}",
            reason=Reason.IDEMPOTENCY_KEY_INVALID,
        )
    key = parse_key(value)
    moment = key.dated_at
    if moment is None:
        if config.require_uuidv7:
            raise InvalidArgument(
                f"invalid idempotency-key: this shard accepts only UUIDv7 keys (RFC 9562 version 7, for "
                f"example 0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b), and this is {key.describe()}; a UUIDv7 "
                "carries its own time, so a retry that comes after its record was dropped is refused as "
                "expired instead of being applied a second time",
                reason=Reason.IDEMPOTENCY_KEY_INVALID,
            )
        moment = now
    return KeyRead(key, key.text, moment, *expiry(moment, config.retention))


def expiry(key_time: datetime, retention: timedelta) -> tuple[datetime, Trailer]:
    """When a record dated `key_time` leaves the retention window, and the trailer saying so."""
    expires_at = key_time + retention
    return expires_at, (EXPIRES_AT_TRAILER, expires_at.isoformat(timespec="milliseconds"))


def check_key_age(key: KeyRead, now: datetime, config: IdempotencyConfig) -> None:
    """Refuse a key past the retention window (EXPIRED) or dated beyond the allowed clock skew.

    Only a UUIDv7 dates itself; any other key is dated by its receipt, now, and passes both.
    """
    if not key.dated_by_key:
        return
    moment, expires_at = key.time, key.expires_at
    if expires_at <= now:
        raise FailedPrecondition(
            f"idempotency key from {moment.isoformat(timespec='seconds')} is older than the "
            f"{config.retention.days}-day retention window, so this shard can no longer "
            "tell whether the operation was applied; do not retry it with a new key - reconcile it "
            "(look the operation up, e.g. GetTransfer or GetBalance) before deciding",
            reason=Reason.IDEMPOTENCY_KEY_EXPIRED,
            metadata={"key_time": moment.isoformat(), "expired_at": expires_at.isoformat()},
        )
    if moment - now > config.max_clock_skew:
        raise InvalidArgument(
            f"idempotency key is dated {moment.isoformat(timespec='seconds')}, further in the future "
            f"than the allowed clock skew of {int(config.max_clock_skew.total_seconds())} s; "
            "check the caller's clock and generate keys with the current time",
            reason=Reason.IDEMPOTENCY_KEY_FROM_FUTURE,
        )


class DecodeAndValidate:
    """decode_and_validate: the request decoded and validated (ownership included), its scope and hash."""

    __slots__ = ("_deserialize", "_identity", "_method", "_name_prefix")

    def __init__(self, method: MutatingMethod, handler: MethodHandler, identity: IdentityPolicy) -> None:
        self._method = method
        self._deserialize = handler.request_deserializer
        self._identity = identity
        self._name_prefix = method.full_name.encode() + b"\x00"

    def __call__(
        self,
        raw: bytes,
        context: grpc.ServicerContext,
        metadata: Sequence[tuple[str, str | bytes]],
        span: trace.Span,
        key: KeyRead,
        wait_ms: int = 0,
    ) -> GuardedCall:
        """The call's input for the next steps; InvalidArgument (never stored) for a bad request.

        `wait_ms`: the wait for an original in flight granted to the call (`waiting.read_wait`)."""
        method = self._method
        request = self._decode(raw)
        method.validate(request)
        scope = f"{method.scope_prefix}|{self._identity.caller_of(context, metadata)}"
        span.set_attribute("idempotency.scope", scope)
        # Fields this shard does not know cannot change what it does, so they are not part of the
        # request: a newer client's retry through an older one is the same request, not a reuse.
        request.DiscardUnknownFields()
        request_hash = hashlib.sha256(
            self._name_prefix + request.SerializeToString(deterministic=True)
        ).digest()
        routing_field = method.routing_field
        account_id = str(getattr(request, routing_field)) if routing_field else None
        return GuardedCall(context, span, scope, key, request, request_hash, account_id, wait_ms)

    def _decode(self, raw: bytes) -> Message:
        if self._deserialize is None:
            raise Internal(f"{self._method.full_name} has no request deserializer")
        message: Message = decode_request(self._deserialize, raw, self._method.full_name)
        return message


# --- the steps given the call ----------------------------------------------------------------


class AnswerFromMemory:
    """answer_from_memory: a key this process completed is replayed; a duplicate of a key another
    thread here works on joins that call's flight; the flight's leader goes on to the database."""

    __slots__ = ("_announce", "_completed", "_flights", "_follow_timeout_s", "_in_flight_retry_ms", "_next")

    def __init__(
        self,
        next_step: FlightStep,
        completed: CompletedKeys,
        flights: KeyFlights,
        config: IdempotencyConfig,
        announce: Callable[[ScopedKey], None] | None = None,
    ) -> None:
        self._next = next_step
        self._completed = completed
        self._flights = flights
        #: Tells the shard's waiting duplicates that a flight they wait for landed (`waiting`).
        self._announce = announce
        # The leading call settles within one database read unless it claimed the key; a bounded
        # wait keeps a worker thread from queueing behind a slow database.
        self._follow_timeout_s = config.claim_lock_timeout_ms / 1000
        self._in_flight_retry_ms = config.in_flight_retry_ms

    def __call__(self, call: GuardedCall) -> Answered:
        """The call's outcome and kind: from memory when this process knows the key, else the database."""
        scoped = call.scoped_key
        cached = self._completed.get(scoped)
        if cached is not None:
            return replay(cached, call, source="memory"), OutcomeKind.REPLAY, cached.key_time
        flight, leads = self._flights.join(scoped)
        if leads:
            return self._lead(call, flight)
        settled = flight.wait_settled(self._follow_timeout_s)
        if flight.record is not None:
            return replay(flight.record, call, source="memory"), OutcomeKind.REPLAY, flight.record.key_time
        if settled:  # the leader claimed the key (in flight), or ended without a completed record
            raise in_flight(call.span, self._in_flight_retry_ms)
        # The leader is still on its way to the database (queued for admission, or its read slowed
        # by a busy machine): look for ourselves rather than answer a completed key ABORTED.
        return self._lead(call, KeyFlight(threading.Lock()), listed=False)

    def _lead(self, call: GuardedCall, flight: KeyFlight, *, listed: bool = True) -> Answered:
        """Go to the database for the call; `flight` is listed in the process's flights unless the
        call goes alone (a duplicate that waited out a slow leader)."""
        record: IdempotencyRecord | None = None
        try:
            record, made = self._next(call, flight)
        finally:
            if record is not None:
                self._completed.put(call.scoped_key, record)
            # Landed after the commit (or the rollback); a duplicate waiting for it is told now.
            if listed and self._flights.land(call.scoped_key, flight, record) and self._announce:
                self._announce(call.scoped_key)
        assert record.outcome is not None
        if made:
            # Committed, the flight landed, the answer not yet written: a crash here leaves the caller
            # without its answer, and its retry must replay the stored one (crash tests stop here).
            failpoints.reached(COMMITTED_BEFORE_ANSWER)
            return record.outcome, OutcomeKind.NEW, record.key_time
        return replay(record, call, source="database"), OutcomeKind.REPLAY, record.key_time


class Admit:
    """admit: an admission slot held while the database works (RESOURCE_EXHAUSTED/UNAVAILABLE if shed)."""

    __slots__ = ("_admission", "_next")

    def __init__(self, next_step: FlightStep, admission: Admission) -> None:
        self._next = next_step
        self._admission = admission

    def __call__(self, call: GuardedCall, flight: KeyFlight) -> Settled:
        """The next step's answer, inside a slot."""
        with self._admission.admitted(call.context):
            return self._next(call, flight)


class ClaimOrReplay:
    """claim_or_replay: claim the key and run the steps below in the handler's transaction, or find
    the key's committed record (replayed, no lock), or find it in flight elsewhere (ABORTED)."""

    __slots__ = ("_in_flight_retry_ms", "_keys", "_method", "_next")

    def __init__(self, next_step: StoreStep, keys: KeyStore, method: str, config: IdempotencyConfig) -> None:
        self._next = next_step
        self._keys = keys
        self._method = method
        self._in_flight_retry_ms = config.in_flight_retry_ms

    def __call__(self, call: GuardedCall, flight: KeyFlight) -> Settled:
        """The key's completed record, and whether this call made it."""
        keys = self._keys
        with keys.connection() as conn:
            ahead = keys.claims_ahead(call)
            call.span.set_attribute("idempotency.claim", "ahead" if ahead else "first")
            if ahead:
                try:
                    with keys.claiming_transaction(conn, call) as as_committed:
                        record = self._next(call, conn, self._claimed(call, call.key.time))
                    record = as_committed(record)
                except KeyNotClaimed as refused:
                    claim = refused.claim
                except AnswerNotNoted as unanswered:
                    # Nothing was written, and the key is still ours: the handler again, the usual way.
                    claim = unanswered.claim
                else:
                    flight.mark_claimed()
                    return record, True
            else:
                claim = keys.claim(conn, call)
            if claim.status is ClaimStatus.IN_FLIGHT:
                raise in_flight(call.span, self._in_flight_retry_ms)
            if claim.status is ClaimStatus.EXISTING:
                assert claim.existing is not None and claim.existing.outcome is not None
                return claim.existing, False
            flight.mark_claimed()
            assert claim.created_at is not None
            with keys.handler_transaction(conn, call):
                record = self._next(call, conn, self._claimed(call, claim.created_at))
        return record, True

    def _claimed(self, call: GuardedCall, created_at: datetime) -> IdempotencyRecord:
        """The record of a key this call claims, before its outcome (`created_at`: the claim's, as
        stored; the store's own when the claim travels with the handler)."""
        return IdempotencyRecord(
            scope=call.scope,
            key=call.key.text,
            key_time=call.key.time,
            method=self._method,
            request_hash=call.request_hash,
            state=RecordState.IN_FLIGHT,
            outcome=None,
            created_at=created_at,
            completed_at=None,
            first_traceparent=traceparent_of(call.span),
        )


class StoreOutcome:
    """store_outcome: the handler's outcome (success or business refusal) stored as the key's record."""

    __slots__ = ("_keys", "_next")

    def __init__(self, next_step: TransactionStep, keys: KeyStore) -> None:
        self._next = next_step
        self._keys = keys

    def __call__(self, call: GuardedCall, conn: Any, claimed: IdempotencyRecord) -> IdempotencyRecord:
        """The completed record: the next step's outcome, stored in the transaction."""
        record = dataclasses.replace(claimed, state=RecordState.COMPLETED, outcome=self._next(call, conn))
        # The key claimed and the handler's writes sent in its open transaction, nothing committed: a
        # crash here must let the key go with every write (crash tests stop here).
        failpoints.reached(CLAIMED_BEFORE_COMMIT)
        return self._keys.complete(conn, call, record)


class RunHandler:
    """run_handler: the real handler; a stored-kind refusal becomes the outcome (its writes are undone
    when it is stored), any other error leaves the whole transaction to roll back."""

    __slots__ = ("_behaviour", "_method", "_serialize")

    def __init__(self, handler: MethodHandler, method: str) -> None:
        assert handler.unary_unary is not None  # only unary-unary methods are guarded
        self._behaviour = handler.unary_unary
        self._serialize = handler.response_serializer
        self._method = method

    def __call__(self, call: GuardedCall, conn: Any) -> StoredOutcome:
        """The handler's outcome, to store."""
        context = call.context
        try:
            # A handler may build its answer in the database only where the claim, its statements,
            # the record and the COMMIT can go together: with a claim sent ahead, in one pipeline.
            with bind_transaction(
                conn, call.key.text, answers_in_database=_CLAIM_AHEAD.get() is not None
            ) as transaction:
                response = self._behaviour(call.request, context)
        except ShardRouterError as error:
            if not error.is_stored_outcome:
                raise
            return StoredOutcome(
                code=error.code.value[0],
                message=error.message,
                details=to_status_proto(error).SerializeToString(deterministic=True),
                response=None,
                trailers=handler_trailers(context),
            )
        if transaction.answer_noted:
            return StoredOutcome(
                code=0,
                message="",
                details=None,
                response=None,
                trailers=handler_trailers(context),
                response_in_database=True,
            )
        if response is None:
            raise Internal(f"{self._method} handler returned no response")
        serialize = self._serialize
        return StoredOutcome(
            code=0,
            message="",
            details=None,
            response=serialize(response) if serialize else response,
            trailers=handler_trailers(context),
        )


# --- what the steps share --------------------------------------------------------------------


def replay(record: IdempotencyRecord, call: GuardedCall, *, source: str) -> StoredOutcome:
    """The stored outcome of a completed key, or FailedPrecondition if the key was used for another
    request. `source`: where the record came from, "memory" (this process's) or "database"."""
    assert record.outcome is not None
    span = call.span
    span.set_attribute("idempotency.record_source", source)
    _link_first_attempt(span, record.first_traceparent)
    if record.request_hash != call.request_hash:
        span.add_event(
            "idempotency.key_reused",
            {
                "idempotency.first_method": record.method,
                "idempotency.first_used_at": record.created_at.isoformat(),
            },
        )
        raise FailedPrecondition(
            "this idempotency key was already used for a different request "
            f"to {record.method}; use a new key for a new operation",
            reason=Reason.IDEMPOTENCY_KEY_REUSED,
            metadata={"first_used_at": record.created_at.isoformat()},
        )
    span.add_event(
        "idempotency.replay",
        {
            "idempotency.first_used_at": record.created_at.isoformat(),
            "idempotency.stored_status_code": record.outcome.code,
        },
    )
    return record.outcome


def in_flight(span: trace.Span, retry_ms: int) -> Aborted:
    """The answer to a duplicate of a key in flight: retry shortly (ABORTED + RetryInfo)."""
    span.add_event("idempotency.conflict", {"idempotency.retry_after_ms": retry_ms})
    return Aborted(
        "an earlier attempt with this idempotency key is still in progress; "
        f"retry the same request with the same key in {retry_ms} ms",
        reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT,
        retry_after_ms=retry_ms,
    )


_NO_DEADLINE_S = 24 * 3600  # grpc reports "no deadline" as an enormous time remaining


def statement_timeout_ms(context: grpc.ServicerContext) -> int | None:
    """No statement may outlive the caller's deadline (the work would be wasted and rolled back)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining < _NO_DEADLINE_S:
        return max(1, int(remaining * 1000))
    return None


def handler_trailers(context: grpc.ServicerContext) -> tuple[Trailer, ...]:
    """The trailers the handler set (stored with its outcome)."""
    return tuple((k, v) for k, v in (context.trailing_metadata() or ()))


def _link_first_attempt(span: trace.Span, first_traceparent: str | None) -> None:
    """Link a replay's (or a key reuse's) span to the span of the attempt that claimed the key."""
    first = span_context_of_traceparent(first_traceparent)
    if first is None or not span.is_recording():
        return
    span.add_link(first, {"idempotency.link": "first_attempt"})
    span.set_attribute("idempotency.first_trace_id", format(first.trace_id, "032x"))


class DatabaseKeys:
    """The `KeyStore` of a running shard: the key table in PostgreSQL, through `store`."""

    def __init__(self, database: Database, config: IdempotencyConfig, tracer: trace.Tracer | None) -> None:
        self._database = database
        self._handler_lock_timeout_ms = config.handler_lock_timeout_ms
        self._in_flight_retry_ms = config.in_flight_retry_ms
        self._tracer = tracer
        self.placement = ClaimPlacement(config.claim_placement)

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """`db.transaction`: connection checkout, key claim, handler statements, stored outcome, commit.

        Refusals raised inside (conflict, key reuse) are answers, not database failures; only the
        mapped transient failures and unexpected exceptions make the span an error.
        """
        db, tracer = self._database, self._tracer
        with (
            _NO_SPAN
            if tracer is None
            else tracer.start_as_current_span(
                "db.transaction",
                kind=SpanKind.CLIENT,
                attributes=_DB_ATTRIBUTES,
                record_exception=False,
                set_status_on_exception=False,
            )
        ) as span:
            try:
                with (
                    mapped_database_errors(db.transient_retry_ms, db.on_slot_fenced),
                    db.connection() as conn,
                ):
                    yield conn
            except ShardRouterError as error:
                if error.code in SERVER_ERROR_CODES:
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, error.message))
                raise
            except Exception as exc:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise

    def claim(self, conn: Any, call: GuardedCall) -> Claim:
        """`store.claim_key` for the call."""
        claim = store.claim_key(
            conn, scope=call.scope, key=call.key.text, key_time=call.key.time, dated_by_key=call.key.dated_by_key
        )
        self.placement.note(duplicate=claim.status is not ClaimStatus.CLAIMED)
        return claim

    @contextmanager
    def handler_transaction(self, conn: Any, call: GuardedCall) -> Iterator[Any]:
        """The handler's transaction, in pipeline mode unless the database says otherwise: BEGIN and
        its bounds (a row lock's wait, the call's deadline) go with the handler's first statement, and the Sync that ends the pipeline carries
        the record, the COMMIT and the lock's release (`store`'s timeline)."""
        try:
            with conn.pipeline() if self._database.pipeline else nullcontext():
                store.begin_handler(
                    conn,
                    lock_timeout_ms=self._handler_lock_timeout_ms,
                    statement_timeout_ms=statement_timeout_ms(call.context),
                )
                yield conn
            self._check_ended(conn, call)
        except BaseException as exc:
            self._let_go(conn, call, exc)
            raise

    def claims_ahead(self, call: GuardedCall) -> bool:
        """A key dated by itself is claimed in the handler's pipeline while few recent claims were
        duplicates (`placement`); a key dated by receipt is read again after its lock is granted,
        which only a claim sent first can do."""
        return self._database.pipeline and call.key.dated_by_key and self.placement.ahead()

    @contextmanager
    def claiming_transaction(
        self, conn: Any, call: GuardedCall
    ) -> Iterator[Callable[[IdempotencyRecord], IdempotencyRecord]]:
        """The claim, BEGIN and the bounds travel with the handler's first statement
        (`store.ClaimAhead`); when the claim finds the key taken, the database skips the rest of
        the pipeline, and `KeyNotClaimed` says what it found. Otherwise as `handler_transaction`;
        a handler's answer noted in the database is read back from the record's insert (`complete`)
        once the pipeline has ended: what this yields puts it in the record, and no answer noted
        raises `AnswerNotNoted` (the COMMIT stored nothing; the key is still held)."""
        ahead = store.ClaimAhead(conn, scope=call.scope, key=call.key.text, key_time=call.key.time)
        committed = _NotedAnswer(ahead)
        try:
            failure: Exception | None = None
            try:
                with conn.pipeline():
                    # A failure inside is raised once the pipeline has ended: psycopg would log the
                    # statements skipped after it as an error of its own (every duplicate's).
                    try:
                        ahead.send(
                            lock_timeout_ms=self._handler_lock_timeout_ms,
                            statement_timeout_ms=statement_timeout_ms(call.context),
                        )
                        token = _CLAIM_AHEAD.set(ahead)
                        try:
                            yield committed.with_answer
                        finally:
                            _CLAIM_AHEAD.reset(token)
                    except Exception as exc:
                        failure = exc
            except psycopg.Error as ended:  # at the Sync: the COMMIT's, or a statement skipped after a failure
                failure = failure or ended
            if failure is not None:
                raise failure
            claim = ahead.claim()
            if claim.status is not ClaimStatus.CLAIMED:  # the handler swallowed the pipeline's failure
                raise KeyNotClaimed(ahead.settle())
            self.placement.note(duplicate=False)
            self._check_ended(conn, call)
            if ahead.stored is not None:
                committed.answer = ahead.noted_answer()
                if committed.answer is None:
                    raise AnswerNotNoted(claim)
        except KeyNotClaimed:
            self.placement.note(duplicate=True)
            raise
        except AnswerNotNoted:
            raise
        except BaseException as exc:
            settled = _settled_elsewhere(ahead) if isinstance(exc, Exception) else None
            if settled is not None:
                # The claim found the key taken and stopped the pipeline: whatever the handler did
                # afterwards (failed at its first fetch, most often) reached nothing.
                self.placement.note(duplicate=True)
                raise KeyNotClaimed(settled) from None
            self._let_go(conn, call, exc)
            raise

    def _check_ended(self, conn: Any, call: GuardedCall) -> None:
        if conn.info.transaction_status is not TransactionStatus.IDLE:
            raise Internal(f"the handler's transaction of {call.scope} was left open")

    def _let_go(self, conn: Any, call: GuardedCall, exc: BaseException) -> None:
        """After a failed handler transaction on a claimed key: roll back and let the key go; a
        twin's record met at the COMMIT is answered as in flight."""
        if isinstance(exc, psycopg.Error):
            if _answered_by_the_server(exc) and not conn.closed:
                # The server is there (it answered): roll back and let the key go before the call
                # is answered. Closing alone lets it go only once the server's session has exited,
                # and a retry sent at once (a router resending through a move's cut-over) could
                # meet this call's claim still held and be answered in flight.
                store.release_claim(conn, scope=call.scope, key=call.key.text)
            # A failed statement aborts the pipeline; closing the connection ends its session,
            # which rolls back and lets the key go if nothing did, whatever state the pipeline
            # was left in.
            conn.close()
        else:
            store.release_claim(conn, scope=call.scope, key=call.key.text)
        if _twin_holds_the_key(exc):
            raise in_flight(call.span, self._in_flight_retry_ms) from exc

    def complete(self, conn: Any, call: GuardedCall, record: IdempotencyRecord) -> IdempotencyRecord:
        """`store.complete_key` for the call; a claim sent ahead dates the record."""
        outcome = record.outcome
        assert outcome is not None
        ahead = _CLAIM_AHEAD.get()
        if outcome.response_in_database:
            # Nothing fetched: the record's insert and the COMMIT go with the handler's statement.
            assert ahead is not None
            ahead.stored = store.complete_key_with_noted_answer(conn, record=record, account_id=call.account_id)
            return record
        if ahead is not None:
            claim = ahead.claim()
            if claim.status is not ClaimStatus.CLAIMED:
                raise KeyNotClaimed(claim)  # settled after the pipeline, by `claiming_transaction`
            assert claim.created_at is not None
            record = dataclasses.replace(record, created_at=claim.created_at)
        store.complete_key(
            conn,
            record=record,
            account_id=call.account_id,
            keep_handler_writes=outcome.code == 0,
        )
        return record


class _NotedAnswer:
    """What a handler noted in the database, put in its record once the transaction has ended."""

    __slots__ = ("_ahead", "answer")

    def __init__(self, ahead: store.ClaimAhead) -> None:
        self._ahead = ahead
        self.answer: bytes | None = None

    def with_answer(self, record: IdempotencyRecord) -> IdempotencyRecord:
        """`record` as committed: a response noted in the database in it, dated by the claim."""
        outcome = record.outcome
        if outcome is None or not outcome.response_in_database:
            return record
        assert self.answer is not None
        created_at = self._ahead.claim().created_at
        assert created_at is not None
        return dataclasses.replace(
            record,
            created_at=created_at,
            outcome=dataclasses.replace(outcome, response=self.answer, response_in_database=False),
        )


#: The claim sent ahead of the running handler, for `DatabaseKeys.complete` (None: claimed first).
_CLAIM_AHEAD: contextvars.ContextVar[store.ClaimAhead | None] = contextvars.ContextVar(
    "shardd_claim_ahead", default=None
)


def _settled_elsewhere(ahead: store.ClaimAhead) -> Claim | None:
    """What a claim sent ahead found, if it did not take the key (None: it took it, or its answer
    never came back, and the failure is the handler transaction's own)."""
    try:
        claim = ahead.claim()
    except psycopg.Error:
        return None
    if claim.status is ClaimStatus.CLAIMED:
        return None
    try:
        return ahead.settle()
    except psycopg.Error:
        return claim  # the holder was in flight when the claim looked: the retry looks again


def _answered_by_the_server(exc: psycopg.Error) -> bool:
    """Whether the failure is the server's answer to a statement (a SQLSTATE of its own), its
    session alive; not a lost connection (class 08) nor a session the server ended (57P)."""
    state = exc.sqlstate
    return state is not None and not state.startswith(("08", "57P"))


def _twin_holds_the_key(exc: BaseException) -> bool:
    """Whether the completed record's insert met a twin's record of the same key (committed, or not
    yet and waited for past the handler's lock timeout): the primary key's backstop, never expected while the
    key's lock is held."""
    if isinstance(exc, errors.UniqueViolation):
        return (exc.diag.table_name or "").startswith("idempotency_record")
    if isinstance(exc, errors.LockNotAvailable):
        return "idempotency_record" in (exc.diag.context or "")
    return False


#: Tracing off: no `db.transaction` span (a no-op context, reused by every call).
_NO_SPAN: AbstractContextManager[trace.Span] = nullcontext(trace.INVALID_SPAN)
_DB_ATTRIBUTES = {"db.system": "postgresql", "db.system.name": "postgresql"}


__all__ = [
    "CLAIMED_BEFORE_COMMIT",
    "COMMITTED_BEFORE_ANSWER",
    "EXPIRES_AT_TRAILER",
    "Admit",
    "AnswerFromMemory",
    "ClaimOrReplay",
    "DatabaseKeys",
    "DecodeAndValidate",
    "RunHandler",
    "StoreOutcome",
    "check_key_age",
    "expiry",
    "handler_trailers",
    "in_flight",
    "read_key",
    "replay",
    "statement_timeout_ms",
]
