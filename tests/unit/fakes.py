"""In-memory stand-ins for the guarded call's unit tests: a key store and a servicer context.

`FakeKeys` keeps the key table's rules that the steps rely on and nothing else: a committed record is
found before any lock; a key another connection holds is in flight; a claimed key's handler writes
and its record commit together or not at all, and a stored refusal keeps its record but not its
writes. The real store is tested against PostgreSQL (tests/shardd).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import grpc

from shardrouter.shardd.idempotency.call import GuardedCall, KeyNotClaimed
from shardrouter.shardd.idempotency.record import Claim, ClaimStatus, IdempotencyRecord

ScopeKey = tuple[str, str]
CREATED_AT = datetime(2026, 1, 1, tzinfo=UTC)


class FakeTransaction:
    """One connection's handler transaction: what it would commit."""

    def __init__(self) -> None:
        self.records: dict[ScopeKey, IdempotencyRecord] = {}
        self.writes: list[str] = []
        self.completed = False


class FakeKeys:
    """The `KeyStore` the steps talk to, in memory."""

    def __init__(self, *, ahead: bool = False) -> None:
        #: Whether claims travel with the handler (`claiming_transaction`) or go first (`claim`).
        self.ahead = ahead
        self.committed: dict[ScopeKey, IdempotencyRecord] = {}
        #: Keys held by another connection (a twin in flight elsewhere), or by a claim here.
        self.held: set[ScopeKey] = set()
        #: The handlers' committed writes (a stand-in for ledger rows).
        self.writes: list[str] = []
        #: Connections checked out (each guarded call that reached the store takes one).
        self.transactions = 0
        self.commits = 0

    @contextmanager
    def connection(self) -> Iterator[FakeTransaction]:
        self.transactions += 1
        yield FakeTransaction()

    def claim(self, conn: FakeTransaction, call: GuardedCall) -> Claim:
        scoped = (call.scope, call.key.text)
        existing = self.committed.get(scoped)
        if existing is not None:
            return Claim(ClaimStatus.EXISTING, existing)
        if scoped in self.held:
            return Claim(ClaimStatus.IN_FLIGHT)
        self.held.add(scoped)
        return Claim(ClaimStatus.CLAIMED, created_at=CREATED_AT)

    @contextmanager
    def handler_transaction(self, conn: FakeTransaction, call: GuardedCall) -> Iterator[FakeTransaction]:
        scoped = (call.scope, call.key.text)
        try:
            yield conn  # an exception propagates: nothing is committed
            assert conn.completed, "the handler's transaction ended without its record"
            self.committed.update(conn.records)
            self.writes += conn.writes
            self.commits += 1
        finally:
            self.held.discard(scoped)

    def claims_ahead(self, call: GuardedCall) -> bool:
        return self.ahead

    @contextmanager
    def claiming_transaction(
        self, conn: FakeTransaction, call: GuardedCall
    ) -> Iterator[Callable[[IdempotencyRecord], IdempotencyRecord]]:
        claim = self.claim(conn, call)
        if claim.status is ClaimStatus.CLAIMED:
            with self.handler_transaction(conn, call):
                yield _as_committed
            return
        # The handler runs, but the database skips all it sends: nothing of it is kept.
        with contextlib.suppress(Exception):
            yield _as_committed
        raise KeyNotClaimed(claim)

    def complete(self, conn: FakeTransaction, call: GuardedCall, record: IdempotencyRecord) -> IdempotencyRecord:
        scoped = (call.scope, call.key.text)
        assert scoped in self.held, "completing a key this connection did not claim"
        assert record.outcome is not None
        if record.outcome.code != 0:
            conn.writes.clear()  # a stored refusal keeps its record, not its handler's writes
        conn.records[scoped] = record
        conn.completed = True
        return record


class Aborted(Exception):
    """What `FakeContext.abort_with_status` raises (grpc raises a bare Exception)."""


class FakeContext:
    """The parts of `grpc.ServicerContext` a guarded call uses."""

    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self._metadata = metadata
        self._trailers: tuple[tuple[str, str | bytes], ...] = ()
        self.status: grpc.Status | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, Any]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def time_remaining(self) -> float | None:
        return None

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailers

    def set_trailing_metadata(self, trailers: tuple[tuple[str, str | bytes], ...]) -> None:
        self._trailers = tuple(trailers)

    def abort_with_status(self, status: grpc.Status) -> None:
        self.status = status
        raise Aborted(status.code)


def _as_committed(record: IdempotencyRecord) -> IdempotencyRecord:
    """No handler here builds its answer in the database: the record is committed as completed."""
    return record
