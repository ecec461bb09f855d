"""`TransferClient`: store an operation first, then send it until the shard gives a final answer.

    client = TransferClient("127.0.0.1:50051", store=SqliteOperationStore("ops.db"))
    op = client.create_transfer("alice", "bob", 2500, "EUR")   # durable, with its key; no network
    result = client.send_with_retries(op)                       # same key on every attempt

Every attempt carries the operation's `idempotency-key` (and `x-caller-id`, if the operation has a
caller), a per-attempt deadline, and is recorded in the store before the next one starts. After a
crash, `resume_pending()` sends every unfinished operation again with its original key and caller.

Every keyed RPC of the public API is an operation kind (`shardrouter.client.kinds`, read from the
proto's declarations): `create_operation(kind, arguments)` stores any of them; `create_transfer` and
`create_deposit` are typed helpers over the same plumbing.
"""

from __future__ import annotations

import base64
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message
from opentelemetry import trace

from shardrouter.client.hedging import Hedge, Race
from shardrouter.client.kinds import OPERATION_TYPES, Argument, OperationKind, OperationType, kind_name
from shardrouter.client.operation import Attempt, Operation, OperationState, Outcome, utc_now
from shardrouter.client.retry import RetryPolicy, Verdict, backoff_s, classify, server_delay_s
from shardrouter.client.status import (
    ErrorDetails,
    RpcFailure,
    error_details,
    pushback_s,
    was_replayed,
)
from shardrouter.client.store import OperationStore, UnknownOperation
from shardrouter.client.tracing import AttemptSpans, OperationTracer, record_attempt, record_operation
from shardrouter.client.wire import (
    build_request,
    decode_response_bytes,
    deposit_arguments,
    transfer_arguments,
    validate,
)
from shardrouter.core.callers import CALLER_METADATA
from shardrouter.core.keys import KEY_METADATA
from shardrouter.core.rpcs import PUBLIC_SERVICE, rpc
from shardrouter.core.wire import MetadataEntry
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

__all__ = ["Hedge", "SendResult", "TransferClient"]


def _declared_kind(method_name: str) -> OperationType:
    """The operation kind of a keyed public RPC a typed helper sends (fails at import if not declared)."""
    return OPERATION_TYPES[kind_name(rpc(PUBLIC_SERVICE, method_name).name)]


_TRANSFER = _declared_kind("Transfer")
_DEPOSIT = _declared_kind("Deposit")
_RESERVED_METADATA = frozenset({KEY_METADATA, CALLER_METADATA})
_MIN_ATTEMPT_S = 0.01  # below this, an attempt cannot finish: stop and report the budget exhausted
_SERVER_DELAY_JITTER = 0.1  # wait up to 10 % longer than asked, so conflicting retries spread out
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class SendResult:
    """What `send_with_retries` ended with."""

    operation: Operation  # as stored after the last attempt
    code: grpc.StatusCode  # of the last attempt
    message: str
    response: Message | None  # the RPC's response (TransferResponse, DepositResponse, ...) when OK
    error: ErrorDetails | None  # decoded rich status when code is not OK
    replayed: bool  # the shard answered with the stored outcome of an earlier attempt
    attempts: int  # attempts made by this call
    budget_exhausted: bool = False  # stopped because the time budget ran out (still PENDING)

    @property
    def state(self) -> OperationState:
        """The operation's state after this call."""
        return self.operation.state

    @property
    def ok(self) -> bool:
        """Whether the operation succeeded."""
        return self.code is grpc.StatusCode.OK

    @property
    def reason(self) -> str | None:
        """`ErrorInfo.reason` of a failure (e.g. INSUFFICIENT_FUNDS), or None."""
        return self.error.reason if self.error else None


class TransferClient:
    """Caller library of shard-router: durable operations, safe retries, read-only calls."""

    def __init__(
        self,
        target: str,
        *,
        store: OperationStore | None,
        channel: grpc.Channel | None = None,
        caller_id: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        """Connect to `target` (router or shard), or use `channel` as given.

        Tracing (see `shardrouter.client.tracing`): spans go to `tracer_provider`, else to the global
        provider if the application installed one; with neither, no span is made.

        `store` may be None for a read-only client. `metadata` is sent on every call (e.g. a token);
        it must not contain `idempotency-key` or `x-caller-id`, which this client manages. The channel
        it creates turns gRPC's own retries off, so every attempt is one recorded attempt; if you pass
        a channel with the service config's retry policy, that still is safe (same key), but the
        store then sees one attempt where the channel made several.
        """
        reserved = sorted({k for k, _ in metadata} & _RESERVED_METADATA)
        if reserved:
            raise ValueError(
                f"metadata must not contain {', '.join(reserved)}: the client sets it per operation"
            )
        self.target = target
        self.store = store
        self.caller_id = caller_id
        self._metadata = tuple(metadata)
        self._owns_channel = channel is None
        if channel is None:
            options = [("grpc.enable_retries", 0)]
            channel = (
                grpc.secure_channel(target, credentials, options=options)
                if credentials is not None
                else grpc.insecure_channel(target, options=options)
            )
        self._channel = channel
        self._stub = transfer_pb2_grpc.TransferServiceStub(channel)
        # Raw-bytes callables: the response bytes are recorded exactly as the shard sent them.
        self._raw: dict[str, grpc.UnaryUnaryMultiCallable[Any, bytes]] = {
            kind: channel.unary_unary(
                op_type.method, request_serializer=_serialize, response_deserializer=None
            )
            for kind, op_type in OPERATION_TYPES.items()
        }
        self._sleep = sleep
        self._clock = clock
        self._rng = rng or random.Random()  # jitter, not secrets
        self._tracing = OperationTracer(tracer_provider)
        #: Second attempts `send_hedged` sent, and those whose answer was the one returned.
        self.hedges_sent = 0
        self.hedges_won = 0

    def close(self) -> None:
        """Close the channel if this client created it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> TransferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations: store first, send later -------------------------------------------------------

    def create_operation(self, kind: OperationKind, arguments: Mapping[str, Argument]) -> Operation:
        """Validate locally, store a new operation of any kind durably and return it (no network).

        `kind` is one of `shardrouter.client.kinds.KINDS` (a keyed RPC of the public API); `arguments`
        name its request's fields (see `shardrouter.client.kinds`). ValueError for an unknown kind,
        InvalidOperation for arguments the shard would refuse.
        """
        validate(kind, arguments)
        op = Operation.new(kind, arguments, caller_id=self.caller_id)
        self._require_store().create(op)  # durable before any network call
        return op

    def create_transfer(
        self, source: str, destination: str, amount_minor: int, currency: str, *, reference: str = ""
    ) -> Operation:
        """Validate locally, store a new transfer operation durably and return it (no network)."""
        return self.create_operation(
            _TRANSFER.kind, transfer_arguments(source, destination, amount_minor, currency, reference)
        )

    def create_deposit(
        self, account: str, amount_minor: int, currency: str, *, reference: str = ""
    ) -> Operation:
        """Validate locally, store a new deposit operation durably and return it (no network)."""
        return self.create_operation(
            _DEPOSIT.kind, deposit_arguments(account, amount_minor, currency, reference)
        )

    def transfer(
        self,
        source: str,
        destination: str,
        amount_minor: int,
        currency: str,
        *,
        reference: str = "",
        **timing: float,
    ) -> SendResult:
        """`create_transfer` then `send_with_retries`."""
        op = self.create_transfer(source, destination, amount_minor, currency, reference=reference)
        return self.send_with_retries(op, **timing)

    def deposit(
        self, account: str, amount_minor: int, currency: str, *, reference: str = "", **timing: float
    ) -> SendResult:
        """`create_deposit` then `send_with_retries`."""
        return self.send_with_retries(
            self.create_deposit(account, amount_minor, currency, reference=reference), **timing
        )

    def send_with_retries(
        self,
        operation: Operation,
        *,
        attempt_timeout_s: float = 2.0,
        budget_s: float = 30.0,
        base_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> SendResult:
        """Send the stored operation until a final answer or until `budget_s` is spent.

        Each attempt has its own deadline (`attempt_timeout_s`, cut to the budget left) and is
        recorded in the store. Retries follow `shardrouter.client.retry`: backoff with full jitter between
        `base_backoff_s` and `max_backoff_s`, or the server's RetryInfo / pushback delay. An operation
        that is already final is sent once more anyway: the shard replays its stored outcome.
        """
        policy = RetryPolicy(attempt_timeout_s, budget_s, base_backoff_s, max_backoff_s)
        op = self._stored(operation)
        with self._tracing.operation(op, OPERATION_TYPES[op.kind].method) as spans:
            result = self._send(op, policy, spans)
            record_operation(result.state.value, result.attempts)
        return result

    def send_hedged(
        self,
        operation: Operation,
        hedge: Hedge,
        *,
        attempt_timeout_s: float = 2.0,
        budget_s: float = 30.0,
        base_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> SendResult:
        """Send the stored operation, and again with the same key if it is not answered within
        `hedge.after_s` (`shardrouter.client.hedging`): the first final answer wins, the other attempt
        is cancelled. Both ask the shard to wait for the other (up to `attempt_timeout_s`), so the one
        that lands second returns the first one's outcome. Without a final answer from either, the
        operation goes on as `send_with_retries` does, within what is left of `budget_s`.

        `hedges_sent` and `hedges_won` count the second attempts sent and those whose answer won."""
        policy = RetryPolicy(attempt_timeout_s, budget_s, base_backoff_s, max_backoff_s)
        op = self._stored(operation)
        with self._tracing.operation(op, OPERATION_TYPES[op.kind].method) as spans:
            result = self._send_hedged(op, policy, spans, hedge)
            record_operation(result.state.value, result.attempts)
        return result

    def _send_hedged(self, op: Operation, policy: RetryPolicy, spans: AttemptSpans, hedge: Hedge) -> SendResult:
        request = build_request(op.kind, op.arguments)
        wait = (WAIT_METADATA, str(int(policy.attempt_timeout_s * 1000)))
        metadata = (*self._mutating_metadata(op), wait)
        method = OPERATION_TYPES[op.kind].method
        calls = [self._raw[op.kind], (hedge.channel or self._channel).unary_unary(method, _serialize, None)]
        race, sent_at = Race(), []
        spans_of: list[trace.Span] = []

        def launch(index: int) -> None:
            sent, span = spans.start(metadata, hedge=index > 0)
            sent_at.append((utc_now(), self._clock()))
            spans_of.append(span)
            race.add(calls[index].future(request, timeout=policy.attempt_timeout_s, metadata=sent))

        start = self._clock()
        launch(0)
        ended = race.next(hedge.after_s)
        if ended is None:
            launch(1)
            self.hedges_sent += 1
        attempts, last = 0, None
        while attempts < len(race.futures):
            index = ended if ended is not None else race.next()
            ended = None
            assert index is not None
            answer = _answer_of(race.futures[index], *sent_at[index], self._clock)
            record_attempt(spans_of[index], answer.code, answer.message, replayed=answer.replayed)
            spans_of[index].end()
            attempts += 1
            op, verdict, details, _ = self._record(op, answer)
            last = (answer, details)
            if verdict is not Verdict.RETRY:
                for cancelled in race.cancel_all_but(index):
                    spans_of[cancelled].set_attribute("shardrouter.client.cancelled", True)
                    spans_of[cancelled].end()
                if index > 0:
                    self.hedges_won += 1
                return self._result(op, answer.code, answer.message, answer.raw, details, answer.replayed, attempts)
        left = policy.budget_s - (self._clock() - start)
        if left <= _MIN_ATTEMPT_S:
            assert last is not None
            answer, details = last
            return self._result(
                op, answer.code, answer.message, answer.raw, details, answer.replayed, attempts, exhausted=True
            )
        rest = RetryPolicy(min(policy.attempt_timeout_s, left), left, policy.base_backoff_s, policy.max_backoff_s)
        return self._send(op, rest, spans, attempts)

    def _stored(self, operation: Operation) -> Operation:
        """The operation as stored (UnknownOperation if it is not)."""
        op = self._require_store().get(operation.id)
        if op is None:
            raise UnknownOperation(
                f"operation {operation.id} is not in the store; create it there before sending"
            )
        return op

    def _send(self, op: Operation, policy: RetryPolicy, spans: AttemptSpans, attempts: int = 0) -> SendResult:
        """Attempts one after the other until a final answer or the budget's end (`attempts`: made
        already by this call)."""
        request = build_request(op.kind, op.arguments)
        call = self._raw[op.kind]
        metadata = self._mutating_metadata(op)
        start = self._clock()
        while True:
            timeout = min(policy.attempt_timeout_s, policy.budget_s - (self._clock() - start))
            started_at, t0 = utc_now(), self._clock()
            raw: bytes | None = None
            with spans.attempt(metadata) as (sent, span):
                try:
                    raw, rpc = call.with_call(request, timeout=timeout, metadata=sent)
                    code, message, trailers = grpc.StatusCode.OK, "", tuple(rpc.trailing_metadata() or ())
                except grpc.RpcError as error:
                    code, message = error.code(), error.details() or ""
                    trailers = _trailers_of(error)
                record_attempt(span, code, message, replayed=was_replayed(trailers))
            attempts += 1
            answer = _Answer(code, message, raw, trailers, started_at, int((self._clock() - t0) * 1000))
            op, verdict, details, delay_hint = self._record(op, answer)
            if verdict is not Verdict.RETRY:
                return self._result(op, code, message, raw, details, answer.replayed, attempts)
            if delay_hint is not None:
                delay = delay_hint * (1 + self._rng.uniform(0, _SERVER_DELAY_JITTER))
            else:
                delay = backoff_s(attempts, policy, self._rng)
            if self._clock() - start + delay + _MIN_ATTEMPT_S >= policy.budget_s:
                return self._result(
                    op, code, message, raw, details, answer.replayed, attempts, exhausted=True
                )
            self._sleep(delay)

    def _record(self, op: Operation, answer: _Answer) -> tuple[Operation, Verdict, ErrorDetails, float | None]:
        """Record one attempt's answer in the store: the operation as stored, the verdict, the
        decoded details and the server's delay hint."""
        trailers = answer.trailers
        details = ErrorDetails() if answer.raw is not None else error_details(trailers)
        delay_hint = server_delay_s(details, pushback_s(trailers))
        verdict = classify(answer.code, details, delay_hint)
        attempt = Attempt(
            started_at=answer.started_at,
            code=answer.code.name,
            message=answer.message,
            replayed=answer.replayed,
            duration_ms=answer.duration_ms,
            reason=details.reason,
        )
        outcome = Outcome(
            code=answer.code.name,
            message=answer.message,
            reason=details.reason,
            domain=details.domain,
            error_metadata=details.metadata,
            field_violations=details.field_violations,
            response_b64=base64.b64encode(answer.raw).decode("ascii") if answer.raw is not None else None,
            replayed=answer.replayed,
        )
        stored = self._require_store().record_attempt(op.id, attempt, state=verdict.state, outcome=outcome)
        return stored, verdict, details, delay_hint

    def resume_pending(self, **timing: float) -> list[SendResult]:
        """Send every PENDING operation in the store again, oldest first, each with its own key."""
        return [self.send_with_retries(op, **timing) for op in self._require_store().list_pending()]

    # -- read-only calls ---------------------------------------------------------------------------

    def get_balance(
        self, account_id: str, *, timeout_s: float = 2.0, attempts: int = 3
    ) -> transfer_pb2.GetBalanceResponse:
        """An account's balance; retries UNAVAILABLE, raises RpcFailure otherwise."""
        request = transfer_pb2.GetBalanceRequest(account_id=account_id)
        return self._read(
            lambda: self._stub.GetBalance(request, timeout=timeout_s, metadata=self._read_metadata()),
            attempts,
        )

    def get_transfer(
        self, source: str, transfer_id: str, wait_ms: int = 0, *, timeout_s: float = 2.0, attempts: int = 3
    ) -> transfer_pb2.GetTransferResponse:
        """A transfer, optionally waiting up to `wait_ms` for it to leave PENDING; retries UNAVAILABLE."""
        request = transfer_pb2.GetTransferRequest(
            source_account_id=source, transfer_id=transfer_id, wait_for_completion_ms=wait_ms
        )
        deadline = timeout_s + wait_ms / 1000
        return self._read(
            lambda: self._stub.GetTransfer(request, timeout=deadline, metadata=self._read_metadata()),
            attempts,
        )

    # -- internals ---------------------------------------------------------------------------------

    def _require_store(self) -> OperationStore:
        if self.store is None:
            raise RuntimeError("this TransferClient has no operation store; it can only make read-only calls")
        return self.store

    def _mutating_metadata(self, op: Operation) -> tuple[tuple[str, str], ...]:
        # The operation's own caller: its key is scoped to the caller that first sent it.
        caller = ((CALLER_METADATA, op.caller_id),) if op.caller_id else ()
        return ((KEY_METADATA, op.idempotency_key), *caller, *self._metadata)

    def _read_metadata(self) -> tuple[tuple[str, str], ...]:
        caller = ((CALLER_METADATA, self.caller_id),) if self.caller_id else ()
        return (*caller, *self._metadata)

    def _read(self, call: Callable[[], _T], attempts: int) -> _T:
        policy = RetryPolicy()
        for number in range(1, max(1, attempts) + 1):
            try:
                return call()
            except grpc.RpcError as error:
                code = error.code()
                if code is grpc.StatusCode.UNAVAILABLE and number < attempts:
                    self._sleep(backoff_s(number, policy, self._rng))
                    continue
                trailers = _trailers_of(error)
                raise RpcFailure(code, error.details() or "", error_details(trailers)) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _result(
        self,
        op: Operation,
        code: grpc.StatusCode,
        message: str,
        raw: bytes | None,
        details: ErrorDetails,
        replayed: bool,
        attempts: int,
        *,
        exhausted: bool = False,
    ) -> SendResult:
        response = decode_response_bytes(op.kind, raw) if raw is not None else None
        return SendResult(
            operation=op,
            code=code,
            message=message,
            response=response,
            error=None if code is grpc.StatusCode.OK else details,
            replayed=replayed,
            attempts=attempts,
            budget_exhausted=exhausted,
        )


@dataclass(frozen=True, slots=True)
class _Answer:
    """One attempt's answer, as the store records it."""

    code: grpc.StatusCode
    message: str
    raw: bytes | None
    trailers: tuple[MetadataEntry, ...]
    started_at: datetime
    duration_ms: int

    @property
    def replayed(self) -> bool:
        return was_replayed(self.trailers)


def _answer_of(
    future: grpc.Future[Any], started_at: datetime, sent_at: float, clock: Callable[[], float]
) -> _Answer:
    """The answer of an attempt sent as a future (ended)."""
    duration_ms = int((clock() - sent_at) * 1000)
    try:
        raw = future.result()
    except grpc.RpcError as error:
        failed: grpc.Call = error  # type: ignore[assignment]  # a failed call is both
        trailers = _trailers_of(error)
        return _Answer(failed.code(), failed.details() or "", None, trailers, started_at, duration_ms)
    call: grpc.Call = future  # type: ignore[assignment]  # a future call is both
    trailers = tuple((k, v) for k, v in cast(Sequence[MetadataEntry], call.trailing_metadata() or ()))
    return _Answer(grpc.StatusCode.OK, "", bytes(raw), trailers, started_at, duration_ms)


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString(deterministic=True)
    return data


def _trailers_of(error: grpc.RpcError) -> tuple[MetadataEntry, ...]:
    # grpc-stubs types these as objects with .key/.value; at run time they are (key, value) tuples.
    raw = cast(Sequence[MetadataEntry], error.trailing_metadata() or ())
    return tuple((key, value) for key, value in raw)
