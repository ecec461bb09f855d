"""The guarded call's state machine, step by step, over an in-memory key store (no PostgreSQL).

Each rule of docs/architecture.md's status mapping: a new key runs the handler once and stores its
outcome; a completed key is replayed verbatim (from memory, or from the store); a key in flight is
ABORTED with RetryInfo; a key reused for another request, an expired key, a key from the future and a
malformed key are refused; validation failures and transient failures leave the key free; business
refusals are stored and replayed. The same rules against a real database: tests/shardd.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from shardrouter.core.errors import FailedPrecondition, ShardRouterError, Unavailable
from shardrouter.core.keys import new_key
from shardrouter.core.validation import validate_deposit
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.shardd.admission import Admission, AdmissionLimits
from shardrouter.shardd.db import Database, current_transaction
from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.interceptor import Collaborators, GuardedMethod, MutatingMethod, chain
from shardrouter.shardd.idempotency.outcomes import CallOutcome, OutcomeKind, OutcomeReport
from shardrouter.shardd.idempotency.process_keys import CompletedKeys, KeyFlights
from shardrouter.shardd.idempotency.steps import Admit, AnswerFromMemory
from shardrouter.shardd.idempotency.waiting import KeyWaits, WaitForOriginal
from shardrouter.shardd.identity import IdentityPolicy
from shardrouter.v1 import transfer_pb2
from tests.unit.fakes import Aborted, FakeContext, FakeKeys

DEPOSIT = "/shardrouter.v1.TransferService/Deposit"
NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CONFIG = IdempotencyConfig(
    retention=timedelta(days=30), max_clock_skew=timedelta(minutes=5), claim_lock_timeout_ms=5
)


class Shard:
    """One guarded Deposit over a `FakeKeys`, with what it reported and what its handler did."""

    def __init__(
        self,
        keys: FakeKeys | None = None,
        *,
        admission: Admission | None = None,
        config: IdempotencyConfig = CONFIG,
    ) -> None:
        self.keys = keys if keys is not None else FakeKeys()
        #: The shard's clock: the receipt time of keys that do not date themselves.
        self.now = NOW
        self.outcomes: list[CallOutcome] = []
        self.handled = 0
        self.fail_with: Exception | None = None
        self.collaborators = Collaborators(
            database=cast(Database, None),  # the steps reach the key table through `keys` only
            config=config,
            identity=IdentityPolicy(dev_mode=True),
            clock=lambda: self.now,
            report=OutcomeReport([self.outcomes.append]),
            tracer=None,
            shard_id="a",
            admission=admission,
            completed=(completed := CompletedKeys(max_entries=100, max_bytes=1 << 20)),
            flights=(flights := KeyFlights()),
            # No call here asks to wait, so the waits never reach a database.
            waits=KeyWaits(cast(Database, None), flights, completed),
        )
        handler = grpc.unary_unary_rpc_method_handler(
            self._deposit,
            request_deserializer=transfer_pb2.DepositRequest.FromString,
            response_serializer=transfer_pb2.DepositResponse.SerializeToString,
        )
        method = MutatingMethod(DEPOSIT, validate_deposit, routing_field="account_id")
        self.guarded = GuardedMethod(self.collaborators, method, handler, self.keys)

    def _deposit(self, request: transfer_pb2.DepositRequest, context: Any) -> transfer_pb2.DepositResponse:
        self.handled += 1
        current_transaction().conn.writes.append(f"credit {request.account_id} {request.amount.amount_minor}")
        context.set_trailing_metadata((("x-handler", "yes"),))
        if self.fail_with is not None:
            raise self.fail_with
        return transfer_pb2.DepositResponse(entry_id=f"e{self.handled}", balance=request.amount)

    def call(
        self, request: transfer_pb2.DepositRequest | bytes, metadata: tuple[tuple[str, Any], ...]
    ) -> Answer:
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        context = FakeContext(metadata)
        try:
            response = self.guarded(raw, cast(grpc.ServicerContext, context))
        except Aborted:
            return Answer(context, None)
        return Answer(context, response)

    @property
    def kinds(self) -> list[OutcomeKind]:
        return [o.outcome for o in self.outcomes]


class Answer:
    """What the caller got: response bytes, or a status; and the trailers."""

    def __init__(self, context: FakeContext, response: bytes | None) -> None:
        self.response = response
        self.status = context.status
        self.trailers = dict(
            context.status.trailing_metadata if context.status else context.trailing_metadata()
        )

    @property
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK if self.status is None else self.status.code

    def detail(self, cls: Any) -> Any:
        raw = self.trailers.get("grpc-status-details-bin")
        assert isinstance(raw, bytes), "no rich details"
        for any_detail in status_pb2.Status.FromString(raw).details:
            if any_detail.Is(cls.DESCRIPTOR):
                message = cls()
                any_detail.Unpack(message)
                return message
        return None

    @property
    def reason(self) -> str:
        return str(self.detail(error_details_pb2.ErrorInfo).reason)


def deposit(account: str = "alice", amount: int = 100) -> transfer_pb2.DepositRequest:
    return transfer_pb2.DepositRequest(
        account_id=account, amount=transfer_pb2.Money(amount_minor=amount, currency="EUR")
    )


def keyed(key: uuid.UUID | str | bytes | None = None, *extra: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    value = str(new_key(_ms(NOW))) if key is None else key
    return (("idempotency-key", value if isinstance(value, str | bytes) else str(value)), *extra)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


# --- a new key, and its replays ----------------------------------------------------------------


def test_a_new_key_runs_the_handler_once_and_stores_its_whole_outcome() -> None:
    shard = Shard()
    md = keyed()
    answer = shard.call(deposit(), md)
    assert answer.code is grpc.StatusCode.OK
    assert transfer_pb2.DepositResponse.FromString(answer.response or b"").entry_id == "e1"
    assert answer.trailers["x-handler"] == "yes"
    assert answer.trailers["idempotency-expires-at"] == "2026-03-31T12:00:00.000+00:00"
    assert "idempotency-replayed" not in answer.trailers
    assert shard.keys.writes == ["credit alice 100"]
    (record,) = shard.keys.committed.values()
    assert record.outcome is not None and record.outcome.response == answer.response
    assert record.scope == f"{DEPOSIT}|anonymous"
    assert shard.kinds == [OutcomeKind.NEW]


def test_a_completed_key_is_replayed_from_memory_without_a_transaction() -> None:
    shard = Shard()
    md = keyed()
    first = shard.call(deposit(), md)
    second = shard.call(deposit(), md)
    assert second.response == first.response
    assert second.trailers.pop("idempotency-replayed") == "true"
    assert second.trailers == first.trailers
    assert shard.handled == 1 and shard.keys.transactions == 1
    assert shard.kinds == [OutcomeKind.NEW, OutcomeKind.REPLAY]


def test_a_completed_key_is_replayed_from_the_store_by_another_process() -> None:
    first_process = Shard()
    md = keyed()
    first = first_process.call(deposit(), md)
    other_process = Shard(first_process.keys)  # same key table, empty memory
    second = other_process.call(deposit(), md)
    assert second.response == first.response
    assert second.trailers["idempotency-replayed"] == "true"
    assert other_process.handled == 0
    assert first_process.keys.writes == ["credit alice 100"]
    assert other_process.kinds == [OutcomeKind.REPLAY]


def test_callers_never_share_a_key() -> None:
    shard = Shard()
    key = new_key(_ms(NOW))
    shard.call(deposit(), keyed(key, ("x-caller-id", "one")))
    shard.call(deposit(), keyed(key, ("x-caller-id", "two")))
    assert shard.handled == 2
    assert shard.kinds == [OutcomeKind.NEW, OutcomeKind.NEW]


# --- refusals that store nothing ---------------------------------------------------------------


def test_a_key_reused_for_another_request_is_refused_from_memory_and_from_the_store() -> None:
    shard = Shard()
    md = keyed()
    shard.call(deposit(amount=100), md)
    from_memory = shard.call(deposit(amount=200), md)
    from_store = Shard(shard.keys).call(deposit(amount=200), md)
    for answer in (from_memory, from_store):
        assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
        assert answer.reason == "IDEMPOTENCY_KEY_REUSED"
        assert answer.trailers["idempotency-outcome"] == "key_reused"
    assert shard.keys.writes == ["credit alice 100"]


def test_unknown_fields_do_not_make_another_request() -> None:
    shard = Shard()
    md = keyed()
    shard.call(deposit(), md)
    newer_client = deposit().SerializeToString() + b"\xa8\x06\x01"  # field 101, varint 1
    answer = shard.call(newer_client, md)
    assert answer.code is grpc.StatusCode.OK and answer.trailers["idempotency-replayed"] == "true"


def test_a_key_in_flight_elsewhere_is_aborted_with_retry_info_and_nothing_stored() -> None:
    shard = Shard()
    key = new_key(_ms(NOW))
    shard.keys.held.add((f"{DEPOSIT}|anonymous", str(key)))
    answer = shard.call(deposit(), keyed(key))
    assert answer.code is grpc.StatusCode.ABORTED
    assert answer.reason == "IDEMPOTENCY_KEY_IN_FLIGHT"
    assert (
        answer.detail(error_details_pb2.RetryInfo).retry_delay.ToMilliseconds() == CONFIG.in_flight_retry_ms
    )
    assert answer.trailers["grpc-retry-pushback-ms"] == str(CONFIG.in_flight_retry_ms)
    assert shard.handled == 0 and not shard.keys.committed and shard.keys.commits == 0
    assert shard.kinds == [OutcomeKind.IN_FLIGHT]


def test_a_duplicate_of_a_key_a_thread_here_works_on_joins_its_flight() -> None:
    shard = Shard()
    key = new_key(_ms(NOW))
    scoped = (f"{DEPOSIT}|anonymous", str(key))
    flight, leads = shard.collaborators.flights.join(scoped)  # this thread leads, and has claimed
    assert leads
    flight.mark_claimed()
    answer = shard.call(deposit(), keyed(key))
    assert answer.code is grpc.StatusCode.ABORTED and answer.reason == "IDEMPOTENCY_KEY_IN_FLIGHT"
    assert shard.keys.transactions == 0  # answered without the store
    shard.collaborators.flights.land(scoped, flight, None)
    # A leader that found the key completed: a duplicate joining its flight gets the same record.
    leader = Shard()
    leader.call(deposit(), keyed(key))
    (record,) = leader.keys.committed.values()
    flight, leads = shard.collaborators.flights.join(scoped)
    assert leads
    flight._end(record)  # settled, still listed: what a duplicate joining just before the landing sees
    answer = shard.call(deposit(), keyed(key))
    assert answer.code is grpc.StatusCode.OK and answer.trailers["idempotency-replayed"] == "true"
    assert shard.keys.transactions == 0
    assert shard.handled == 0


def test_a_duplicate_whose_leader_is_slow_to_reach_the_database_looks_for_itself() -> None:
    """A leader that has neither claimed nor ended within the follow bound (queued for admission,
    or its read slowed by a busy machine): the duplicate goes to the store on its own, so a completed
    key is replayed rather than answered ABORTED, and a key held elsewhere is still ABORTED."""
    key = new_key(_ms(NOW))
    scoped = (f"{DEPOSIT}|anonymous", str(key))
    first = Shard()
    first.call(deposit(), keyed(key))
    shard = Shard(first.keys)  # the same store: the key is committed there
    flight, leads = shard.collaborators.flights.join(scoped)  # a leader that never settles
    assert leads
    answer = shard.call(deposit(), keyed(key))
    assert answer.code is grpc.StatusCode.OK and answer.trailers["idempotency-replayed"] == "true"
    assert shard.keys.transactions == 2 and shard.handled == 0  # the first call's, and this look
    assert len(shard.collaborators.flights) == 1  # the leader's flight stays listed, untouched
    # The same, with the key claimed by another connection and not yet committed: ABORTED.
    other = new_key(_ms(NOW))
    shard.keys.held.add((f"{DEPOSIT}|anonymous", str(other)))
    slow, leads = shard.collaborators.flights.join((f"{DEPOSIT}|anonymous", str(other)))
    assert leads
    answer = shard.call(deposit(), keyed(other))
    assert answer.code is grpc.StatusCode.ABORTED and answer.reason == "IDEMPOTENCY_KEY_IN_FLIGHT"
    shard.collaborators.flights.land(scoped, flight, None)
    shard.collaborators.flights.land((f"{DEPOSIT}|anonymous", str(other)), slow, None)


class _CountedLimits(AdmissionLimits):
    """Admission limits that count the slots they refused."""

    def __init__(self, *, max_in_flight: int, max_waiting: int) -> None:
        super().__init__(max_in_flight=max_in_flight, max_waiting=max_waiting)
        self.refused = 0

    def acquire(self, caller: str) -> None:
        try:
            super().acquire(caller)
        except ShardRouterError:
            self.refused += 1
            raise


def _until(what: str, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.005)


def test_a_waiting_duplicate_whose_look_a_full_shard_sheds_waits_on() -> None:
    """A duplicate waiting for its original holds no admission slot between looks, so a look may
    find the shard full; that look is made again later, within the same bound, instead of ending
    the wait with the shed answer."""
    limits = _CountedLimits(max_in_flight=1, max_waiting=0)
    shard = Shard(admission=Admission(limits, dev_mode=True))
    key = new_key(_ms(NOW))
    scoped = (f"{DEPOSIT}|anonymous", str(key))
    shard.keys.held.add(scoped)  # the original, in flight on another connection
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(shard.call, deposit(), keyed(key, (WAIT_METADATA, "10000")))
        _until("the duplicate to look again while it waits", lambda: shard.keys.transactions >= 2)
        limits.acquire("someone-else")  # the shard is now full
        _until("two of the waiting duplicate's looks to be shed", lambda: limits.refused >= 2)
        assert not waiting.done()
        limits.release("someone-else")
        shard.keys.held.discard(scoped)  # the original ended without an outcome
        answer = waiting.result(10)
    assert answer.code is grpc.StatusCode.OK, answer.status
    assert shard.handled == 1 and shard.kinds == [OutcomeKind.NEW]  # it ran the call itself, once
    assert limits.in_flight == 0


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((), "IDEMPOTENCY_KEY_MISSING"),
        ((("idempotency-key", "0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"),) * 2, "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key-bin", b"x"), ("idempotency-key", b"\x01")), "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key", "not a key"),), "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key", "k" * 256),), "IDEMPOTENCY_KEY_INVALID"),
    ],
    ids=["missing", "twice", "binary", "space", "too-long"],
)
def test_a_malformed_key_is_invalid_and_never_reaches_the_store(metadata: Any, reason: str) -> None:
    shard = Shard()
    answer = shard.call(deposit(), metadata)
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT and answer.reason == reason
    assert "idempotency-expires-at" not in answer.trailers
    assert answer.trailers["idempotency-outcome"] == "invalid"
    assert shard.keys.transactions == 0


def test_an_expired_key_is_refused_for_reconciliation_not_applied_again() -> None:
    shard = Shard()
    old = new_key(_ms(NOW - CONFIG.retention - timedelta(seconds=1)))
    answer = shard.call(deposit(), keyed(old))
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.reason == "IDEMPOTENCY_KEY_EXPIRED"
    assert answer.trailers["idempotency-outcome"] == "expired"
    assert "idempotency-expires-at" in answer.trailers
    assert shard.keys.transactions == 0


def test_a_key_from_beyond_the_clock_skew_is_invalid() -> None:
    shard = Shard()
    assert shard.call(deposit(), keyed(new_key(_ms(NOW + timedelta(minutes=4))))).code is grpc.StatusCode.OK
    answer = shard.call(deposit(), keyed(new_key(_ms(NOW + timedelta(minutes=6)))))
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT
    assert answer.reason == "IDEMPOTENCY_KEY_FROM_FUTURE"


def test_a_validation_failure_is_answered_not_stored_and_leaves_the_key_free() -> None:
    shard = Shard()
    md = keyed()
    bad = shard.call(deposit(amount=-5), md)
    assert bad.code is grpc.StatusCode.INVALID_ARGUMENT
    assert bad.detail(error_details_pb2.BadRequest) is not None
    garbage = shard.call(b"\xff\xff\xff", md)
    assert garbage.code is grpc.StatusCode.INVALID_ARGUMENT and garbage.reason == "INVALID_REQUEST"
    assert shard.keys.transactions == 0
    assert shard.call(deposit(), md).code is grpc.StatusCode.OK  # the same key, now a valid request
    assert shard.kinds == [OutcomeKind.INVALID, OutcomeKind.INVALID, OutcomeKind.NEW]


# --- the handler's failures ----------------------------------------------------------------------


def test_a_business_refusal_is_stored_its_writes_undone_and_replayed_byte_for_byte() -> None:
    shard = Shard()
    shard.fail_with = FailedPrecondition("no such money", reason="INSUFFICIENT_FUNDS")
    md = keyed()
    first = shard.call(deposit(), md)
    shard.fail_with = None  # a retry would now succeed, but the stored refusal is the answer
    second = Shard(shard.keys).call(deposit(), md)
    assert first.code is second.code is grpc.StatusCode.FAILED_PRECONDITION
    assert first.reason == "INSUFFICIENT_FUNDS"
    assert second.trailers.pop("idempotency-replayed") == "true"
    assert second.trailers == first.trailers
    assert first.status is not None and second.status is not None
    assert second.status.details == first.status.details
    assert shard.keys.writes == []  # rolled back; the refusal was stored on its own
    assert len(shard.keys.committed) == 1


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (
            Unavailable("database down", reason="DATABASE_UNAVAILABLE", retry_after_ms=50),
            grpc.StatusCode.UNAVAILABLE,
        ),
        (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
    ],
    ids=["transient", "unexpected"],
)
def test_a_transient_or_unexpected_failure_rolls_back_and_leaves_the_key_free(
    failure: Exception, code: grpc.StatusCode
) -> None:
    shard = Shard()
    shard.fail_with = failure
    md = keyed()
    answer = shard.call(deposit(), md)
    assert answer.code is code
    assert answer.trailers["idempotency-outcome"] == "error"
    assert not shard.keys.committed and not shard.keys.writes
    shard.fail_with = None
    assert shard.call(deposit(), md).code is grpc.StatusCode.OK
    assert shard.kinds == [OutcomeKind.ERROR, OutcomeKind.NEW]
    assert shard.keys.writes == ["credit alice 100"]


# --- admission, and the chain ----------------------------------------------------------------------


def test_a_saturated_shard_sheds_new_keys_but_still_answers_from_memory() -> None:
    limits = AdmissionLimits(max_in_flight=1, max_waiting=0)
    shard = Shard(admission=Admission(limits, dev_mode=True))
    md = keyed()
    assert shard.call(deposit(), md).code is grpc.StatusCode.OK
    limits.acquire("someone-else")  # the shard is now full
    shed = shard.call(deposit(), keyed())
    assert shed.code is grpc.StatusCode.UNAVAILABLE and shed.reason == "SHARD_SATURATED"
    replay = shard.call(deposit(), md)
    assert replay.code is grpc.StatusCode.OK and replay.trailers["idempotency-replayed"] == "true"
    assert shard.kinds == [OutcomeKind.NEW, OutcomeKind.SHED, OutcomeKind.REPLAY]
    assert limits.in_flight == 1


def test_the_chain_leaves_admission_out_when_there_are_no_limits() -> None:
    without = Shard()
    with_limits = Shard(admission=Admission(AdmissionLimits(max_in_flight=4, max_waiting=0), dev_mode=True))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    method = MutatingMethod(DEPOSIT, validate_deposit)
    # The chain opens with the wait for an original (a no-op unless the call asks), then memory.
    first = chain(without.collaborators, method, handler, without.keys)
    assert isinstance(first, WaitForOriginal) and isinstance(first._next, AnswerFromMemory)
    assert not isinstance(first._next._next, Admit)
    limited = chain(with_limits.collaborators, method, handler, with_limits.keys)
    assert isinstance(limited, WaitForOriginal) and isinstance(limited._next, AnswerFromMemory)
    assert isinstance(limited._next._next, Admit)


# --- keys that do not date themselves -----------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["c8a3e5f1-7d2b-4e6a-9f0c-1b3d5e7f9a2c", "order-7781/attempt:A", "{0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b}"]
)
def test_a_key_dated_by_receipt_applies_once_and_its_replays_expire_with_the_first_receipt(key: str) -> None:
    shard = Shard()
    first = shard.call(deposit(), keyed(key))
    assert first.code is grpc.StatusCode.OK
    assert first.trailers["idempotency-expires-at"] == "2026-03-31T12:00:00.000+00:00"  # receipt + 30 days
    (record,) = shard.keys.committed.values()
    assert record.key == key and record.key_time == NOW
    shard.now = NOW + timedelta(days=3)  # a later retry: its record still dates from the first receipt
    for _ in range(2):  # from memory, then again
        replay = shard.call(deposit(), keyed(key))
        assert replay.response == first.response and replay.trailers["idempotency-replayed"] == "true"
        assert replay.trailers["idempotency-expires-at"] == "2026-03-31T12:00:00.000+00:00"
    assert shard.handled == 1 and shard.keys.writes == ["credit alice 100"]


def test_a_uuid_key_is_one_key_in_either_case() -> None:
    shard = Shard()
    key = str(uuid.uuid4())
    assert shard.call(deposit(), keyed(key.upper())).code is grpc.StatusCode.OK
    replay = shard.call(deposit(), keyed(key))
    assert replay.trailers["idempotency-replayed"] == "true" and shard.handled == 1
    (record,) = shard.keys.committed.values()
    assert record.key == key


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("3b241101-e2bb-4255-8caf-4136c566a962", "a version 4 UUID"),
        (str(uuid.uuid1()), "a version 1 UUID"),
        ("abc", "an opaque key"),
    ],
    ids=["uuid4", "uuid1", "opaque"],
)
def test_a_shard_requiring_uuidv7_refuses_any_other_key_and_stores_nothing(key: str, kind: str) -> None:
    shard = Shard(config=IdempotencyConfig(retention=timedelta(days=30), require_uuidv7=True))
    answer = shard.call(deposit(), keyed(key))
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT and answer.reason == "IDEMPOTENCY_KEY_INVALID"
    assert answer.status is not None
    assert "accepts only UUIDv7 keys" in answer.status.details and kind in answer.status.details
    assert "applied a second time" in answer.status.details
    assert shard.keys.transactions == 0 and shard.handled == 0
    assert shard.call(deposit(), keyed()).code is grpc.StatusCode.OK  # a UUIDv7 is still served


def test_with_the_claim_sent_ahead_a_duplicate_runs_the_handler_and_keeps_none_of_it() -> None:
    """The claim travels with the handler's statements (`KeyStore.claiming_transaction`): a new key
    applies once; a completed key is replayed and an in-flight one aborted, each after a handler
    run whose writes are all dropped, and neither stores anything."""
    first = Shard(FakeKeys(ahead=True))
    md = keyed()
    applied = first.call(deposit(), md)
    assert applied.code is grpc.StatusCode.OK and first.handled == 1
    other_process = Shard(first.keys)  # same key table, empty memory
    replayed = other_process.call(deposit(), md)
    assert replayed.response == applied.response and replayed.trailers["idempotency-replayed"] == "true"
    key = new_key(_ms(NOW))
    first.keys.held.add((f"{DEPOSIT}|anonymous", str(key)))
    held = other_process.call(deposit(), keyed(key))
    assert held.code is grpc.StatusCode.ABORTED and held.reason == "IDEMPOTENCY_KEY_IN_FLIGHT"
    assert other_process.handled == 2  # both started the handler
    assert first.keys.writes == ["credit alice 100"] and len(first.keys.committed) == 1
    assert other_process.kinds == [OutcomeKind.REPLAY, OutcomeKind.IN_FLIGHT]
