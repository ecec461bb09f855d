"""In-memory stand-ins for the guarded call's unit tests: a key store and a servicer context.

`FakeKeys` keeps the key table's rules that the steps rely on and nothing else: a transaction
commits its claims, outcomes and handler writes together or not at all; a savepoint undoes the
handler's writes; a committed record is found before any lock; a key another transaction holds is
in flight. The real store is tested against PostgreSQL (tests/shardd).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import grpc

from shardrouter.shardd.idempotency.call import GuardedCall
from shardrouter.shardd.idempotency.record import (
    Claim,
    ClaimStatus,
    IdempotencyRecord,
    RecordState,
    StoredOutcome,
)

ScopeKey = tuple[str, str]
CREATED_AT = datetime(2026, 1, 1, tzinfo=UTC)


class FakeTransaction:
    """One open transaction: what it would commit."""

    def __init__(self) -> None:
        self.records: dict[ScopeKey, IdempotencyRecord] = {}
        self.writes: list[str] = []


class FakeKeys:
    """The `KeyStore` the steps talk to, in memory."""

    def __init__(self) -> None:
        self.committed: dict[ScopeKey, IdempotencyRecord] = {}
        #: Keys held by another, uncommitted transaction (a twin in flight elsewhere).
        self.held: set[ScopeKey] = set()
        #: The handlers' committed writes (a stand-in for ledger rows).
        self.writes: list[str] = []
        self.transactions = 0
        self.commits = 0

    @contextmanager
    def transaction(self) -> Iterator[FakeTransaction]:
        self.transactions += 1
        tx = FakeTransaction()
        yield tx  # an exception propagates: nothing is committed
        self.committed.update(tx.records)
        self.writes += tx.writes
        self.commits += 1

    def claim(
        self,
        conn: FakeTransaction,
        call: GuardedCall,
        *,
        method: str,
        statement_timeout_ms: int | None,
        traceparent: str | None,
    ) -> Claim:
        scoped = (call.scope, call.key.text)
        existing = self.committed.get(scoped)
        if existing is not None:
            return Claim(ClaimStatus.EXISTING, existing)
        if scoped in self.held:
            return Claim(ClaimStatus.IN_FLIGHT)
        conn.records[scoped] = IdempotencyRecord(
            scope=call.scope,
            key=call.key.text,
            key_time=call.key.time,
            method=method,
            request_hash=call.request_hash,
            state=RecordState.IN_FLIGHT,
            outcome=None,
            created_at=CREATED_AT,
            completed_at=None,
            first_traceparent=traceparent,
        )
        return Claim(ClaimStatus.CLAIMED, created_at=CREATED_AT)

    @contextmanager
    def savepoint(self, conn: FakeTransaction) -> Iterator[None]:
        mark = len(conn.writes)
        try:
            yield
        except BaseException:
            del conn.writes[mark:]
            raise

    def complete(self, conn: FakeTransaction, call: GuardedCall, outcome: StoredOutcome) -> None:
        scoped = (call.scope, call.key.text)
        record = conn.records[scoped]
        assert record.state is RecordState.IN_FLIGHT, "completing a key this transaction did not claim"
        conn.records[scoped] = dataclasses.replace(record, state=RecordState.COMPLETED, outcome=outcome)


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
