"""The one table from our gRPC answers to HTTP: status, headers and an RFC 9457 problem+json body.

The HTTP front calls the same router and shard as gRPC callers do, and answers a failed call with the
HTTP status this table gives, `Retry-After` where waiting helps, and an `application/problem+json`
body carrying the same machine-readable `reason` as the gRPC `ErrorInfo`, so HTTP and gRPC callers
branch on one vocabulary (`shardrouter.core.errors.Reason`).

Every `Reason` has its own row: the gRPC code it is raised with and the HTTP status it becomes. A
reason's row is used only together with that code (a reason with another code, or none, falls back to
the row of the code: `ShardRouterError` defaults its reason to INTERNAL whatever its code). The choices
that the IETF Idempotency-Key draft and the design leave open:

* `IDEMPOTENCY_KEY_IN_FLIGHT` (ABORTED) is **409** + `Retry-After`, and 409 means only that: "the same
  request is still running, send it again, same key, after Retry-After". A generic client can then
  follow the draft's rule on 409 without ever repeating a refusal that will not change.
* `IDEMPOTENCY_KEY_REUSED` is **422** (the draft).
* `IDEMPOTENCY_KEY_EXPIRED` is **422** with its own `type` and reason, not 410 Gone: 410 says the
  *target resource* (`/v1/transfers`) is gone for good, which a generic client or cache would apply to
  the URL, while here only the key is too old. Like key reuse, the request is well-formed and cannot be
  processed under this key; the answer is to reconcile (look the operation up), not to retry.
* Business refusals of the account's state (`INSUFFICIENT_FUNDS`, `ACCOUNT_CLOSED`,
  `CURRENCY_MISMATCH`, `BALANCE_LIMIT_EXCEEDED`; FAILED_PRECONDITION) are **422**, not 409: they are
  stored and replayed, so sending them again never helps, and 409 is kept for the retryable in-flight
  conflict above.
* Missing or malformed key, `IDEMPOTENCY_KEY_FROM_FUTURE` and every INVALID_ARGUMENT are **400**.
* NOT_FOUND is 404; UNAUTHENTICATED 401; PERMISSION_DENIED 403; UNIMPLEMENTED 501 (the front only
  routes declared methods, so an unknown path is its router's 404 and never reaches this table).
* RESOURCE_EXHAUSTED is 429 and UNAVAILABLE 503 (a shed shard, a database down, a slot range moving),
  both with `Retry-After`; DEADLINE_EXCEEDED 504; INTERNAL, UNKNOWN and DATA_LOSS 500.

Every problem's `type` follows one scheme: `tag:shardrouter.v1,2026:problem:` (`PROBLEM_TYPE_PREFIX`, a
`tag:` URI, RFC 4151: an identifier, never fetched) followed by its `reason` in kebab case, for the
reasons of the gRPC ErrorInfo and the refusals only HTTP has (`request-timeout`, `no-such-route`, ...)
alike; `about:blank` (RFC 9457 section 4.2.1: nothing beyond the status) only for an answer that
carries no reason this table knows with its code.

`Retry-After` is the `RetryInfo` delay in whole seconds rounded up (at least 1); the body's
`retry_after_ms` keeps the exact delay. Answers that are retryable by nature (409 in flight, 429, 503)
always carry both, one second when the status had no `RetryInfo`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from shardrouter.core.errors import FieldViolation, Reason, ShardRouterError, to_status_proto
from shardrouter.core.wire import DETAILS_TRAILER, MetadataEntry
from shardrouter.core.wire_names import RETRY_AFTER_HEADER

__all__ = [
    "CODE_ROWS",
    "DEFAULT_RETRY_AFTER_MS",
    "HTTP_ONLY_CODES",
    "PROBLEM_CONTENT_TYPE",
    "PROBLEM_TYPE_PREFIX",
    "REASON_ROWS",
    "HttpProblem",
    "ProblemRow",
    "http_only_problem",
    "http_status_for",
    "problem_for",
    "problem_from_error",
    "problem_from_status",
    "problem_from_trailers",
    "problem_type",
    "reason_type",
    "retry_after_seconds",
]

PROBLEM_CONTENT_TYPE = "application/problem+json"
#: Problem `type` URIs: a `tag:` URI (RFC 4151), an identifier that is not fetched, per reason.
PROBLEM_TYPE_PREFIX = "tag:shardrouter.v1,2026:problem:"
DEFAULT_RETRY_AFTER_MS = 1000


#: The gRPC code `router_requests_total` counts each refusal under that exists only in HTTP (no row of
#: `problems` says one), by the problem's reason: gRPC's own answer to the same fault.
HTTP_ONLY_CODES: Mapping[str, grpc.StatusCode] = MappingProxyType(
    {
        "UNSUPPORTED_MEDIA_TYPE": grpc.StatusCode.INVALID_ARGUMENT,  # 415: a request it cannot read
        "REQUEST_TOO_LARGE": grpc.StatusCode.RESOURCE_EXHAUSTED,  # 413: gRPC's message over its limit
        "HEADERS_TOO_LARGE": grpc.StatusCode.RESOURCE_EXHAUSTED,  # 431: gRPC's metadata over its limit
        "REQUEST_TIMEOUT": grpc.StatusCode.DEADLINE_EXCEEDED,  # 408: the body did not arrive in time
        "NO_SUCH_ROUTE": grpc.StatusCode.UNIMPLEMENTED,  # 404: gRPC's answer to an unknown method
        "METHOD_NOT_ALLOWED": grpc.StatusCode.UNIMPLEMENTED,  # 405: no RPC is this verb on this path
    }
)


@dataclass(frozen=True, slots=True)
class ProblemRow:
    """One row of the table: which gRPC code it matches, its HTTP status and problem title."""

    code: grpc.StatusCode
    http_status: int
    title: str
    #: Whether the answer invites the same request again later: then Retry-After is always sent.
    retryable: bool = False


_S = grpc.StatusCode

#: Every `Reason`, with the gRPC code it is raised with. A test keeps this complete.
REASON_ROWS: Mapping[str, ProblemRow] = MappingProxyType(
    {
        Reason.IDEMPOTENCY_KEY_MISSING: ProblemRow(
            _S.INVALID_ARGUMENT, 400, "Idempotency-Key header missing"
        ),
        Reason.IDEMPOTENCY_KEY_INVALID: ProblemRow(_S.INVALID_ARGUMENT, 400, "Idempotency-Key malformed"),
        Reason.IDEMPOTENCY_KEY_FROM_FUTURE: ProblemRow(
            _S.INVALID_ARGUMENT, 400, "Idempotency-Key dated in the future"
        ),
        Reason.IDEMPOTENCY_KEY_REUSED: ProblemRow(
            _S.FAILED_PRECONDITION, 422, "Idempotency-Key reused with a different request"
        ),
        Reason.IDEMPOTENCY_KEY_EXPIRED: ProblemRow(_S.FAILED_PRECONDITION, 422, "Idempotency-Key expired"),
        Reason.IDEMPOTENCY_KEY_IN_FLIGHT: ProblemRow(
            _S.ABORTED, 409, "A request with this Idempotency-Key is in progress", retryable=True
        ),
        Reason.INVALID_REQUEST: ProblemRow(_S.INVALID_ARGUMENT, 400, "Invalid request"),
        Reason.INVALID_CALLER: ProblemRow(_S.INVALID_ARGUMENT, 400, "Invalid caller identity"),
        Reason.INSUFFICIENT_FUNDS: ProblemRow(_S.FAILED_PRECONDITION, 422, "Insufficient funds"),
        Reason.ACCOUNT_NOT_FOUND: ProblemRow(_S.NOT_FOUND, 404, "Account not found"),
        Reason.ACCOUNT_CLOSED: ProblemRow(_S.FAILED_PRECONDITION, 422, "Account closed"),
        Reason.CURRENCY_MISMATCH: ProblemRow(_S.FAILED_PRECONDITION, 422, "Currency mismatch"),
        Reason.BALANCE_LIMIT_EXCEEDED: ProblemRow(_S.FAILED_PRECONDITION, 422, "Balance limit exceeded"),
        Reason.TRANSFER_NOT_FOUND: ProblemRow(_S.NOT_FOUND, 404, "Transfer not found"),
        Reason.DATABASE_UNAVAILABLE: ProblemRow(_S.UNAVAILABLE, 503, "Database unavailable", retryable=True),
        Reason.DATABASE_BUSY: ProblemRow(_S.UNAVAILABLE, 503, "Database busy", retryable=True),
        Reason.DEADLINE_EXCEEDED: ProblemRow(_S.DEADLINE_EXCEEDED, 504, "Deadline exceeded"),
        Reason.SHARD_UNAVAILABLE: ProblemRow(_S.UNAVAILABLE, 503, "Shard unavailable", retryable=True),
        Reason.ACCOUNT_MOVED: ProblemRow(
            _S.UNAVAILABLE, 503, "Account moved to another shard", retryable=True
        ),
        Reason.SLOT_RANGE_MOVING: ProblemRow(
            _S.UNAVAILABLE, 503, "Account is moving between shards", retryable=True
        ),
        Reason.RATE_LIMITED: ProblemRow(_S.RESOURCE_EXHAUSTED, 429, "Too many requests", retryable=True),
        Reason.SHARD_SATURATED: ProblemRow(_S.UNAVAILABLE, 503, "Shard saturated", retryable=True),
        Reason.UNAUTHENTICATED: ProblemRow(_S.UNAUTHENTICATED, 401, "Unauthenticated"),
        Reason.PERMISSION_DENIED: ProblemRow(_S.PERMISSION_DENIED, 403, "Permission denied"),
        # Internal API only (VoidCredit, CreditTransfer): the HTTP front never serves them, but every
        # reason has a row.
        Reason.CREDIT_ALREADY_APPLIED: ProblemRow(_S.ABORTED, 409, "Credit already applied", retryable=True),
        Reason.CREDIT_VOIDED: ProblemRow(_S.FAILED_PRECONDITION, 422, "Credit voided"),
        Reason.INTERNAL: ProblemRow(_S.INTERNAL, 500, "Internal error"),
    }
)

#: Every gRPC code, for answers whose reason is absent, unknown, or raised with another code.
CODE_ROWS: Mapping[grpc.StatusCode, ProblemRow] = MappingProxyType(
    {
        row.code: row
        for row in (
            ProblemRow(_S.OK, 200, "OK"),
            ProblemRow(_S.CANCELLED, 499, "Request cancelled"),
            ProblemRow(_S.UNKNOWN, 500, "Internal Server Error"),
            ProblemRow(_S.INVALID_ARGUMENT, 400, "Bad Request"),
            ProblemRow(_S.DEADLINE_EXCEEDED, 504, "Gateway Timeout"),
            ProblemRow(_S.NOT_FOUND, 404, "Not Found"),
            ProblemRow(_S.ALREADY_EXISTS, 409, "Conflict"),
            ProblemRow(_S.PERMISSION_DENIED, 403, "Forbidden"),
            ProblemRow(_S.RESOURCE_EXHAUSTED, 429, "Too Many Requests", retryable=True),
            ProblemRow(_S.FAILED_PRECONDITION, 422, "Unprocessable Content"),
            ProblemRow(_S.ABORTED, 409, "Conflict", retryable=True),
            ProblemRow(_S.OUT_OF_RANGE, 400, "Bad Request"),
            ProblemRow(_S.UNIMPLEMENTED, 501, "Not Implemented"),
            ProblemRow(_S.INTERNAL, 500, "Internal Server Error"),
            ProblemRow(_S.UNAVAILABLE, 503, "Service Unavailable", retryable=True),
            ProblemRow(_S.DATA_LOSS, 500, "Internal Server Error"),
            ProblemRow(_S.UNAUTHENTICATED, 401, "Unauthorized"),
        )
    }
)

_CODES_BY_INT: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class HttpProblem:
    """An HTTP error answer: status, extra headers (Retry-After) and the problem+json body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: dict[str, Any]  # the problem+json object; JSON-ready, do not mutate

    @property
    def content_type(self) -> str:
        """`application/problem+json`."""
        return PROBLEM_CONTENT_TYPE

    def body_bytes(self) -> bytes:
        """The body as compact UTF-8 JSON with a stable key order."""
        return json.dumps(self.body, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode()


def _code(code: grpc.StatusCode | int) -> grpc.StatusCode:
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODES_BY_INT.get(code, grpc.StatusCode.UNKNOWN)


def _row(code: grpc.StatusCode, reason: str | None) -> ProblemRow:
    row = REASON_ROWS.get(reason or "")
    if row is not None and row.code == code:
        return row
    return CODE_ROWS[code]


def http_status_for(code: grpc.StatusCode | int, reason: str | None = None) -> int:
    """The HTTP status for a gRPC code and `ErrorInfo.reason` (see the module's table)."""
    return _row(_code(code), reason).http_status


def problem_type(code: grpc.StatusCode | int, reason: str | None) -> str:
    """The problem `type` URI: one per known reason, else `about:blank` (RFC 9457 section 4.2.1)."""
    row = REASON_ROWS.get(reason or "")
    if reason and row is not None and row.code == _code(code):
        return reason_type(reason)
    return "about:blank"


def reason_type(reason: str) -> str:
    """The problem `type` URI of one of our reasons: the prefix and the reason in kebab case."""
    return PROBLEM_TYPE_PREFIX + reason.lower().replace("_", "-")


def http_only_problem(status: int, title: str, detail: str, reason: str) -> HttpProblem:
    """A refusal that exists only in HTTP (no gRPC status says it: 408, 413, 415, 431, 404 and 405 of
    an unknown route): its reason's `type`, in the same scheme as every reason of the table."""
    body = {
        "type": reason_type(reason),
        "title": title,
        "status": status,
        "detail": detail,
        "reason": reason,
    }
    return HttpProblem(status, (), body)


def retry_after_seconds(retry_after_ms: int) -> int:
    """Retry-After's whole seconds for a delay in milliseconds: rounded up, at least 1."""
    return max(1, math.ceil(retry_after_ms / 1000))


def problem_for(
    code: grpc.StatusCode | int,
    message: str,
    *,
    reason: str | None = None,
    retry_after_ms: int | None = None,
    field_violations: Iterable[FieldViolation | tuple[str, str]] = (),
) -> HttpProblem:
    """The HTTP answer for a failed call given its decoded parts (code, message, ErrorInfo reason, ...)."""
    grpc_code = _code(code)
    row = _row(grpc_code, reason)
    if retry_after_ms is None and row.retryable:
        retry_after_ms = DEFAULT_RETRY_AFTER_MS
    body: dict[str, Any] = {
        "type": problem_type(grpc_code, reason),
        "title": row.title,
        "status": row.http_status,
        "detail": message,
    }
    if reason:
        body["reason"] = reason
    headers: list[tuple[str, str]] = []
    if retry_after_ms is not None:
        retry_after_ms = max(0, retry_after_ms)
        body["retry_after_ms"] = retry_after_ms
        headers.append((RETRY_AFTER_HEADER, str(retry_after_seconds(retry_after_ms))))
    violations = [
        {"field": v.field, "description": v.description}
        if isinstance(v, FieldViolation)
        else {"field": v[0], "description": v[1]}
        for v in field_violations
    ]
    if violations:
        body["field_violations"] = violations
    return HttpProblem(row.http_status, tuple(headers), body)


def problem_from_status(
    code: grpc.StatusCode | int, message: str, status: status_pb2.Status | bytes | None
) -> HttpProblem:
    """The HTTP answer for a failed call from its `google.rpc.Status` (or its serialised bytes).

    Reads `ErrorInfo` (reason), `RetryInfo` (delay) and `BadRequest` (field violations); an absent
    or undecodable status leaves only the code and message.
    """
    decoded: status_pb2.Status | None = None
    if isinstance(status, bytes):
        try:
            decoded = status_pb2.Status.FromString(status)
        except DecodeError:
            decoded = None
    else:
        decoded = status
    reason: str | None = None
    retry_after_ms: int | None = None
    violations: list[tuple[str, str]] = []
    for detail in decoded.details if decoded is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason or None
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after_ms = retry.retry_delay.ToMilliseconds()
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
    return problem_for(
        code, message, reason=reason, retry_after_ms=retry_after_ms, field_violations=violations
    )


def problem_from_trailers(
    code: grpc.StatusCode | int, message: str, trailers: Sequence[MetadataEntry] | None
) -> HttpProblem:
    """The HTTP answer for a failed call from its trailers (the `grpc-status-details-bin` entry)."""
    raw = next((value for key, value in trailers or () if key == DETAILS_TRAILER), None)
    return problem_from_status(code, message, raw if isinstance(raw, bytes) else None)


def problem_from_error(error: ShardRouterError) -> HttpProblem:
    """The HTTP answer for one of our errors raised in the front itself (a missing key, a bad body)."""
    return problem_from_status(error.code, error.message, to_status_proto(error))
