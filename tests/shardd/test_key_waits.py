"""A duplicate waiting for its key's original: who tells it the original ended, and when.

First `KeyFlights` alone: a wait request either marks the flight (which then says so when it lands)
or finds it ended (answered at once), never neither, however the two race. Then the granted wait a
call asks for (`read_wait`), and `WaitForOriginal` with a real listener and PostgreSQL: the waiter is
woken by the original's done notification, not by its backstop step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from opentelemetry import trace

from shardrouter.core.errors import Aborted, InvalidArgument, Reason
from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency.call import Answered, GuardedCall
from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.outcomes import OutcomeKind
from shardrouter.shardd.idempotency.process_keys import CompletedKeys, KeyFlights
from shardrouter.shardd.idempotency.record import StoredOutcome
from shardrouter.shardd.idempotency.steps import in_flight, read_key
from shardrouter.shardd.idempotency.waiting import (
    KeyWaits,
    WaitEnd,
    WaitForOriginal,
    payload_of,
    read_wait,
    scoped_of,
)
from shardrouter.shardd.listener import ShardListener
from shardrouter.v1 import transfer_pb2

KEY = ("scope|caller", "k-1")


def _completed() -> CompletedKeys:
    return CompletedKeys(max_entries=10, max_bytes=1 << 20)


# --- the lock ordering ----------------------------------------------------------------------------


def test_a_request_while_the_original_flies_marks_it_and_its_landing_says_so() -> None:
    flights = KeyFlights()
    flight, leads = flights.join(KEY)
    assert leads
    flight.mark_claimed()
    assert flights.answer_wait_request(KEY, _completed()) is False  # marked: it will tell
    assert flights.land(KEY, flight, None) is True  # ended without a record: the waiter claims


def test_a_request_after_the_original_landed_is_answered_at_once_and_only_once() -> None:
    flights = KeyFlights()
    flight, _ = flights.join(KEY)
    flight.mark_claimed()
    assert flights.land(KEY, flight, None) is False  # nobody waited
    assert flights.answer_wait_request(KEY, _completed()) is True
    # Told once: a later request (a retry that claimed the key elsewhere since) is not this
    # process's to answer, or a waiter would spin on "ended".
    assert flights.answer_wait_request(KEY, _completed()) is False


def test_a_flight_that_neither_claimed_nor_saw_a_record_tells_nobody() -> None:
    """A duplicate's own look (in flight elsewhere) ends nothing a waiter cares about."""
    flights = KeyFlights()
    flight, _ = flights.join(KEY)
    assert flights.answer_wait_request(KEY, _completed()) is False
    assert flights.land(KEY, flight, None) is False
    assert flights.answer_wait_request(KEY, _completed()) is False


def test_a_key_this_process_never_saw_is_not_answered_but_a_cached_record_is() -> None:
    flights, completed = KeyFlights(), _completed()
    assert flights.answer_wait_request(KEY, completed) is False
    assert flights.answer_wait_request(("other", "k"), completed) is False


@pytest.mark.parametrize("round_", range(3))
def test_a_request_racing_the_landing_is_answered_exactly_once(round_: int) -> None:
    """The request and the landing start together, many times: each time exactly one of them says
    the original ended (never none: no lost wake-up; never both: no double notice)."""
    for _ in range(300):
        flights = KeyFlights()
        flight, _ = flights.join(KEY)
        flight.mark_claimed()
        start = threading.Barrier(2)
        said: dict[str, bool] = {}

        def request(
            flights: KeyFlights = flights, start: threading.Barrier = start, said: dict[str, bool] = said
        ) -> None:
            start.wait()
            said["request"] = flights.answer_wait_request(KEY, _completed())

        thread = threading.Thread(target=request)
        thread.start()
        start.wait()
        said["land"] = flights.land(KEY, flight, None)
        thread.join()
        assert said["request"] != said["land"], said


# --- the granted wait -----------------------------------------------------------------------------


def test_the_wait_asked_for_is_read_and_capped() -> None:
    assert read_wait([], 10_000) == 0
    assert read_wait([(WAIT_METADATA, "2500")], 10_000) == 2500
    assert read_wait([(WAIT_METADATA, "0")], 10_000) == 0
    assert read_wait([(WAIT_METADATA, "60000")], 10_000) == 10_000
    assert read_wait([(WAIT_METADATA, "9" * 40)], 10_000) == 10_000


@pytest.mark.parametrize("value", ["-1", "1.5", "", "soon", " 5", "\uff15", b"5"])
def test_a_bad_wait_is_invalid_argument(value: str | bytes) -> None:
    with pytest.raises(InvalidArgument) as refused:
        read_wait([(WAIT_METADATA, value)], 10_000)
    assert refused.value.reason == Reason.INVALID_REQUEST


def test_a_wait_sent_twice_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        read_wait([(WAIT_METADATA, "5"), (WAIT_METADATA, "6")], 10_000)


def test_a_scoped_key_survives_its_payload() -> None:
    scoped = ('method|spiffe://x/"a,b"', "k\u00e9y")
    assert scoped_of(payload_of(scoped)) == scoped
    assert scoped_of("not json") is None and scoped_of("[1, 2]") is None


# --- the waiter, woken by the done notification ------------------------------------------------------


class _Context:
    """What the step reads of a servicer context: the time left (no deadline)."""

    def time_remaining(self) -> float | None:
        return None


def _call(wait_ms: int) -> GuardedCall:
    key = read_key([(KEY_METADATA, str(new_key()))], IdempotencyConfig(), datetime.now(UTC))
    return GuardedCall(
        _Context(),  # type: ignore[arg-type]
        trace.INVALID_SPAN,
        "scope|caller",
        key,
        transfer_pb2.DepositRequest(),
        b"hash",
        None,
        wait_ms,
    )


@pytest.fixture
def key_waits(database: str) -> Iterator[tuple[KeyWaits, KeyFlights]]:
    """A process's waiting side over a real database, its listener heard from."""
    db = Database(database, min_size=1, max_size=2)
    db.open()
    flights = KeyFlights()
    waits = KeyWaits(db, flights, _completed())
    listener = ShardListener(database)
    waits.subscribe(listener)
    listener.start()
    _until(lambda: waits.listening)
    try:
        yield waits, flights
    finally:
        listener.stop()
        db.close()


def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_waiter_is_woken_by_its_originals_landing(key_waits: tuple[KeyWaits, KeyFlights]) -> None:
    waits, flights = key_waits
    call = _call(wait_ms=30_000)
    flight, _ = flights.join(call.scoped_key)
    flight.mark_claimed()  # the original, in flight in this process
    outcome = StoredOutcome(code=0, message="", details=None, response=b"stored", trailers=())
    committed = threading.Event()

    def chain(c: GuardedCall) -> Answered:  # what the chain below would answer
        if not committed.is_set():
            raise in_flight(c.span, 100)
        return outcome, OutcomeKind.REPLAY, c.key.time

    answers: list[Answered] = []
    waiter = threading.Thread(target=lambda: answers.append(WaitForOriginal(chain, waits)(call)))
    waiter.start()
    _until(lambda: waits.watches.asleep == 1 and flight.waited)  # asleep, and its request heard
    committed.set()
    if flights.land(call.scoped_key, flight, None):
        waits.announce(call.scoped_key)
    waiter.join(10)
    assert answers and answers[0][0] is outcome
    assert waits.watches.woken == 1 and waits.watches.timed_out == 0  # the notice, not the backstop
    assert waits.ends[WaitEnd.REPLAYED] == 1 and waits.waits == 1


def test_a_waiter_past_its_bound_gets_the_in_flight_answer(key_waits: tuple[KeyWaits, KeyFlights]) -> None:
    waits, _ = key_waits
    call = _call(wait_ms=50)

    def chain(c: GuardedCall) -> Answered:
        raise in_flight(c.span, 100)

    with pytest.raises(Aborted) as answered:
        WaitForOriginal(chain, waits)(call)
    assert answered.value.reason == Reason.IDEMPOTENCY_KEY_IN_FLIGHT
    assert waits.ends[WaitEnd.BOUND_REACHED] == 1


def test_a_call_that_asked_no_wait_is_answered_at_once(key_waits: tuple[KeyWaits, KeyFlights]) -> None:
    waits, _ = key_waits

    def chain(c: GuardedCall) -> Answered:
        raise in_flight(c.span, 100)

    with pytest.raises(Aborted):
        WaitForOriginal(chain, waits)(_call(wait_ms=0))
    assert waits.waits == 0 and waits.requests_sent == 0
