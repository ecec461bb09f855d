"""The gRPC server interceptor that makes every mutating method idempotent.

It wraps each configured method as a bytes-in, bytes-out handler, so a replay returns the stored
response bytes exactly. Per call: read and check the key -> decode and validate the request (failures
are answered before any claim and never stored) -> open one transaction -> claim the key -> run the
real handler in that transaction (published through `shardd.db.bind_transaction`) -> store the full
outcome -> commit -> answer. Transient failures roll everything back and leave the key free.

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
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shardd.db import Database, bind_transaction, mapped_database_errors
from shardd.idempotency import store
from shardd.idempotency.config import IdempotencyConfig
from shardd.idempotency.record import ClaimStatus, StoredOutcome, Trailer
from shardd.identity import IdentityPolicy
from shardrouter.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    Reason,
    ShardRouterError,
    to_grpc_status,
    to_status_proto,
)
from shardrouter.grpcserver import MethodHandler, UnaryInterceptor
from shardrouter.keys import KEY_FORMAT_HINT, KEY_METADATA, key_time, parse_key
from shardrouter.telemetry import (
    SERVER_ERROR_CODES,
    span_context_of_traceparent,
    traceparent_of,
)

log = logging.getLogger(__name__)
#: The per-call log (one line per guarded call); its own name so it can be silenced or routed apart.
_calls_log = logging.getLogger("shardd.calls")

REPLAYED_TRAILER = ("idempotency-replayed", "true")
EXPIRES_AT_TRAILER = "idempotency-expires-at"
OUTCOME_TRAILER = "idempotency-outcome"
_DETAILS_TRAILER = "grpc-status-details-bin"

Handler = Callable[[Any, grpc.ServicerContext], Any]
OutcomeListener = Callable[["CallOutcome"], None]


@dataclass(frozen=True)
class MutatingMethod:
    """A method the interceptor guards, with its request validator (state-free checks only)."""

    full_name: str  # "/package.Service/Method"
    validate: Callable[[Any], None]
    #: Keys are unique per (scope name, caller). Methods that must fence each other share one name.
    scope_name: str = ""

    @property
    def scope_prefix(self) -> str:
        """The scope name, defaulting to the full method name."""
        return self.scope_name or self.full_name


@dataclass(frozen=True)
class CallOutcome:
    """What happened to one guarded call, for metrics and traces."""

    method: str
    scope: str
    key: str
    outcome: str  # new | replay | in_progress_conflict | key_reused | expired | invalid | error
    code: grpc.StatusCode
    #: Seconds from the call reaching the interceptor to its outcome being known.
    duration_s: float = 0.0


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
    ) -> None:
        self._db = database
        self._methods: Mapping[str, MutatingMethod] = {m.full_name: m for m in methods}
        self._config = config
        self._identity = identity
        self._clock = clock
        self._listeners = tuple(listeners)
        self._tracer = tracer
        self._shard_id = shard_id

    def applies_to(self, method: str) -> bool:
        """Only the mutating methods are guarded."""
        return method in self._methods

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The guarded call: no (de)serialisers, it sees the request bytes and returns response bytes."""
        return grpc.unary_unary_rpc_method_handler(_GuardedCall(self, self._methods[method], handler))

    def _notify(self, outcome: CallOutcome) -> None:
        # One line per guarded call, inside its span (so with its trace and span ids): the key and
        # the outcome, never the request or the stored response.
        _calls_log.log(
            logging.WARNING if outcome.outcome == "error" else logging.INFO,
            "%s %s: %s",
            outcome.method.rsplit("/", 1)[-1],
            outcome.outcome,
            outcome.code.name,
            extra={
                "key": outcome.key,
                "scope": outcome.scope,
                "outcome": outcome.outcome,
                "code": outcome.code.name,
                "duration_ms": round(outcome.duration_s * 1000, 3),
            },
        )
        for listener in self._listeners:
            try:
                listener(outcome)
            except Exception:  # a broken metrics hook must never change an answer
                log.exception("idempotency outcome listener failed")


class _GuardedCall:
    """One guarded method's behaviour: bytes in, bytes out."""

    def __init__(self, owner: IdempotencyInterceptor, method: MutatingMethod, handler: MethodHandler):
        self._owner = owner
        self._method = method
        self._handler = handler

    def __call__(self, raw: bytes, context: grpc.ServicerContext) -> bytes | None:
        owner = self._owner
        if owner._tracer is None:
            return self._guarded(raw, context, trace.INVALID_SPAN)
        attributes = {"rpc.method": self._method.full_name}
        if owner._shard_id:
            attributes["shard.id"] = owner._shard_id
        # The abort that answers a refused call raises through this block: the status is set in
        # `_trace_outcome`, never from the exception.
        with owner._tracer.start_as_current_span(
            "idempotency",
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            return self._guarded(raw, context, span)

    def _guarded(self, raw: bytes, context: grpc.ServicerContext, span: trace.Span) -> bytes | None:
        owner, method = self._owner, self._method.full_name
        started = time.perf_counter()
        scope, key_text = "", ""
        expiry_trailer: Trailer | None = None
        try:
            metadata = tuple(context.invocation_metadata())
            key = _key_from(metadata)
            key_text = str(key)
            span.set_attribute("idempotency.key", key_text)
            moment = key_time(key)
            expires_at = moment + owner._config.retention
            expiry_trailer = (EXPIRES_AT_TRAILER, expires_at.isoformat(timespec="milliseconds"))
            self._check_key_age(moment, expires_at)
            request = self._decode(raw)
            self._method.validate(request)
            scope = f"{self._method.scope_prefix}|{owner._identity.caller_of(context, metadata)}"
            span.set_attribute("idempotency.scope", scope)
            request_hash = hashlib.sha256(
                method.encode() + b"\x00" + request.SerializeToString(deterministic=True)
            ).digest()
            try:
                outcome, kind = self._execute(context, scope, key, moment, request, request_hash, span)
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
            owner._notify(
                CallOutcome(method, scope, key_text, kind, error.code, time.perf_counter() - started)
            )
            trailers: list[Trailer] = [(OUTCOME_TRAILER, kind)]
            if expiry_trailer is not None:
                trailers.append(expiry_trailer)
            context.abort_with_status(to_grpc_status(error, trailers))
            raise AssertionError("abort_with_status returned") from None  # pragma: no cover
        _trace_outcome(span, kind, _code(outcome.code), outcome.message)
        owner._notify(
            CallOutcome(method, scope, key_text, kind, _code(outcome.code), time.perf_counter() - started)
        )
        assert expiry_trailer is not None
        extra: list[Trailer] = [expiry_trailer]
        if kind == "replay":
            extra.append(REPLAYED_TRAILER)
        return _answer(context, outcome, extra)

    def _check_key_age(self, moment: datetime, expires_at: datetime) -> None:
        now = self._owner._clock()
        if expires_at <= now:
            raise FailedPrecondition(
                f"idempotency key from {moment.isoformat(timespec='seconds')} is older than the "
                f"{self._owner._config.retention.days}-day retention window, so this shard can no longer "
                "tell whether the operation was applied; do not retry it with a new key - reconcile it "
                "(look the operation up, e.g. GetTransfer or GetBalance) before deciding",
                reason=Reason.IDEMPOTENCY_KEY_EXPIRED,
                metadata={"key_time": moment.isoformat(), "expired_at": expires_at.isoformat()},
            )
        if moment - now > self._owner._config.max_clock_skew:
            raise InvalidArgument(
                f"idempotency key is dated {moment.isoformat(timespec='seconds')}, further in the future "
                f"than the allowed clock skew of {int(self._owner._config.max_clock_skew.total_seconds())} s; "
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

    def _execute(
        self,
        context: grpc.ServicerContext,
        scope: str,
        key: uuid.UUID,
        moment: datetime,
        request: Message,
        request_hash: bytes,
        span: trace.Span,
    ) -> tuple[StoredOutcome, str]:
        config = self._owner._config
        db = self._owner._db
        with (
            _db_span(self._owner._tracer),
            mapped_database_errors(db.transient_retry_ms),
            db.connection() as conn,
        ):
            with conn.transaction():
                _bound_statement_time(conn, context)
                claim = store.claim_key(
                    conn,
                    scope=scope,
                    key=key,
                    key_time=moment,
                    method=self._method.full_name,
                    request_hash=request_hash,
                    claim_lock_timeout_ms=config.claim_lock_timeout_ms,
                    handler_lock_timeout_ms=config.handler_lock_timeout_ms,
                    traceparent=traceparent_of(span),
                )
                if claim.status is ClaimStatus.IN_FLIGHT:
                    span.add_event(
                        "idempotency.conflict", {"idempotency.retry_after_ms": config.in_flight_retry_ms}
                    )
                    raise Aborted(
                        "an earlier attempt with this idempotency key is still in progress; "
                        f"retry the same request with the same key in {config.in_flight_retry_ms} ms",
                        reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT,
                        retry_after_ms=config.in_flight_retry_ms,
                    )
                if claim.status is ClaimStatus.EXISTING:
                    record = claim.existing
                    assert record is not None and record.outcome is not None
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
                    return record.outcome, "replay"
                outcome = self._run_handler(conn, key, context, request)
                store.complete_key(conn, scope=scope, key=key, key_time=moment, outcome=outcome)
        return outcome, "new"

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


def _bound_statement_time(conn: Any, context: grpc.ServicerContext) -> None:
    """No statement may outlive the caller's deadline (the work would be wasted and rolled back)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining < _NO_DEADLINE_S:
        ms = max(1, int(remaining * 1000))
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{ms}ms",))


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


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _code(value: int) -> grpc.StatusCode:
    return _CODES[value]


def _trace_outcome(span: trace.Span, kind: str, code: grpc.StatusCode, message: str) -> None:
    """The outcome on the idempotency span; ERROR only for real (transient or internal) failures."""
    span.set_attribute("idempotency.outcome", kind)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if kind == "error" and code in SERVER_ERROR_CODES:
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


def _kind_of(error: ShardRouterError) -> str:
    return {
        Reason.IDEMPOTENCY_KEY_IN_FLIGHT: "in_progress_conflict",
        Reason.IDEMPOTENCY_KEY_REUSED: "key_reused",
        Reason.IDEMPOTENCY_KEY_EXPIRED: "expired",
    }.get(error.reason, "invalid" if isinstance(error, InvalidArgument) else "error")
