"""A duplicate that asks to wait for its original in flight (`idempotency-wait-ms`, HTTP `Prefer:
wait=N`), over real processes: two daemons of one shard on one database, behind a router.

The original is held in flight one of two ways, never by a timer:
- by a row lock the test holds on the source account: the original claimed the key and its Transfer
  waits for the lock, and goes on to commit when the test lets the lock go;
- at the failpoint `shardd.claimed_before_commit`, where it stays until it is SIGKILLed.
The test knows a duplicate waits when it hears the duplicate's wait request (`LISTEN` on the wait
channel), and knows its original's end was announced when it hears the done notification.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import psycopg
import pytest

from shardrouter.core.keys import new_key
from shardrouter.core.wire_names import WAIT_APPLIED_TRAILER
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd.idempotency.steps import CLAIMED_BEFORE_COMMIT
from shardrouter.shardd.idempotency.waiting import DONE_CHANNEL, WAIT_CHANNEL
from shardrouter.v1 import transfer_pb2
from tests.faults.daemons import (
    DEPOSIT,
    TRANSFER,
    Answer,
    OneShard,
    balances,
    call,
    call_in_background,
    claim_holders,
    deposit_request,
    entries,
    query,
    stored_response,
    transfer_request,
    wait_for,
)

CLAIMED = CLAIMED_BEFORE_COMMIT
SRC, DST = "acct-src", "acct-dst"


@pytest.fixture
def shard(postgres: LocalPostgres, tmp_path: Path) -> Iterator[OneShard]:
    """Two daemons of one shard and a router (with its HTTP front), not started. Handlers may wait
    30 s for a row lock; the second daemon has one database connection and one admission slot."""
    one = OneShard.build(postgres, tmp_path, extra_env={"SHARDD_HANDLER_LOCK_TIMEOUT_MS": "30000"})
    one.daemons[1].env.update(
        {"SHARDD_POOL_MIN": "1", "SHARDD_POOL_MAX": "1", "SHARDD_MAX_IN_FLIGHT": "1", "SHARDD_MAX_WAITING": "0"}
    )
    one.router.env["ROUTER_HTTP_LISTEN"] = f"127.0.0.1:{free_port()}"
    yield one
    one.stop()


class Notes:
    """The shard's wait requests and done notifications, as a `LISTEN`ing test connection hears them."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._conn.execute(f"LISTEN {WAIT_CHANNEL}")
        self._conn.execute(f"LISTEN {DONE_CHANNEL}")
        self.heard: list[tuple[str, str]] = []

    def await_note(self, channel: str, key: str, count: int = 1, timeout_s: float = 20.0) -> None:
        """Until `count` notifications on `channel` named `key` were heard."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for c, p in self.heard if c == channel and key in p) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"no {channel} notification for {key}: heard {self.heard}"
            for note in self._conn.notifies(timeout=left, stop_after=1):
                self.heard.append((note.channel, note.payload))

    def close(self) -> None:
        self._conn.close()


def _seed(through: str) -> None:
    """SRC holds 1000 and DST 1, opened through the daemon at `through`."""
    for account, amount in ((SRC, 1000), (DST, 1)):
        opened = call(through, DEPOSIT, deposit_request(account, amount), str(new_key()))
        assert opened.code is grpc.StatusCode.OK, opened


def _admitted(address: str, request: bytes, attempts: int = 5) -> Answer:
    """A Deposit with one new key, sent again while the daemon sheds it as saturated, after the delay
    its answer asks for, as a client does. A waiting duplicate holds the one admission slot of
    `other` only for each brief look (between looks it holds nothing), and a call that meets a look
    is shed like any call that meets a full shard; a slot held for the whole wait would shed every
    attempt."""
    key = str(new_key())
    for _ in range(attempts):
        answer = call(address, DEPOSIT, request, key, 30.0)
        if answer.reason != "SHARD_SATURATED":
            return answer
        time.sleep(int(dict(answer.trailers).get("grpc-retry-pushback-ms", "200")) / 1000)
    return answer


def _trailer(answer: Answer, name: str) -> str | bytes | None:
    return next((v for k, v in answer.trailers if k == name), None)


class RowHold:
    """The test's transaction holding the source account's row: a Transfer from it waits."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn)
        self._conn.execute("SELECT 1 FROM accounts WHERE id = %s FOR UPDATE", (SRC,))

    def release(self) -> None:
        self._conn.commit()
        self._conn.close()


def _original_blocked(dsn: str) -> bool:
    """The original claimed its key and waits for the held row."""
    holders = claim_holders(dsn)
    return len(holders) == 1 and bool(
        query(dsn, "SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted", holders[0])
    )


def _applied_once(shard: OneShard, key: str) -> None:
    assert entries(shard.dsn, key) == [("transfer_in", DST, 300), ("transfer_out", SRC, -300)]
    assert balances(shard.dsn, SRC, DST) == [700, 301]
    assert len(query(shard.dsn, "SELECT id FROM transfers")) == 1


def test_a_waiting_duplicate_returns_the_originals_bytes_from_either_daemon(shard: OneShard) -> None:
    """The original, on daemon 0, waits for a row the test holds; a duplicate on each daemon waits
    for it, and both return its stored answer byte for byte once it commits."""
    shard.start()
    _seed(shard.daemons[0].address)
    key, request = str(new_key()), transfer_request(SRC, DST, 300)
    notes, hold = Notes(shard.dsn), RowHold(shard.dsn)
    try:
        first = call_in_background(shard.daemons[0].address, TRANSFER, request, key)
        wait_for("the original to claim and wait for the row", lambda: _original_blocked(shard.dsn), logs=shard.logs)
        with ThreadPoolExecutor(2) as pool:
            # One duplicate on the original's daemon (it joins the flight there), one on the other.
            waiting: list[Future[Answer]] = []
            for count, daemon in enumerate(shard.daemons, start=1):
                waiting.append(pool.submit(call, daemon.address, TRANSFER, request, key, 30.0, wait_ms=8_000))
                notes.await_note(WAIT_CHANNEL, key, count)
            assert not any(w.done() for w in waiting)  # still waiting: the original holds the key
            hold.release()
            original = first.result(30)
            answers = [w.result(30) for w in waiting]
        notes.await_note(DONE_CHANNEL, key)  # the original's daemon announced its end
    finally:
        notes.close()
    assert original.code is grpc.StatusCode.OK and not original.replayed, original
    for answer in answers:
        assert answer.code is grpc.StatusCode.OK, (answer, shard.logs())
        assert answer.replayed
        assert answer.response == original.response == stored_response(shard.dsn, key)
        assert _trailer(answer, WAIT_APPLIED_TRAILER) == "8000"
    _applied_once(shard, key)


def test_a_duplicate_waiting_for_an_original_killed_before_its_commit_runs_once_itself(shard: OneShard) -> None:
    """The original SIGKILLed at `shardd.claimed_before_commit` while a duplicate waits on the
    other daemon, which has one connection and one admission slot: other keys are served there
    meanwhile (the waiter holds neither between its brief looks: `_admitted`), and once the killed
    session's claim is gone the duplicate claims the key and applies the transfer once."""
    armed, other = shard.daemons
    armed.arm(CLAIMED)
    shard.start()
    _seed(other.address)  # the armed daemon would pause a Deposit too
    key, request = str(new_key()), transfer_request(SRC, DST, 300)
    notes = Notes(shard.dsn)
    try:
        first = call_in_background(armed.address, TRANSFER, request, key)
        paused = armed.wait_paused(CLAIMED)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(call, other.address, TRANSFER, request, key, 30.0, wait_ms=8_000)
            notes.await_note(WAIT_CHANNEL, key)
            for amount in (1, 2, 3):  # served by the waiter's daemon while it waits
                served = _admitted(other.address, deposit_request("acct-other", amount))
                assert served.code is grpc.StatusCode.OK, (served, shard.logs())
            assert not waiting.done()
            armed.kill_paused(paused)
            answer = waiting.result(30)
    finally:
        notes.close()
    assert first.result(10).code is grpc.StatusCode.UNAVAILABLE  # its caller never got an answer
    assert answer.code is grpc.StatusCode.OK, (answer, shard.logs())
    assert not answer.replayed  # applied by the waiting duplicate, for the first time
    assert answer.response == stored_response(shard.dsn, key)
    _applied_once(shard, key)
    armed.arm()


def test_without_the_preference_or_past_its_bound_the_duplicate_is_answered_in_flight(shard: OneShard) -> None:
    armed, other = shard.daemons
    armed.arm(CLAIMED)
    shard.start()
    _seed(other.address)
    key, request = str(new_key()), transfer_request(SRC, DST, 300)
    first = call_in_background(armed.address, TRANSFER, request, key)
    paused = armed.wait_paused(CLAIMED)

    plain = call(other.address, TRANSFER, request, key, 30.0)
    assert (plain.code, plain.reason) == (grpc.StatusCode.ABORTED, "IDEMPOTENCY_KEY_IN_FLIGHT")
    assert _trailer(plain, WAIT_APPLIED_TRAILER) is None

    started = time.monotonic()
    bounded = call(other.address, TRANSFER, request, key, 30.0, wait_ms=300)
    assert (bounded.code, bounded.reason) == (grpc.StatusCode.ABORTED, "IDEMPOTENCY_KEY_IN_FLIGHT"), bounded
    assert time.monotonic() - started >= 0.3  # it waited out its bound first
    assert _trailer(bounded, WAIT_APPLIED_TRAILER) == "300"

    # An ask over the daemon's maximum (10 s by default) is capped to it, and the deadline bounds it
    # further: answered in flight before the 1.5 s deadline, not DEADLINE_EXCEEDED.
    capped = call(other.address, TRANSFER, request, key, 1.5, wait_ms=10**30)
    assert (capped.code, capped.reason) == (grpc.StatusCode.ABORTED, "IDEMPOTENCY_KEY_IN_FLIGHT"), capped
    assert _trailer(capped, WAIT_APPLIED_TRAILER) == "10000"

    for bad in ("-5", "1.5", "soon"):
        refused = call(other.address, TRANSFER, request, key, 30.0, wait_ms=bad)
        assert (refused.code, refused.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"), refused

    armed.kill_paused(paused)
    first.result(10)
    assert entries(shard.dsn, key) == [] and stored_response(shard.dsn, key) is None
    armed.arm()


def _http(port: int, path: str, body: object, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def test_over_http_prefer_wait_returns_the_originals_answer_with_preference_applied(shard: OneShard) -> None:
    shard.start()
    _seed(shard.daemons[0].address)
    http_port = int(shard.router.env["ROUTER_HTTP_LISTEN"].rsplit(":", 1)[1])
    key, request = str(new_key()), transfer_request(SRC, DST, 300)
    body = {
        "sourceAccountId": SRC,
        "destinationAccountId": DST,
        "amount": {"amountMinor": "300", "currency": "EUR"},
    }
    bad = _http(http_port, "/v1/transfers", body, {"Idempotency-Key": key, "Prefer": "wait=soon"})
    assert bad[0] == 400 and b"Prefer" in bad[2], bad

    notes, hold = Notes(shard.dsn), RowHold(shard.dsn)
    try:
        first = call_in_background(shard.daemons[0].address, TRANSFER, request, key)
        wait_for("the original to claim and wait for the row", lambda: _original_blocked(shard.dsn), logs=shard.logs)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                _http, http_port, "/v1/transfers", body, {"Idempotency-Key": key, "Prefer": "respond-async, wait=5"}
            )
            notes.await_note(WAIT_CHANNEL, key)
            assert not waiting.done()
            hold.release()
            original = first.result(30)
            status, headers, answer = waiting.result(30)
    finally:
        notes.close()
    assert original.code is grpc.StatusCode.OK and original.response is not None
    assert status == 201, (status, answer, shard.logs())
    assert headers["idempotent-replayed"] == "true"
    assert headers["preference-applied"] == "wait=5"
    created = transfer_pb2.TransferResponse.FromString(original.response).transfer
    assert json.loads(answer)["transfer"]["transferId"] == created.transfer_id
    _applied_once(shard, key)


def test_a_waiter_ends_a_claim_stalled_on_its_daemon_and_runs_the_call_itself(
    postgres: LocalPostgres, tmp_path: Path
) -> None:
    """SHARDD_STALLED_CLAIM_MS: the original, on daemon 0, is paused at `claimed_before_commit`
    (its session waits on the daemon, its key and row held); a duplicate that asked to wait, on
    daemon 1, ends that session once it has waited past the setting, and runs the call itself, long
    before the original's deadline. Without the setting it would wait until its own bound."""
    shard = OneShard.build(postgres, tmp_path, extra_env={"SHARDD_STALLED_CLAIM_MS": "300"})
    stalled, waiter = shard.daemons
    stalled.arm(CLAIMED)
    try:
        shard.start()
        key, request = str(new_key()), deposit_request("acct-stalled", 40)
        original = call_in_background(stalled.address, DEPOSIT, request, key)
        paused = stalled.wait_paused(CLAIMED)
        started = time.monotonic()
        duplicate = call(waiter.address, DEPOSIT, request, key, 30.0, wait_ms=20_000)
        took = time.monotonic() - started
        assert duplicate.code is grpc.StatusCode.OK and not duplicate.replayed, duplicate
        assert took < 5.0, f"the duplicate waited {took:.1f} s for a stalled claim"
        assert not original.done()  # the original's daemon is still paused; its session is gone
        stalled.kill_paused(paused)
        assert entries(shard.dsn, key) == [("deposit", "acct-stalled", 40)]
        assert balances(shard.dsn, "acct-stalled") == [40]
        assert original.result(20).code is not grpc.StatusCode.OK  # its daemon died before answering
    finally:
        shard.stop()
