"""What one guarded call carries from step to step, and the shapes of the steps and of the key store.

The interceptor's steps (`steps.py`) are chained once per guarded method; per call they pass along
one frozen `GuardedCall` (built by the first two steps from the key and the request) and nothing else
but what a step opened for the ones below it: the key's flight in this process, the transaction's
connection. Each step either answers or hands the call to the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message
from opentelemetry import trace

from shardrouter.core.keys import IdempotencyKey
from shardrouter.shardd.idempotency.outcomes import OutcomeKind
from shardrouter.shardd.idempotency.process_keys import KeyFlight, ScopedKey
from shardrouter.shardd.idempotency.record import (
    Claim,
    ClaimStatus,
    IdempotencyRecord,
    StoredOutcome,
    Trailer,
)


@dataclass(frozen=True)
class MutatingMethod:
    """A method the interceptor guards, with its request validator (state-free checks only)."""

    full_name: str  # "/package.Service/Method"
    validate: Callable[[Any], None]
    #: Keys are unique per (scope name, caller). Methods that must fence each other share one name.
    scope_name: str = ""
    #: The request field naming the account the call is routed by; its records move with that
    #: account's slot when the slot moves to another shard ("": routed by something else).
    routing_field: str = ""

    @property
    def scope_prefix(self) -> str:
        """The scope name, defaulting to the full method name."""
        return self.scope_name or self.full_name


@dataclass(frozen=True, slots=True)
class KeyRead:
    """The call's idempotency key, read and checked (format, age, clock skew)."""

    key: IdempotencyKey
    #: The key's canonical text: what the key table stores, and logs, spans and memory know.
    text: str
    #: The date of a record this call makes (its partition): a UUIDv7's own time, else this receipt's
    #: (a record a first receipt made carries that receipt's time).
    time: datetime
    #: When a record this call makes leaves the retention window.
    expires_at: datetime
    #: `idempotency-expires-at`: every answer to a call with a readable key carries it.
    expiry_trailer: Trailer

    @property
    def dated_by_key(self) -> bool:
        """Whether the key dates itself (a UUIDv7); else its record is dated by its first receipt."""
        return self.key.dated_at is not None


@dataclass(frozen=True, slots=True)
class GuardedCall:
    """A validated call of a guarded method: the input every step after decoding is given."""

    context: grpc.ServicerContext
    #: The call's `idempotency` span (the invalid span when tracing is off).
    span: trace.Span
    #: `scope name|caller`: keys are unique per scope.
    scope: str
    key: KeyRead
    request: Message
    #: SHA-256 of the method name and the request's deterministic serialisation.
    request_hash: bytes
    #: The account the call is routed by, if its method names one.
    account_id: str | None
    #: How long (ms) the call may wait for its key's original in flight, as granted (0: not at all).
    wait_ms: int = 0

    @property
    def scoped_key(self) -> ScopedKey:
        """(scope, key text): how this process's memory knows the key."""
        return (self.scope, self.key.text)


#: How a call is answered: the outcome (stored, or to be stored), its kind, and the date of the
#: key's record (`key_time`: differs from the call's own for a replay of a key dated by receipt).
Answered = tuple[StoredOutcome, OutcomeKind, datetime]
#: The key's completed record, and whether this call made it (claimed the key and ran the handler).
Settled = tuple[IdempotencyRecord, bool]


class CallStep(Protocol):
    """A step given the validated call (answer_from_memory)."""

    def __call__(self, call: GuardedCall) -> Answered:
        """Answer the call, or hand it on."""
        ...


class FlightStep(Protocol):
    """A step of the call that leads the key's flight in this process (admit, claim_or_replay)."""

    def __call__(self, call: GuardedCall, flight: KeyFlight) -> Settled:
        """The key's completed record, from the database or made by this call."""
        ...


class StoreStep(Protocol):
    """The step in the handler's transaction on a claimed key (store_outcome)."""

    def __call__(self, call: GuardedCall, conn: Any, claimed: IdempotencyRecord) -> IdempotencyRecord:
        """The key's completed record (`claimed` with the handler's outcome), stored."""
        ...


class TransactionStep(Protocol):
    """The step that runs the handler in that transaction (run_handler)."""

    def __call__(self, call: GuardedCall, conn: Any) -> StoredOutcome:
        """The outcome of the handler, to store."""
        ...


class KeyNotClaimed(Exception):
    """A claim sent ahead of the handler found the key taken (`KeyStore.claiming_transaction`):
    nothing the handler sent was applied, and `claim` says what was found instead."""

    def __init__(self, claim: Claim) -> None:
        assert claim.status is not ClaimStatus.CLAIMED
        super().__init__(claim.status.value)
        self.claim = claim


class AnswerNotNoted(Exception):
    """A handler that builds its answer in the database noted none: its statement wrote nothing,
    the COMMIT sent with it stored no record, and the key is still held by the claim (`claim`), for
    the handler to run again with its answer fetched (where it says why it wrote nothing)."""

    def __init__(self, claim: Claim) -> None:
        assert claim.status is ClaimStatus.CLAIMED and claim.created_at is not None
        super().__init__("no answer noted")
        self.claim = claim


class KeyStore(Protocol):
    """What the steps need of the key table: `steps.DatabaseKeys` over PostgreSQL (a fake in unit tests).

    A claim is a read outside any transaction; a CLAIMED key is held (by `conn`) until the handler's
    transaction ends: `complete` commits the handler's writes with the completed record, or, for a
    stored refusal, rolls them back and stores the record alone; an exception out of `handler_transaction`
    rolls everything back and lets the key go.
    """

    def connection(self) -> AbstractContextManager[Any]:
        """The call's database connection; transient failures raised as ours."""
        ...

    def claim(self, conn: Any, call: GuardedCall) -> Claim:
        """Claim the call's key, or find its committed record, or find it in flight elsewhere."""
        ...

    def handler_transaction(self, conn: Any, call: GuardedCall) -> AbstractContextManager[Any]:
        """The handler's transaction on a claimed key; it ends when `complete` was called in it."""
        ...

    def claims_ahead(self, call: GuardedCall) -> bool:
        """Whether the call's claim can travel with the handler's first statements
        (`claiming_transaction`) instead of going first on its own (`claim`)."""
        ...

    def claiming_transaction(
        self, conn: Any, call: GuardedCall
    ) -> AbstractContextManager[Callable[[IdempotencyRecord], IdempotencyRecord]]:
        """The claim and the handler's transaction at once: as `handler_transaction` when the claim
        takes the key; when it finds the key taken, nothing the handler sent is applied and
        `KeyNotClaimed` is raised, carrying what the claim found (EXISTING or IN_FLIGHT). A handler
        may build its answer in the database there (`shardd.answer_sql`): it yields what gives the
        record as committed, once the transaction has ended, with the answer read back; a handler
        that noted none raises `AnswerNotNoted` at the end, the key still held."""
        ...

    def complete(self, conn: Any, call: GuardedCall, record: IdempotencyRecord) -> IdempotencyRecord:
        """Store the completed record of the key this connection claimed (the handler's writes kept
        for a success, undone for a stored refusal) and commit; the record as stored (its
        `created_at` is the claim's)."""
        ...


__all__ = [
    "AnswerNotNoted",
    "Answered",
    "CallStep",
    "FlightStep",
    "GuardedCall",
    "KeyNotClaimed",
    "KeyRead",
    "KeyStore",
    "MutatingMethod",
    "Settled",
    "StoreStep",
    "TransactionStep",
]
