"""The gRPC server interceptor that makes every mutating method idempotent.

It wraps each configured method as a bytes-in, bytes-out handler, so a replay returns the stored
response bytes exactly. Per call: read and check the key -> decode and validate the request (failures
are answered before any claim and never stored) -> answer from this process's memory when it can (a
key it completed recently is replayed; a duplicate of a key one of its threads is working on joins
that call: `process_keys`) -> take an admission slot (`shardd.admission`) -> open one transaction ->
claim the key (a completed key is replayed by a plain read, no lock) -> run the real handler in that
transaction (published through `shardd.db.bind_transaction`) -> store the full outcome -> commit ->
answer. Transient failures roll everything back and leave the key free.

Tracing: each guarded call gets an `idempotency` span (a child of the gRPC SERVER span) carrying the
key, scope, outcome and method, with an event on replays, conflicts and key reuse; the database
transaction gets a `db.transaction` child span. A replay or a conflict is not an error: only
transient and internal failures set the span's status to ERROR. With tracing off no span is made.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shardrouter.core.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    Reason,
    ShardRouterError,
    status_code_from_int,
    to_grpc_status,
    to_status_proto,
)
from shardrouter.core.interceptors import MethodHandler, UnaryInterceptor
from shardrouter.core.keys import KEY_FORMAT_HINT, KEY_METADATA, key_time, parse_key
from shardrouter.core.tracing import (
    SERVER_ERROR_CODES,
    span_context_of_traceparent,
    traceparent_of,
)
from shardrouter.shardd.admission import Admission
from shardrouter.shardd.db import Database, bind_transaction, mapped_database_errors
from shardrouter.shardd.idempotency import store
from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.outcomes import CallOutcome, OutcomeKind, OutcomeListener, OutcomeReport
from shardrouter.shardd.idempotency.process_keys import CompletedKeys, KeyFlight, KeyFlights, ScopedKey
from shardrouter.shardd.idempotency.record import (
    ClaimStatus,
    IdempotencyRecord,
    RecordState,
    StoredOutcome,
    Trailer,
)
from shardrouter.shardd.identity import IdentityPolicy

log = logging.getLogger(__name__)

REPLAYED_TRAILER = ("idempotency-replayed", "true")
EXPIRES_AT_TRAILER = "idempotency-expires-at"
OUTCOME_TRAILER = "idempotency-outcome"
_DETAILS_TRAILER = "grpc-status-details-bin"

Handler = Callable[[Any, grpc.ServicerContext], Any]


@dataclass(frozen=True)
class MutatingMethod:
    """A method the interceptor guards, with its request validator (state-free checks only)."""

    full_name: str  # "/package.Service/Method"
    validate: Callable[[Any], None]
    #: Keys are unique per (scope name, caller). Methods that must fence each other share one name.
    scope_name: str = ""
    #: The request field naming the account the call is routed by; its records move with that
    #: account's slot when the slot moves to another shard ("": routed by something else).
    account_field: str = ""

    @property
    def scope_prefix(self) -> str:
        """The scope name, defaulting to the full method name."""
        return self.scope_name or self.full_name


@dataclass(frozen=True)
class KeyedRequest:
    """A validated call of a guarded method: whose key, for what request."""

    scope: str
    key: uuid.UUID
    key_time: datetime
    request: Message
    #: SHA-256 of the method name and the request's deterministic serialisation.
    request_hash: bytes
    #: The account the call is routed by, if its method names one.
    account_id: str | None = None

    @property
    def scoped_key(self) -> ScopedKey:
        """(scope, key text): how this process's memory knows the key."""
        return (self.scope, str(self.key))


@dataclass(frozen=True)
class Collaborators:
    """What every guarded call of one interceptor works with, passed in explicitly."""

    database: Database
    config: IdempotencyConfig
    identity: IdentityPolicy
    clock: Callable[[], datetime]
    report: OutcomeReport
    #: Spans go here; None (tracing off): the calls skip even the no-op spans.
    tracer: trace.Tracer | None
    shard_id: str
    #: Admission slots for the calls that reach the database; None: no limits.
    admission: Admission | None
    completed: CompletedKeys
    flights: KeyFlights

    def admitted(self, context: grpc.ServicerContext) -> AbstractContextManager[None]:
        """An admission slot for the call (RESOURCE_EXHAUSTED/UNAVAILABLE when shed)."""
        return nullcontext() if self.admission is None else self.admission.admitted(context)


class IdempotencyInterceptor(UnaryInterceptor):
    """Claims keys in PostgreSQL for every configured mutating method."""

    def __init__(
        self,
        *,
        database: Database,
        methods: Sequence[MutatingMethod],
        config: IdempotencyConfig,
        identity: IdentityPolicy,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        listeners: Sequence[OutcomeListener] = (),
        #: Spans go here; None (tracing off): the calls skip even the no-op spans.
        tracer: trace.Tracer | None = None,
        shard_id: str = "",
        #: Admission slots for the calls that reach the database; None: no limits.
        admission: Admission | None = None,
        #: Completed records kept in memory for replays (None: a default-sized cache).
        completed: CompletedKeys | None = None,
    ) -> None:
        super().__init__()
        self._methods: Mapping[str, MutatingMethod] = {m.full_name: m for m in methods}
        self._with = Collaborators(
            database=database,
            config=config,
            identity=identity,
            clock=clock,
            report=OutcomeReport(listeners),
            tracer=tracer,
            shard_id=shard_id,
            admission=admission,
            completed=(
                completed
                if completed is not None
                else CompletedKeys(max_entries=10_000, max_bytes=16 * 1024 * 1024)
            ),
            flights=KeyFlights(),
        )

    def applies_to(self, method: str) -> bool:
        """Only the mutating methods are guarded."""
        return method in self._methods

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The guarded call: no (de)serialisers, it sees the request bytes and returns response bytes."""
        return grpc.unary_unary_rpc_method_handler(_GuardedCall(self._with, self._methods[method], handler))


class _GuardedCall:
    """One guarded method's behaviour: bytes in, bytes out."""

    def __init__(self, collaborators: Collaborators, method: MutatingMethod, handler: MethodHandler):
        self._with = collaborators
        self._method = method
        self._handler = handler

    def __call__(self, raw: bytes, context: grpc.ServicerContext) -> bytes | None:
        tracer = self._with.tracer
        if tracer is None:
            return self._guarded(raw, context, trace.INVALID_SPAN)
        attributes = {"rpc.method": self._method.full_name}
        if self._with.shard_id:
            attributes["shard.id"] = self._with.shard_id
        # The abort that answers a refused call raises through this block: the status is set in
        # `_trace_outcome`, never from the exception.
        with tracer.start_as_current_span(
            "idempotency",
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            return self._guarded(raw, context, span)

    def _guarded(self, raw: bytes, context: grpc.ServicerContext, span: trace.Span) -> bytes | None:
        collaborators, method = self._with, self._method.full_name
        started = time.perf_counter()
        scope, key_text = "", ""
        expiry_trailer: Trailer | None = None
        try:
            metadata = tuple(context.invocation_metadata())
            key = _key_from(metadata)
            key_text = str(key)
            span.set_attribute("idempotency.key", key_text)
            moment = key_time(key)
            expires_at = moment + collaborators.config.retention
            expiry_trailer = (EXPIRES_AT_TRAILER, expires_at.isoformat(timespec="milliseconds"))
            self._check_key_age(moment, expires_at)
            request = self._decode(raw)
            self._method.validate(request)
            scope = f"{self._method.scope_prefix}|{collaborators.identity.caller_of(context, metadata)}"
            span.set_attribute("idempotency.scope", scope)
            # Fields this shard does not know cannot change what it does, so they are not part of the
            # request: a newer client's retry through an older one is the same request, not a reuse.
            request.DiscardUnknownFields()
            request_hash = hashlib.sha256(
                method.encode() + b"\x00" + request.SerializeToString(deterministic=True)
            ).digest()
            try:
                account_field = self._method.account_field
                account_id = str(getattr(request, account_field)) if account_field else None
                call = KeyedRequest(scope, key, moment, request, request_hash, account_id)
                outcome, kind = self._answer(context, call, span)
            except ShardRouterError:
                raise
            except Exception as exc:
                log.exception("unexpected failure in %s", method, extra={"key": key_text})
                raise Internal(
                    "the shard failed unexpectedly; nothing was applied, retry with the same idempotency key",
                    reason=Reason.INTERNAL,
                ) from exc
        except ShardRouterError as error:
            kind = _kind_of(error)
            _trace_outcome(span, kind, error.code, error.message)
            collaborators.report(
                CallOutcome(method, scope, key_text, kind, error.code, time.perf_counter() - started)
            )
            trailers: list[Trailer] = [(OUTCOME_TRAILER, kind.value)]
            if expiry_trailer is not None:
                trailers.append(expiry_trailer)
            context.abort_with_status(to_grpc_status(error, trailers))
            raise AssertionError("abort_with_status returned") from None  # pragma: no cover
        _trace_outcome(span, kind, _code(outcome.code), outcome.message)
        collaborators.report(
            CallOutcome(method, scope, key_text, kind, _code(outcome.code), time.perf_counter() - started)
        )
        assert expiry_trailer is not None
        extra: list[Trailer] = [expiry_trailer]
        if kind is OutcomeKind.REPLAY:
            extra.append(REPLAYED_TRAILER)
        return _answer(context, outcome, extra)

    def _check_key_age(self, moment: datetime, expires_at: datetime) -> None:
        now = self._with.clock()
        if expires_at <= now:
            raise FailedPrecondition(
                f"idempotency key from {moment.isoformat(timespec='seconds')} is older than the "
                f"{self._with.config.retention.days}-day retention window, so this shard can no longer "
                "tell whether the operation was applied; do not retry it with a new key - reconcile it "
                "(look the operation up, e.g. GetTransfer or GetBalance) before deciding",
                reason=Reason.IDEMPOTENCY_KEY_EXPIRED,
                metadata={"key_time": moment.isoformat(), "expired_at": expires_at.isoformat()},
            )
        if moment - now > self._with.config.max_clock_skew:
            raise InvalidArgument(
                f"idempotency key is dated {moment.isoformat(timespec='seconds')}, further in the future "
                f"than the allowed clock skew of {int(self._with.config.max_clock_skew.total_seconds())} s; "
                "check the caller's clock and generate keys with the current time",
                reason=Reason.IDEMPOTENCY_KEY_FROM_FUTURE,
            )

    def _decode(self, raw: bytes) -> Message:
        deserialize = self._handler.request_deserializer
        try:
            if deserialize is None:
                raise Internal(f"{self._method.full_name} has no request deserializer")
            message: Message = deserialize(raw)
            return message
        except DecodeError as exc:
            raise InvalidArgument(
                f"the request body is not a valid {self._method.full_name} request message (protobuf)",
                reason=Reason.INVALID_REQUEST,
            ) from exc

    def _answer(
        self, context: grpc.ServicerContext, call: KeyedRequest, span: trace.Span
    ) -> tuple[StoredOutcome, OutcomeKind]:
        """The call's outcome and kind: from memory when this process knows the key, else the database."""
        collaborators = self._with
        scoped = call.scoped_key
        cached = collaborators.completed.get(scoped)
        if cached is not None:
            return self._replay(cached, call.request_hash, span, source="memory"), OutcomeKind.REPLAY
        flight, leads = collaborators.flights.join(scoped)
        if not leads:
            return self._follow(flight, call.request_hash, span)
        record: IdempotencyRecord | None = None
        try:
            with collaborators.admitted(context):
                record, made = self._execute(context, call, span, flight)
        finally:
            if record is not None:
                collaborators.completed.put(scoped, record)
            collaborators.flights.land(scoped, flight, record)
        assert record is not None and record.outcome is not None
        if made:
            return record.outcome, OutcomeKind.NEW
        return self._replay(record, call.request_hash, span, source="database"), OutcomeKind.REPLAY

    def _follow(
        self, flight: KeyFlight, request_hash: bytes, span: trace.Span
    ) -> tuple[StoredOutcome, OutcomeKind]:
        """A duplicate of a key another thread here works on: its record, or in flight."""
        # The leading call settles within one database read unless it claimed the key; a bounded
        # wait keeps a worker thread from queueing behind a slow database.
        flight.wait_settled(self._with.config.claim_lock_timeout_ms / 1000)
        if flight.record is not None:
            return self._replay(flight.record, request_hash, span, source="memory"), OutcomeKind.REPLAY
        raise self._in_flight(span)

    def _in_flight(self, span: trace.Span) -> Aborted:
        retry_ms = self._with.config.in_flight_retry_ms
        span.add_event("idempotency.conflict", {"idempotency.retry_after_ms": retry_ms})
        return Aborted(
            "an earlier attempt with this idempotency key is still in progress; "
            f"retry the same request with the same key in {retry_ms} ms",
            reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT,
            retry_after_ms=retry_ms,
        )

    def _replay(
        self, record: IdempotencyRecord, request_hash: bytes, span: trace.Span, *, source: str
    ) -> StoredOutcome:
        """The stored outcome of a completed key, or a refusal if the key was used for another request.

        `source`: where the record came from, "memory" (this process's) or "database".
        """
        assert record.outcome is not None
        span.set_attribute("idempotency.record_source", source)
        _link_first_attempt(span, record.first_traceparent)
        if record.request_hash != request_hash:
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

    def _execute(
        self, context: grpc.ServicerContext, call: KeyedRequest, span: trace.Span, flight: KeyFlight
    ) -> tuple[IdempotencyRecord, bool]:
        """The key's completed record from the database, and whether this call made it (ran the handler)."""
        config = self._with.config
        db = self._with.database
        traceparent = traceparent_of(span)
        with (
            _db_span(self._with.tracer),
            mapped_database_errors(db.transient_retry_ms, db.on_slot_fenced),
            db.connection() as conn,
        ):
            # In pipeline mode (the default), statements whose results are not fetched go out with
            # the next fetched one (store.py's timeline).
            with db.call_transaction(conn):
                claim = store.claim_key(
                    conn,
                    scope=call.scope,
                    key=call.key,
                    key_time=call.key_time,
                    method=self._method.full_name,
                    request_hash=call.request_hash,
                    account_id=call.account_id,
                    claim_lock_timeout_ms=config.claim_lock_timeout_ms,
                    handler_lock_timeout_ms=config.handler_lock_timeout_ms,
                    statement_timeout_ms=_statement_timeout_ms(context),
                    traceparent=traceparent,
                )
                if claim.status is ClaimStatus.IN_FLIGHT:
                    raise self._in_flight(span)
                if claim.status is ClaimStatus.EXISTING:
                    assert claim.existing is not None and claim.existing.outcome is not None
                    return claim.existing, False
                flight.mark_claimed()
                outcome = self._run_handler(conn, call.key, context, call.request)
                store.complete_key(
                    conn, scope=call.scope, key=call.key, key_time=call.key_time, outcome=outcome
                )
        assert claim.created_at is not None
        record = IdempotencyRecord(
            scope=call.scope,
            key=call.key,
            key_time=call.key_time,
            method=self._method.full_name,
            request_hash=call.request_hash,
            state=RecordState.COMPLETED,
            outcome=outcome,
            created_at=claim.created_at,
            completed_at=None,
            first_traceparent=traceparent,
        )
        return record, True

    def _run_handler(
        self, conn: Any, key: uuid.UUID, context: grpc.ServicerContext, request: Message
    ) -> StoredOutcome:
        behaviour = self._handler.unary_unary
        serialize = self._handler.response_serializer
        assert behaviour is not None  # only unary-unary methods are guarded
        try:
            with conn.transaction(), bind_transaction(conn, key):  # savepoint: a stored failure undoes writes
                response = behaviour(request, context)
        except ShardRouterError as error:
            if not error.is_stored_outcome:
                raise
            status = to_status_proto(error)
            return StoredOutcome(
                code=error.code.value[0],
                message=error.message,
                details=status.SerializeToString(deterministic=True),
                response=None,
                trailers=_handler_trailers(context),
            )
        if response is None:
            raise Internal(f"{self._method.full_name} handler returned no response")
        return StoredOutcome(
            code=0,
            message="",
            details=None,
            response=serialize(response) if serialize else response,
            trailers=_handler_trailers(context),
        )


def _key_from(metadata: Sequence[tuple[str, str | bytes]]) -> uuid.UUID:
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
    return parse_key(value)


_NO_DEADLINE_S = 24 * 3600  # grpc reports "no deadline" as an enormous time remaining


def _statement_timeout_ms(context: grpc.ServicerContext) -> int | None:
    """No statement may outlive the caller's deadline (the work would be wasted and rolled back)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining < _NO_DEADLINE_S:
        return max(1, int(remaining * 1000))
    return None


def _handler_trailers(context: grpc.ServicerContext) -> tuple[Trailer, ...]:
    return tuple((k, v) for k, v in (context.trailing_metadata() or ()))


def _answer(context: grpc.ServicerContext, outcome: StoredOutcome, extra: list[Trailer]) -> bytes | None:
    trailers = list(outcome.trailers) + extra
    if outcome.is_ok:
        context.set_trailing_metadata(tuple(trailers))
        return outcome.response
    if outcome.details is not None:
        trailers.append((_DETAILS_TRAILER, outcome.details))
    context.abort_with_status(_ReplayStatus(_code(outcome.code), outcome.message, tuple(trailers)))
    return None  # pragma: no cover - abort raises


@dataclass(frozen=True)
class _ReplayStatus(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[Trailer, ...]


def _code(value: int) -> grpc.StatusCode:
    return status_code_from_int(value)


def _trace_outcome(span: trace.Span, kind: OutcomeKind, code: grpc.StatusCode, message: str) -> None:
    """The outcome on the idempotency span; ERROR only for real (transient or internal) failures."""
    span.set_attribute("idempotency.outcome", kind.value)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if kind is OutcomeKind.ERROR and code in SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, message or code.name))


def _link_first_attempt(span: trace.Span, first_traceparent: str | None) -> None:
    """Link a replay's (or a key reuse's) span to the span of the attempt that claimed the key."""
    first = span_context_of_traceparent(first_traceparent)
    if first is None or not span.is_recording():
        return
    span.add_link(first, {"idempotency.link": "first_attempt"})
    span.set_attribute("idempotency.first_trace_id", format(first.trace_id, "032x"))


@contextmanager
def _db_span(tracer: trace.Tracer | None) -> Iterator[None]:
    """`db.transaction`: connection checkout, key claim, handler statements, stored outcome, commit.

    Refusals raised inside (conflict, key reuse) are answers, not database failures; only the mapped
    transient failures and unexpected exceptions make the span an error.
    """
    if tracer is None:
        yield
        return
    with tracer.start_as_current_span(
        "db.transaction",
        kind=SpanKind.CLIENT,
        attributes={"db.system": "postgresql", "db.system.name": "postgresql"},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield
        except ShardRouterError as error:
            if error.code in SERVER_ERROR_CODES:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, error.message))
            raise
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


def _kind_of(error: ShardRouterError) -> OutcomeKind:
    return {
        Reason.IDEMPOTENCY_KEY_IN_FLIGHT: OutcomeKind.IN_FLIGHT,
        Reason.IDEMPOTENCY_KEY_REUSED: OutcomeKind.KEY_REUSED,
        Reason.IDEMPOTENCY_KEY_EXPIRED: OutcomeKind.EXPIRED,
        Reason.RATE_LIMITED: OutcomeKind.SHED,
        Reason.SHARD_SATURATED: OutcomeKind.SHED,
    }.get(error.reason, OutcomeKind.INVALID if isinstance(error, InvalidArgument) else OutcomeKind.ERROR)


__all__ = [
    "EXPIRES_AT_TRAILER",
    "OUTCOME_TRAILER",
    "REPLAYED_TRAILER",
    "Collaborators",
    "Handler",
    "IdempotencyInterceptor",
    "KeyedRequest",
    "MutatingMethod",
]
