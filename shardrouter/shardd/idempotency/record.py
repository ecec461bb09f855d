"""Frozen types passed between the interceptor and the store."""

from __future__ import annotations

import base64
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from shardrouter.core.wire import MetadataEntry as Trailer


@dataclass(frozen=True)
class StoredOutcome:
    """Everything a retry must get back: status, message, rich details, response bytes, trailers.

    `details` is the serialised `google.rpc.Status` of an error outcome (the `grpc-status-details-bin`
    trailer); `response` is the serialised response of a success. Trailers are those the handler set.
    """

    code: int
    message: str
    details: bytes | None
    response: bytes | None
    trailers: tuple[Trailer, ...]
    #: A success whose response the handler's statement built and noted in the database
    #: (`shardd.answer_sql`): `response` is None until the transaction has ended and the stored
    #: bytes are read back. Never true of a record stored, read or replayed.
    response_in_database: bool = False

    @property
    def is_ok(self) -> bool:
        """Whether the outcome is a success (status code OK)."""
        return self.code == 0

    def trailers_json(self) -> list[list[str]]:
        """Trailers as JSON: binary (`-bin`) values base64-encoded."""
        return [[k, base64.b64encode(v).decode() if isinstance(v, bytes) else v] for k, v in self.trailers]

    @staticmethod
    def trailers_from_json(raw: Sequence[Sequence[str]] | None) -> tuple[Trailer, ...]:
        """The inverse of `trailers_json`."""
        return tuple((k, base64.b64decode(v) if k.endswith("-bin") else v) for k, v in (raw or ()))


class RecordState(enum.StrEnum):
    """Lifecycle of a key's record. IN_FLIGHT is only ever seen inside the claiming transaction.

    The state is called "in flight" from the record to the error reason (IDEMPOTENCY_KEY_IN_FLIGHT)
    and the outcome kind; its stored value stays 'in_progress', the schema's word since its first
    version (renaming it would rewrite the CHECK of every partition for a value no other transaction
    ever reads).
    """

    IN_FLIGHT = "in_progress"
    COMPLETED = "completed"


@dataclass(frozen=True)
class IdempotencyRecord:
    """One stored key: who claimed it for what request, and the outcome once completed."""

    scope: str
    #: The key's canonical text.
    key: str
    key_time: datetime
    method: str
    request_hash: bytes
    state: RecordState
    outcome: StoredOutcome | None
    created_at: datetime
    completed_at: datetime | None
    #: W3C traceparent of the attempt that claimed the key (None when it was not traced).
    first_traceparent: str | None = None


class ClaimStatus(enum.Enum):
    """Result of trying to claim a key."""

    CLAIMED = "claimed"  # this transaction owns the key: run the handler
    EXISTING = "existing"  # a committed record exists: replay it or refuse a reuse
    IN_FLIGHT = "in_flight"  # another transaction holds the key and has not committed


@dataclass(frozen=True)
class Claim:
    """What `claim_key` found."""

    status: ClaimStatus
    existing: IdempotencyRecord | None = None
    #: When the claimed record was inserted (CLAIMED only): the `created_at` a replay reports.
    created_at: datetime | None = None


__all__ = [
    "Claim",
    "ClaimStatus",
    "IdempotencyRecord",
    "RecordState",
    "StoredOutcome",
    "Trailer",
]
