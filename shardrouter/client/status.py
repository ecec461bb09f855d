"""Reading a gRPC answer: rich `google.rpc` error details and the trailers shard-router sets.

The shard puts a `google.rpc.Status` in the `grpc-status-details-bin` trailer with `ErrorInfo`
(reason, domain "shardrouter.v1", metadata), `RetryInfo` (how long to wait) and `BadRequest` (which
fields are wrong); it mirrors the retry delay as `grpc-retry-pushback-ms`, and marks replays of a
completed key with `idempotency-replayed: true`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from shardrouter.core.errors import RETRY_PUSHBACK_TRAILER
from shardrouter.core.wire import DETAILS_TRAILER, MetadataEntry
from shardrouter.core.wire_names import REPLAYED_TRAILER, REPLAYED_VALUE

__all__ = [
    "DETAILS_TRAILER",
    "REPLAYED_TRAILER",
    "RETRY_PUSHBACK_TRAILER",
    "ErrorDetails",
    "RpcFailure",
    "error_details",
    "pushback_s",
    "trailer",
    "was_replayed",
]

Trailers = Iterable[MetadataEntry]


@dataclass(frozen=True, slots=True)
class ErrorDetails:
    """What a failed call's rich status says, decoded (all fields empty if it carried none)."""

    reason: str | None = None
    domain: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    retry_delay_s: float | None = None
    field_violations: tuple[tuple[str, str], ...] = ()


class RpcFailure(Exception):
    """A read-only call (GetBalance, GetTransfer) failed; carries the code and decoded details."""

    def __init__(self, code: grpc.StatusCode, message: str, details: ErrorDetails) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details = details


def error_details(trailers: Trailers | None) -> ErrorDetails:
    """Decode the `google.rpc.Status` trailer; tolerant of a missing or undecodable one."""
    raw = trailer(trailers, DETAILS_TRAILER)
    if not isinstance(raw, bytes):
        return ErrorDetails()
    try:
        status = status_pb2.Status.FromString(raw)
    except DecodeError:
        return ErrorDetails()
    reason: str | None = None
    domain: str | None = None
    metadata: dict[str, str] = {}
    retry_delay_s: float | None = None
    violations: list[tuple[str, str]] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay_s = retry.retry_delay.ToMilliseconds() / 1000
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
    return ErrorDetails(reason, domain, metadata, retry_delay_s, tuple(violations))


def trailer(trailers: Trailers | None, name: str) -> str | bytes | None:
    """The first value of trailer `name`, or None."""
    for key, value in trailers or ():
        if key == name:
            return value
    return None


def pushback_s(trailers: Trailers | None) -> float | None:
    """The `grpc-retry-pushback-ms` trailer in seconds, or None if absent or malformed."""
    value = trailer(trailers, RETRY_PUSHBACK_TRAILER)
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if value is None or not value.strip().isdigit():
        return None
    return int(value) / 1000


def was_replayed(trailers: Trailers | None) -> bool:
    """Whether the shard answered with a stored outcome (`idempotency-replayed: true`)."""
    value = trailer(trailers, REPLAYED_TRAILER)
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value is not None and value.lower() == REPLAYED_VALUE
