"""The durable record of one business operation: its arguments, its idempotency key, its attempts.

An `Operation` is created once, with the intent, and its key never changes afterwards: every attempt,
every retry after a crash, every `resume` sends the same key, so the shard applies the effect at most
once. Records are immutable values; the store hands back a new one after each recorded attempt.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from shardrouter.client.kinds import KINDS, Argument, OperationKind
from shardrouter.core.keys import new_key

__all__ = [
    "Argument",
    "Attempt",
    "Operation",
    "OperationKind",
    "OperationState",
    "Outcome",
    "utc_now",
]


class OperationState(enum.StrEnum):
    """Where an operation stands, from the caller's point of view."""

    #: Not known to be applied or refused yet: (re)send it with the same key.
    PENDING = "pending"
    #: The shard answered OK (first time or as a replay).
    SUCCEEDED = "succeeded"
    #: The shard gave a final refusal (insufficient funds, invalid request, ...); nothing was applied.
    FAILED = "failed"
    #: The shard can no longer tell whether it applied the key (IDEMPOTENCY_KEY_EXPIRED): look the
    #: effect up (GetTransfer, GetBalance) before deciding; never re-send with a new key blindly.
    NEEDS_RECONCILIATION = "needs_reconciliation"

    @property
    def is_final(self) -> bool:
        """Whether sending again is pointless (everything but PENDING)."""
        return self is not OperationState.PENDING


def utc_now() -> datetime:
    """The current time, timezone-aware UTC (all timestamps of this package are)."""
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One network attempt: when it started, how long it took, and what came back."""

    started_at: datetime
    code: str  # gRPC status code name: "OK", "UNAVAILABLE", ...
    message: str = ""
    replayed: bool = False
    duration_ms: int = 0
    reason: str | None = None  # ErrorInfo.reason, if the answer carried one

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "started_at": self.started_at.isoformat(),
            "code": self.code,
            "message": self.message,
            "replayed": self.replayed,
            "duration_ms": self.duration_ms,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Attempt:
        """Inverse of `to_dict`."""
        return cls(
            started_at=datetime.fromisoformat(data["started_at"]),
            code=str(data["code"]),
            message=str(data.get("message", "")),
            replayed=bool(data.get("replayed", False)),
            duration_ms=int(data.get("duration_ms", 0)),
            reason=data.get("reason"),
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """The last answer recorded for an operation: status, rich error details, response bytes."""

    code: str
    message: str = ""
    reason: str | None = None
    domain: str | None = None
    error_metadata: Mapping[str, str] = field(default_factory=dict)
    field_violations: tuple[tuple[str, str], ...] = ()
    response_b64: str | None = None  # the serialized response message, base64, exactly as received
    replayed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "code": self.code,
            "message": self.message,
            "reason": self.reason,
            "domain": self.domain,
            "error_metadata": dict(self.error_metadata),
            "field_violations": [list(v) for v in self.field_violations],
            "response_b64": self.response_b64,
            "replayed": self.replayed,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Outcome:
        """Inverse of `to_dict`."""
        return cls(
            code=str(data["code"]),
            message=str(data.get("message", "")),
            reason=data.get("reason"),
            domain=data.get("domain"),
            error_metadata={str(k): str(v) for k, v in (data.get("error_metadata") or {}).items()},
            field_violations=tuple((str(f), str(d)) for f, d in data.get("field_violations") or ()),
            response_b64=data.get("response_b64"),
            replayed=bool(data.get("replayed", False)),
        )


@dataclass(frozen=True, slots=True)
class Operation:
    """One business operation (a transfer, a deposit, ...: a keyed RPC) and everything known about it.

    `kind` is one of `shardrouter.client.kinds.KINDS`. `arguments` holds the request's fields by
    argument name (`shardrouter.client.kinds`), for a transfer: source, destination, amount_minor,
    currency, reference; for a deposit: account, amount_minor, currency, reference. It is read-only,
    and so is the whole record.
    """

    id: str
    kind: OperationKind
    arguments: Mapping[str, Argument]
    idempotency_key: str
    state: OperationState = OperationState.PENDING
    caller_id: str | None = None
    attempts: tuple[Attempt, ...] = ()
    outcome: Outcome | None = None
    created_at: datetime = field(default_factory=utc_now)
    updated_at: datetime = field(default_factory=utc_now)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown operation kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        object.__setattr__(self, "arguments", MappingProxyType(dict(self.arguments)))
        object.__setattr__(self, "state", OperationState(self.state))

    @classmethod
    def new(
        cls, kind: OperationKind, arguments: Mapping[str, Argument], *, caller_id: str | None = None
    ) -> Operation:
        """A fresh pending operation with a new id and a new UUIDv7 idempotency key (made here, once)."""
        now = utc_now()
        return cls(
            id=str(new_key()),
            kind=kind,
            arguments=arguments,
            idempotency_key=str(new_key()),
            caller_id=caller_id,
            created_at=now,
            updated_at=now,
        )

    def with_attempt(self, attempt: Attempt, state: OperationState, outcome: Outcome) -> Operation:
        """This operation after `attempt`. A final state is never turned back into PENDING."""
        if self.state.is_final and not state.is_final:
            return replace(self, attempts=(*self.attempts, attempt), updated_at=utc_now())
        return replace(
            self, attempts=(*self.attempts, attempt), state=state, outcome=outcome, updated_at=utc_now()
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what `--json` prints and what stores may persist)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "arguments": dict(self.arguments),
            "idempotency_key": self.idempotency_key,
            "state": self.state.value,
            "caller_id": self.caller_id,
            "attempts": [a.to_dict() for a in self.attempts],
            "outcome": self.outcome.to_dict() if self.outcome else None,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Operation:
        """Inverse of `to_dict`."""
        kind = data["kind"]
        if kind not in KINDS:
            raise ValueError(f"unknown operation kind {kind!r}")
        return cls(
            id=str(data["id"]),
            kind=kind,
            arguments=dict(data["arguments"]),
            idempotency_key=str(data["idempotency_key"]),
            state=OperationState(data["state"]),
            caller_id=data.get("caller_id"),
            attempts=tuple(Attempt.from_dict(a) for a in data.get("attempts") or ()),
            outcome=Outcome.from_dict(data["outcome"]) if data.get("outcome") else None,
            created_at=datetime.fromisoformat(data["created_at"]),
            updated_at=datetime.fromisoformat(data["updated_at"]),
        )
