"""The one error tree of shard-router, each type mapped to exactly one gRPC status.

Servicers and the interceptor raise these; `to_grpc_status` turns one into the status, message and rich
`google.rpc` details (ErrorInfo, RetryInfo, BadRequest) that go on the wire. Nothing else calls abort
with a hand-made code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from shardrouter.core.wire import MetadataEntry, StatusAnswer

ERROR_DOMAIN = "shardrouter.v1"
RETRY_PUSHBACK_TRAILER = "grpc-retry-pushback-ms"


class Reason:
    """`ErrorInfo.reason` values: stable, machine-readable, documented in the README."""

    IDEMPOTENCY_KEY_MISSING = "IDEMPOTENCY_KEY_MISSING"
    IDEMPOTENCY_KEY_INVALID = "IDEMPOTENCY_KEY_INVALID"
    IDEMPOTENCY_KEY_REUSED = "IDEMPOTENCY_KEY_REUSED"
    IDEMPOTENCY_KEY_EXPIRED = "IDEMPOTENCY_KEY_EXPIRED"
    IDEMPOTENCY_KEY_FROM_FUTURE = "IDEMPOTENCY_KEY_FROM_FUTURE"
    IDEMPOTENCY_KEY_IN_FLIGHT = "IDEMPOTENCY_KEY_IN_FLIGHT"
    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_CALLER = "INVALID_CALLER"
    INSUFFICIENT_FUNDS = "INSUFFICIENT_FUNDS"
    ACCOUNT_NOT_FOUND = "ACCOUNT_NOT_FOUND"
    ACCOUNT_CLOSED = "ACCOUNT_CLOSED"
    CURRENCY_MISMATCH = "CURRENCY_MISMATCH"
    BALANCE_LIMIT_EXCEEDED = "BALANCE_LIMIT_EXCEEDED"
    TRANSFER_NOT_FOUND = "TRANSFER_NOT_FOUND"
    DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
    DATABASE_BUSY = "DATABASE_BUSY"  # the pool's connections all taken, or a lock/serialisation conflict
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the caller's deadline ran out while the database worked
    SHARD_UNAVAILABLE = "SHARD_UNAVAILABLE"
    # Another shard owns the account in the daemon's shard map (re-read just before refusing); nothing
    # was applied. ErrorInfo metadata: owner_shard_id, and map_version (the version of that map).
    ACCOUNT_MOVED = "ACCOUNT_MOVED"
    SLOT_RANGE_MOVING = "SLOT_RANGE_MOVING"  # the account's slot is fenced: it is moving to another shard
    RATE_LIMITED = "RATE_LIMITED"
    SHARD_SATURATED = "SHARD_SATURATED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    # The shard's authorization policy does not let this caller call this method on this account;
    # nothing was applied or stored. ErrorInfo metadata: caller, method, account (when the call has one).
    PERMISSION_DENIED = "PERMISSION_DENIED"
    # Internal API: a VoidCredit found the transfer's credit already applied on this shard (under
    # another caller's key scope); nothing was stored, and the relay's next delivery learns it landed.
    CREDIT_ALREADY_APPLIED = "CREDIT_ALREADY_APPLIED"
    # Internal API: a CreditTransfer of a transfer whose credit was voided on this shard (by a relay
    # that gave up on it, under any caller's key); stored, and the source refunds the transfer.
    CREDIT_VOIDED = "CREDIT_VOIDED"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request, for `google.rpc.BadRequest`."""

    field: str
    description: str


class ShardRouterError(Exception):
    """Base of every error that becomes a gRPC status. Subclasses fix the status code."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    #: Whether the idempotency layer stores this error as the operation's outcome (replayed on retry).
    is_stored_outcome: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        reason: str = Reason.INTERNAL,
        metadata: dict[str, str] | None = None,
        retry_after_ms: int | None = None,
        field_violations: Sequence[FieldViolation] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.retry_after_ms = retry_after_ms
        self.field_violations = tuple(field_violations)


class InvalidArgument(ShardRouterError):
    """The request itself is wrong; answered before any claim and never stored."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ShardRouterError):
    """A named thing does not exist (an unknown account, transfer)."""

    code = grpc.StatusCode.NOT_FOUND
    is_stored_outcome = True


class FailedPrecondition(ShardRouterError):
    """The system's state refuses the request (insufficient funds, key reused or expired)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    is_stored_outcome = True


class Aborted(ShardRouterError):
    """Retry shortly: the same key is in flight. Always carries RetryInfo."""

    code = grpc.StatusCode.ABORTED


class Unavailable(ShardRouterError):
    """A transient failure (database or shard down); nothing was applied; retry with the same key."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ShardRouterError):
    """The caller's deadline ran out before the work committed; nothing was applied."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhausted(ShardRouterError):
    """The caller sends more than it is allowed to; retry after the RetryInfo delay."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(ShardRouterError):
    """No verified caller identity where one is required."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ShardRouterError):
    """A verified caller the authorization policy does not allow to make this call; never stored."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Internal(ShardRouterError):
    """A bug or an unexpected state; nothing was applied."""

    code = grpc.StatusCode.INTERNAL


def to_status_proto(error: ShardRouterError) -> status_pb2.Status:
    """The `google.rpc.Status` for an error: code, message and rich details."""
    status = status_pb2.Status(code=_RPC_CODES[error.code], message=error.message)
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    status.details.add().Pack(info)
    if error.retry_after_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    if error.field_violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in error.field_violations
            ]
        )
        status.details.add().Pack(bad)
    return status


def to_grpc_status(
    error: ShardRouterError, extra_trailers: Sequence[MetadataEntry] = ()
) -> grpc.Status:
    """A `grpc.Status` ready for `context.abort_with_status`, with RetryInfo mirrored as pushback."""
    status = rpc_status.to_status(to_status_proto(error))
    trailers = list(status.trailing_metadata)
    if error.retry_after_ms is not None:
        trailers.append((RETRY_PUSHBACK_TRAILER, str(error.retry_after_ms)))
    return StatusAnswer(status.code, status.details, tuple(trailers) + tuple(extra_trailers))


def status_code_from_int(value: int) -> grpc.StatusCode:
    """The `grpc.StatusCode` for its numeric value."""
    return _CODES_BY_INT[value]


_CODES_BY_INT: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}
_RPC_CODES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: code_pb2.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: code_pb2.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: code_pb2.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED: code_pb2.ABORTED,
    grpc.StatusCode.UNAVAILABLE: code_pb2.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: code_pb2.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: code_pb2.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED: code_pb2.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: code_pb2.PERMISSION_DENIED,
    grpc.StatusCode.INTERNAL: code_pb2.INTERNAL,
}


__all__ = [
    "ERROR_DOMAIN",
    "RETRY_PUSHBACK_TRAILER",
    "Aborted",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Reason",
    "ResourceExhausted",
    "ShardRouterError",
    "Unauthenticated",
    "Unavailable",
    "status_code_from_int",
    "to_grpc_status",
    "to_status_proto",
]
