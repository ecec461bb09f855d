"""The gRPC server interceptor that makes every mutating method idempotent.

It wraps each configured method as a bytes-in, bytes-out handler, so a replay returns the stored
response bytes exactly. Per call, the steps of `steps.py`, chained once per method: read and check
the key -> decode and validate the request (failures are answered before any claim and never stored)
-> wait for the original of a key in flight, for a call that asked to (`waiting`) -> answer from this process's memory when it can (a key it completed recently is replayed; a
duplicate of a key one of its threads is working on joins that call: `process_keys`) -> take an
admission slot (`shardd.admission`) -> open one transaction -> claim the key (a completed key is
replayed by a plain read, no lock) -> run the real handler in that transaction (published through
`shardd.db.bind_transaction`) -> store the full outcome -> commit; then `GuardedMethod` answers.
Transient failures roll everything back and leave the key free.

Tracing: each guarded call gets an `idempotency` span (a child of the gRPC SERVER span) carrying the
key, scope, outcome and method, with an event on replays, conflicts and key reuse; the database
transaction gets a `db.transaction` child span. A replay or a conflict is not an error: only
transient and internal failures set the span's status to ERROR. With tracing off no span is made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shardrouter.core.errors import (
    Internal,
    InvalidArgument,
    Reason,
    ShardRouterError,
    status_code_from_int,
)
from shardrouter.core.interceptors import MethodHandler, UnaryInterceptor
from shardrouter.core.status import abort_with_error
from shardrouter.core.tracing import SERVER_ERROR_CODES
from shardrouter.core.wire import DETAILS_TRAILER, StatusAnswer
from shardrouter.core.wire_names import (
    KEY_ATTRIBUTE,
    OUTCOME_ATTRIBUTE,
    OUTCOME_TRAILER,
    REPLAYED_TRAILER,
    REPLAYED_VALUE,
    WAIT_APPLIED_TRAILER,
    OutcomeKind,
)
from shardrouter.shardd.admission import Admission
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency.call import (
    Answered,
    CallStep,
    FlightStep,
    GuardedCall,
    KeyRead,
    KeyStore,
    MutatingMethod,
)
from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.outcomes import CallOutcome, OutcomeListener, OutcomeReport
from shardrouter.shardd.idempotency.process_keys import CompletedKeys, KeyFlights
from shardrouter.shardd.idempotency.record import StoredOutcome, Trailer
from shardrouter.shardd.idempotency.steps import (
    Admit,
    AnswerFromMemory,
    ClaimOrReplay,
    DatabaseKeys,
    DecodeAndValidate,
    RunHandler,
    StoreOutcome,
    check_key_age,
    expiry,
    read_key,
)
from shardrouter.shardd.idempotency.waiting import KeyWaits, WaitForOriginal, read_wait
from shardrouter.shardd.identity import IdentityPolicy

log = logging.getLogger(__name__)

Handler = Callable[[Any, grpc.ServicerContext], Any]


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
    #: This process's waiting duplicates and the wait requests it answers.
    waits: KeyWaits


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
        completed = (
            completed
            if completed is not None
            else CompletedKeys(max_entries=10_000, max_bytes=16 * 1024 * 1024)
        )
        flights = KeyFlights()
        self._with = Collaborators(
            database=database,
            config=config,
            identity=identity,
            clock=clock,
            report=OutcomeReport(listeners),
            tracer=tracer,
            shard_id=shard_id,
            admission=admission,
            completed=completed,
            flights=flights,
            waits=KeyWaits(database, flights, completed, stalled_claim_s=config.stalled_claim_ms / 1000),
        )
        self._keys = DatabaseKeys(database, config, tracer)

    @property
    def key_waits(self) -> KeyWaits:
        """This process's waiting duplicates: subscribe them to the process's listener."""
        return self._with.waits

    @property
    def guarded_methods(self) -> frozenset[str]:
        """The full names of the methods this interceptor guards; every other method passes through."""
        return frozenset(self._methods)

    def applies_to(self, method: str) -> bool:
        """Only the mutating methods are guarded."""
        return method in self._methods

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The guarded call: no (de)serialisers, it sees the request bytes and returns response bytes."""
        return grpc.unary_unary_rpc_method_handler(
            GuardedMethod(self._with, self._methods[method], handler, self._keys)
        )


def chain(
    collaborators: Collaborators, method: MutatingMethod, handler: MethodHandler, keys: KeyStore
) -> CallStep:
    """The steps after decoding, built once per method: wait_for_original -> answer_from_memory ->
    admit -> claim_or_replay -> store_outcome -> run_handler (admit left out when there are no
    admission limits, wait_for_original when the daemon's maximum wait is 0)."""
    name, config, waits = method.full_name, collaborators.config, collaborators.waits
    in_transaction = StoreOutcome(RunHandler(handler, name), keys)
    to_database: FlightStep = ClaimOrReplay(in_transaction, keys, name, config)
    if collaborators.admission is not None:
        to_database = Admit(to_database, collaborators.admission)
    from_memory = AnswerFromMemory(
        to_database, collaborators.completed, collaborators.flights, config, waits.announce
    )
    if config.max_duplicate_wait_ms == 0:
        return from_memory
    return WaitForOriginal(from_memory, waits)


class GuardedMethod:
    """One guarded method's behaviour, bytes in, bytes out: builds the call's input (read_key,
    check_key_age, decode_and_validate), hands it to the chain of steps, and answers."""

    __slots__ = ("_attributes", "_decode_and_validate", "_method", "_steps", "_with")

    def __init__(
        self, collaborators: Collaborators, method: MutatingMethod, handler: MethodHandler, keys: KeyStore
    ) -> None:
        self._with = collaborators
        self._method = method
        self._decode_and_validate = DecodeAndValidate(method, handler, collaborators.identity)
        self._steps = chain(collaborators, method, handler, keys)
        self._attributes = {"rpc.method": method.full_name}
        if collaborators.shard_id:
            self._attributes["shard.id"] = collaborators.shard_id

    def __call__(self, raw: bytes, context: grpc.ServicerContext) -> bytes | None:
        """The call's answer: response bytes, or an abort with the status (stored or refused)."""
        tracer = self._with.tracer
        if tracer is None:
            return self._guarded(raw, context, trace.INVALID_SPAN)
        # The abort that answers a refused call raises through this block: the status is set in
        # `_trace_outcome`, never from the exception.
        with tracer.start_as_current_span(
            "idempotency",
            kind=SpanKind.INTERNAL,
            attributes=self._attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            return self._guarded(raw, context, span)

    def _guarded(self, raw: bytes, context: grpc.ServicerContext, span: trace.Span) -> bytes | None:
        started = time.perf_counter()
        key: KeyRead | None = None
        call: GuardedCall | None = None
        try:
            metadata = tuple(context.invocation_metadata())
            now = self._with.clock()
            key = read_key(metadata, self._with.config, now)
            span.set_attribute(KEY_ATTRIBUTE, key.text)
            check_key_age(key, now, self._with.config)
            wait_ms = read_wait(metadata, self._with.config.max_duplicate_wait_ms)
            call = self._decode_and_validate(raw, context, metadata, span, key, wait_ms)
            outcome, kind, dated = self._run(call)
        except ShardRouterError as error:
            self._refuse(context, span, started, error, key, call)
        return self._answer(context, span, started, outcome, kind, call, dated)

    def _run(self, call: GuardedCall) -> Answered:
        """The chain's answer; an unexpected exception becomes INTERNAL (nothing was applied)."""
        try:
            return self._steps(call)
        except ShardRouterError:
            raise
        except Exception as exc:
            log.exception("unexpected failure in %s", self._method.full_name, extra={"key": call.key.text})
            raise Internal(
                "the shard failed unexpectedly; nothing was applied, retry with the same idempotency key",
                reason=Reason.INTERNAL,
            ) from exc

    def _answer(
        self,
        context: grpc.ServicerContext,
        span: trace.Span,
        started: float,
        outcome: StoredOutcome,
        kind: OutcomeKind,
        call: GuardedCall,
        dated: datetime,
    ) -> bytes | None:
        """answer: the outcome (new or replayed), traced, reported, and written to the call verbatim.

        `dated`: the record's date; a replay of a key dated by its first receipt expires with it."""
        code = status_code_from_int(outcome.code)
        _trace_outcome(span, kind, code, outcome.message)
        self._with.report(
            CallOutcome(
                self._method.full_name, call.scope, call.key.text, kind, code, time.perf_counter() - started
            )
        )
        expiry_trailer = (
            call.key.expiry_trailer
            if dated == call.key.time
            else expiry(dated, self._with.config.retention)[1]
        )
        trailers = [*outcome.trailers, expiry_trailer, *_wait_trailer(call)]
        if kind is OutcomeKind.REPLAY:
            trailers.append((REPLAYED_TRAILER, REPLAYED_VALUE))
        if outcome.is_ok:
            context.set_trailing_metadata(tuple(trailers))
            return outcome.response
        if outcome.details is not None:
            trailers.append((DETAILS_TRAILER, outcome.details))
        context.abort_with_status(StatusAnswer(code, outcome.message, tuple(trailers)))
        return None  # pragma: no cover - abort raises

    def _refuse(
        self,
        context: grpc.ServicerContext,
        span: trace.Span,
        started: float,
        error: ShardRouterError,
        key: KeyRead | None,
        call: GuardedCall | None,
    ) -> NoReturn:
        """answer: a refusal or failure (nothing stored by this call), traced, reported, aborted."""
        kind = _kind_of(error)
        _trace_outcome(span, kind, error.code, error.message)
        self._with.report(
            CallOutcome(
                self._method.full_name,
                call.scope if call is not None else "",
                key.text if key is not None else "",
                kind,
                error.code,
                time.perf_counter() - started,
            )
        )
        trailers: list[Trailer] = [(OUTCOME_TRAILER, kind.value)]
        if key is not None:
            trailers.append(key.expiry_trailer)
        if call is not None:
            trailers += _wait_trailer(call)
        abort_with_error(context, error, trailers)


def _wait_trailer(call: GuardedCall) -> tuple[Trailer, ...]:
    """`idempotency-wait-applied-ms` for a call that asked to wait: the wait granted to it."""
    return ((WAIT_APPLIED_TRAILER, str(call.wait_ms)),) if call.wait_ms > 0 else ()


def _trace_outcome(span: trace.Span, kind: OutcomeKind, code: grpc.StatusCode, message: str) -> None:
    """The outcome on the idempotency span; ERROR only for real (transient or internal) failures."""
    span.set_attribute(OUTCOME_ATTRIBUTE, kind.value)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if kind is OutcomeKind.ERROR and code in SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, message or code.name))


_KIND_BY_REASON = {
    Reason.IDEMPOTENCY_KEY_IN_FLIGHT: OutcomeKind.IN_FLIGHT,
    Reason.IDEMPOTENCY_KEY_REUSED: OutcomeKind.KEY_REUSED,
    Reason.IDEMPOTENCY_KEY_EXPIRED: OutcomeKind.EXPIRED,
    Reason.RATE_LIMITED: OutcomeKind.SHED,
    Reason.SHARD_SATURATED: OutcomeKind.SHED,
}


def _kind_of(error: ShardRouterError) -> OutcomeKind:
    return _KIND_BY_REASON.get(
        error.reason, OutcomeKind.INVALID if isinstance(error, InvalidArgument) else OutcomeKind.ERROR
    )


__all__ = [
    "Collaborators",
    "GuardedMethod",
    "Handler",
    "IdempotencyInterceptor",
    "MutatingMethod",
    "chain",
]
