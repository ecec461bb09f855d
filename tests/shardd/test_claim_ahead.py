"""A claim sent with the handler's first statements: exactly once as when it goes first.

The claim of a UUIDv7 key travels in the handler's pipeline (`store.ClaimAhead`); when it finds the
key taken, the database skips everything the handler sends. Real daemons (gRPC on loopback) over a
real PostgreSQL, with the placement forced to `ahead` and no memory of completed keys, so every
duplicate meets the claim in the database; and psycopg's statement cache across the stopped
pipelines this makes (`db.PipelineSafePrepares`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import psycopg
import pytest

from shardrouter.shardd.db import Database, PipelineSafePrepares, current_transaction
from shardrouter.shardd.idempotency import IdempotencyConfig
from shardrouter.shardd.idempotency.placement import AHEAD_BELOW_DUPLICATE_SHARE, ClaimPlacement
from shardrouter.shardd.idempotency.process_keys import CompletedKeys
from shardrouter.shardd.ledger.service import ShardLocator, TransferServicer
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import guarded_deposits, key_metadata, make_settings, money

Daemon = Callable[..., ShardDaemon]


@pytest.fixture
def shard(database: str) -> Iterator[Daemon]:
    started: list[ShardDaemon] = []

    def start(**overrides: object) -> ShardDaemon:
        values: dict[str, object] = {"replay_cache_entries": 0, "claim_placement": "ahead", **overrides}
        daemon = start_shard(make_settings(database, **values))
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop(0.5)


def _stub(daemon: ShardDaemon) -> Iterator[transfer_pb2_grpc.TransferServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        yield transfer_pb2_grpc.TransferServiceStub(channel)


def _ledger(db: psycopg.Connection[tuple[object, ...]], account: str) -> tuple[object, ...]:
    row = db.execute(
        "SELECT (SELECT balance FROM accounts WHERE id = %s),"
        " (SELECT count(*) FROM ledger_entries WHERE account_id = %s),"
        " (SELECT count(*) FROM idempotency_record)",
        (account, account),
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_a_duplicate_replays_and_nothing_of_its_handler_is_applied(shard, db) -> None:
    """Every resend of a completed Deposit is its stored answer, and the balance, the ledger and
    the key table stay as the first call left them, though each resend started the handler."""
    for stub in _stub(shard()):
        md = key_metadata()
        request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
        first = stub.Deposit(request, metadata=md)
        after_first = _ledger(db, "alice")
        for _ in range(12):
            reply, call = stub.Deposit.with_call(request, metadata=md)
            assert reply == first
            assert dict(call.trailing_metadata())["idempotency-replayed"] == "true"
        assert _ledger(db, "alice") == after_first == (5, 1, 1)
        # The check can fail: a new key moves every figure.
        stub.Deposit(request, metadata=key_metadata())
        assert _ledger(db, "alice") == (10, 2, 2)


def test_a_key_held_elsewhere_is_in_flight_and_applies_once_let_go(shard, db) -> None:
    """A key whose claim another session holds (its advisory lock) is answered ABORTED with
    nothing applied; once that session lets it go, the same call applies, once."""
    for stub in _stub(shard()):
        key = key_metadata()
        request = transfer_pb2.DepositRequest(account_id="bob", amount=money(7))
        stub.Deposit(request, metadata=key_metadata())  # a record, for the scope's spelling
        scope = db.execute("SELECT scope FROM idempotency_record").fetchone()
        assert scope is not None
        lock = "hashtextextended(%s || ' ' || %s, 0)"
        with psycopg.connect(db.info.dsn, autocommit=True) as holder:
            holder.execute(f"SELECT pg_advisory_lock({lock})", (scope[0], key[0][1]))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Deposit(request, metadata=key)
            assert refused.value.code() is grpc.StatusCode.ABORTED
            assert _ledger(db, "bob") == (7, 1, 1)
            # Let go here: a closed connection's backend releases its locks once it has exited,
            # which may come after the next call's claim.
            holder.execute(f"SELECT pg_advisory_unlock({lock})", (scope[0], key[0][1]))
        stub.Deposit(request, metadata=key)
        stub.Deposit(request, metadata=key)
        assert _ledger(db, "bob") == (14, 2, 2)


class _ForgivingServicer(TransferServicer):
    """A Deposit that swallows every database error of its statement and answers anyway: the
    worst a handler can do to a claim that stopped its pipeline."""

    def Deposit(
        self, request: transfer_pb2.DepositRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.DepositResponse:
        conn = current_transaction().conn
        try:
            conn.execute("UPDATE accounts SET balance = balance + 1000 WHERE id = %s", (request.account_id,))
            conn.execute("SELECT 1").fetchone()
        except psycopg.Error:
            pass
        return super().Deposit(request, context)


def test_a_handler_that_swallows_the_stopped_pipeline_applies_nothing(database, db) -> None:
    """The claim, not the handler, decides: a handler that ignores the failure of its statements
    and goes on still has all of it skipped, and the duplicate gets the stored answer."""
    with guarded_deposits(
        database,
        lambda pool: _ForgivingServicer(pool, ShardLocator("shard-0", None)),
        config=IdempotencyConfig(claim_placement="ahead"),
        completed=CompletedKeys(max_entries=0, max_bytes=0),
    ) as stub:
        md = key_metadata()
        request = transfer_pb2.DepositRequest(account_id="carol", amount=money(3))
        first = stub.Deposit(request, metadata=md)
        after_first = _ledger(db, "carol")
        for _ in range(3):
            assert stub.Deposit(request, metadata=md) == first
        assert _ledger(db, "carol") == after_first


@pytest.mark.parametrize("control", ["transaction", "commit", "rollback"])
@pytest.mark.parametrize("placement", ["ahead", "first"])
def test_a_handler_that_controls_the_transaction_itself_is_refused_and_applies_nothing(
    database, db, placement: str, control: str
) -> None:
    """psycopg cannot see the call's open transaction in the middle of its pipeline: a handler's
    `conn.transaction()` would send its own BEGIN and COMMIT and commit the handler's writes before
    the record, its `commit()` would do nothing, its `rollback()` would drop the writes and let the
    record be stored alone. Each is refused instead (INTERNAL), and the call applies nothing."""
    with guarded_deposits(
        database,
        lambda pool: _SelfCommittingServicer(pool, ShardLocator("shard-0", None), control),
        config=IdempotencyConfig(claim_placement=placement),
        completed=CompletedKeys(max_entries=0, max_bytes=0),
    ) as stub:
        before = _ledger(db, "dave")
        request = transfer_pb2.DepositRequest(account_id="dave", amount=money(4))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Deposit(request, metadata=key_metadata())
        assert refused.value.code() is grpc.StatusCode.INTERNAL, refused.value
        assert _ledger(db, "dave") == before


class _SelfCommittingServicer(TransferServicer):
    """A Deposit that controls its transaction itself: wraps its statement in `conn.transaction()`,
    or calls `conn.commit()` / `conn.rollback()` after it."""

    def __init__(self, db: Database, locator: ShardLocator, control: str) -> None:
        super().__init__(db, locator)
        self._control = control

    def Deposit(
        self, request: transfer_pb2.DepositRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.DepositResponse:
        conn = current_transaction().conn
        if self._control == "transaction":
            with conn.transaction():
                return super().Deposit(request, context)
        response = super().Deposit(request, context)
        getattr(conn, self._control)()
        return response


def test_parallel_attempts_with_one_key_apply_once(shard, db) -> None:
    """Sixteen attempts of one Deposit at once, claims in the handler's pipeline: one applies,
    every other one replays it or is told it is in flight."""
    for stub in _stub(shard(workers=32)):
        request = transfer_pb2.DepositRequest(account_id="dave", amount=money(11))
        for _ in range(5):
            seen = _at_once(stub, request, key_metadata(), 16)
            assert set(seen) <= {"applied", "replayed", "ABORTED"} and seen["applied"] == 1, seen
        assert _ledger(db, "dave") == (55, 5, 5)


def _at_once(
    stub: transfer_pb2_grpc.TransferServiceStub,
    request: transfer_pb2.DepositRequest,
    md: list[tuple[str, str]],
    attempts: int,
) -> Counter[str]:
    """`attempts` sends of one call released together: how each was answered."""
    start = threading.Barrier(attempts)

    def attempt(_: int) -> str:
        start.wait()
        try:
            _, call = stub.Deposit.with_call(request, metadata=md, timeout=10)
        except grpc.RpcError as err:
            return err.code().name
        return "replayed" if dict(call.trailing_metadata()).get("idempotency-replayed") else "applied"

    with futures.ThreadPoolExecutor(attempts) as pool:
        return Counter(pool.map(attempt, range(attempts)))


# --- psycopg's statement cache across stopped pipelines -------------------------------------------


def _stop_a_pipeline_before(conn: psycopg.Connection[object], query: str) -> None:
    """Send a failing statement, then `query`, in one pipeline: the server skips `query`."""
    with pytest.raises(psycopg.Error), conn.pipeline():
        conn.execute("SELECT 1/0")
        conn.execute(query)


def _ready_to_prepare(conn: psycopg.Connection[object], query: str) -> None:
    """Run `query` as often as psycopg counts before it prepares it on the next run."""
    assert conn.prepare_threshold is not None
    for _ in range(conn.prepare_threshold):
        conn.execute(query)


QUERY = "SELECT count(*) FROM pg_class WHERE relname <> 'claim-ahead-test'"


def test_psycopg_alone_keeps_a_statement_the_server_never_prepared(database) -> None:
    """Why `PipelineSafePrepares` exists: with psycopg's own cache, a statement that reaches its
    threshold in a stopped pipeline is then run by a name the server does not know. If this starts
    to pass, psycopg has fixed it and the subclass can go."""
    with psycopg.connect(database, autocommit=True) as conn:
        _ready_to_prepare(conn, QUERY)
        _stop_a_pipeline_before(conn, QUERY)
        with pytest.raises(psycopg.errors.InvalidSqlStatementName):
            conn.execute(QUERY)


def test_a_statement_first_prepared_in_a_stopped_pipeline_runs_again(database) -> None:
    db = Database(database, min_size=1, max_size=1)
    db.open()
    try:
        with db.connection() as conn:
            assert isinstance(conn._prepared, PipelineSafePrepares)
            _ready_to_prepare(conn, QUERY)
            _stop_a_pipeline_before(conn, QUERY)
            assert conn.prepare_threshold is not None
            for _ in range(conn.prepare_threshold + 1):  # counted again from none, then prepared
                conn.execute(QUERY).fetchone()
            names = conn.execute(
                "SELECT count(*) FROM pg_prepared_statements WHERE statement = %s", (QUERY,)
            ).fetchone()
            assert names == (1,)
    finally:
        db.close()


def test_a_statement_that_fails_when_first_prepared_keeps_one_name(database) -> None:
    """A statement prepared at a run that fails (its Parse succeeded) is kept under that name, not
    prepared again under a new one at each failure: the server holds one of it, however often it
    fails (as the claim's check does for every duplicate)."""
    failing = "SELECT CASE WHEN %s THEN 1 ELSE ('refused: ' || %s)::int END"
    db = Database(database, min_size=1, max_size=1)
    db.open()
    try:
        with db.connection() as conn:
            for round_ in range(40):
                ok = round_ % 3 == 0
                with conn.pipeline():
                    if ok:
                        conn.execute(failing, (True, "x"))
                    else:
                        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
                            conn.execute(failing, (False, "x")).fetchone()
            held = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            assert held is not None and held[0] <= 3, held
    finally:
        db.close()


# --- where the claim goes --------------------------------------------------------------------------


def test_the_placement_follows_the_share_of_duplicates() -> None:
    placement = ClaimPlacement()
    assert placement.ahead()
    for _ in range(20):
        placement.note(duplicate=True)
    assert placement.duplicate_share > AHEAD_BELOW_DUPLICATE_SHARE and not placement.ahead()
    for _ in range(80):
        placement.note(duplicate=False)
    assert placement.ahead()
    assert not ClaimPlacement("first").ahead() and ClaimPlacement("ahead").ahead()
    with pytest.raises(ValueError, match="claim placement"):
        ClaimPlacement("sometimes")
