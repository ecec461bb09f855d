"""Every name of ours on the wire, declared once: the gRPC metadata entries and trailers, the HTTP
headers, the span attributes several layers set or search by, and the outcome kinds of a guarded call.

The shard daemon writes these names, the router forwards them and its HTTP front translates them, the
caller library and the local cluster's demo read them: a name spelled in two places drifts apart in
one. `tests/architecture/test_wire_names.py` fails when one of them (in any letter case) is written as
a string literal anywhere else in the package. Standard names are not ours and stay where they are
used (gRPC's own trailers, W3C trace context, an HTTP header one module uses), except the two
standard HTTP headers both the front and its OpenAPI document name.
"""

from __future__ import annotations

import enum

# --- gRPC metadata (request) ------------------------------------------------------------------------

#: The caller's idempotency key for one business operation, the same on every retry (`core.keys`).
KEY_METADATA = "idempotency-key"
#: The caller a trusted proxy (the router, a shard's relay) speaks for (`core.callers`).
CALLER_METADATA = "x-caller-id"
#: How long (ms, a non-negative integer) a duplicate may wait for its key's original in flight to
#: end, and then return its stored outcome, instead of being answered in flight at once (opt-in).
WAIT_METADATA = "idempotency-wait-ms"

# --- gRPC trailers (answer of a guarded call) -------------------------------------------------------

#: `REPLAYED_VALUE` when the answer is a completed key's stored outcome, replayed verbatim.
REPLAYED_TRAILER = "idempotency-replayed"
#: On a refusal the shard answered before storing anything: its `OutcomeKind` value.
OUTCOME_TRAILER = "idempotency-outcome"
#: When the key's record expires (ISO 8601 UTC, milliseconds): on every answer to a readable key.
EXPIRES_AT_TRAILER = "idempotency-expires-at"
#: On every answer to a call that asked to wait (`WAIT_METADATA`): the wait granted (ms), its ask
#: capped at the shard's maximum (the call's deadline bounds it further).
WAIT_APPLIED_TRAILER = "idempotency-wait-applied-ms"
#: What the replay markers (`REPLAYED_TRAILER`, `REPLAYED_HEADER`) carry when the answer is a replay.
REPLAYED_VALUE = "true"

# --- HTTP headers of the router's HTTP/JSON front ---------------------------------------------------

#: Request: the idempotency key (IETF Idempotency-Key draft), forwarded as `KEY_METADATA`.
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
#: Request: the caller, believed in dev mode only, forwarded as `CALLER_METADATA`.
CALLER_HEADER = "X-Caller-Id"
#: Response: `REPLAYED_VALUE` when the answer is the stored answer of an earlier request with the key.
REPLAYED_HEADER = "Idempotent-Replayed"
#: Response (standard, RFC 9110): seconds to wait before sending the same request again.
RETRY_AFTER_HEADER = "Retry-After"
#: Response (standard, RFC 9110): the path of the resource a keyed call created.
LOCATION_HEADER = "Location"

# --- span attributes set or searched by more than one layer -----------------------------------------

#: The idempotency key of a call: on the SERVER, idempotency and caller library spans alike.
KEY_ATTRIBUTE = "idempotency.key"
#: How a guarded call was answered (an `OutcomeKind` value): on the shard's and the HTTP front's spans.
OUTCOME_ATTRIBUTE = "idempotency.outcome"


class OutcomeKind(enum.StrEnum):
    """How a guarded call was answered: one vocabulary for the call's span attribute
    (`OUTCOME_ATTRIBUTE`), the `OUTCOME_TRAILER` value, the `outcome` label of `shardd_requests_total`,
    the call log and the HTTP front's span."""

    NEW = "new"  # the key was claimed here and the handler ran (its result is stored)
    REPLAY = "replay"  # the key's stored outcome, returned verbatim
    IN_FLIGHT = "in_flight"  # another attempt with the key has not committed yet: retry (ABORTED)
    KEY_REUSED = "key_reused"  # the key was used for a different request (FAILED_PRECONDITION)
    EXPIRED = "expired"  # the key is older than the retention window
    INVALID = "invalid"  # bad key or request, refused before any claim
    SHED = "shed"  # refused by admission (the shard is saturated)
    ERROR = "error"  # a transient or internal failure; nothing was applied


#: The gRPC metadata keys and trailers above (lower case, as gRPC requires).
GRPC_NAMES = (
    KEY_METADATA,
    CALLER_METADATA,
    WAIT_METADATA,
    REPLAYED_TRAILER,
    OUTCOME_TRAILER,
    EXPIRES_AT_TRAILER,
    WAIT_APPLIED_TRAILER,
)
#: The HTTP headers above (HTTP compares header names in any letter case).
HTTP_HEADERS = (IDEMPOTENCY_KEY_HEADER, CALLER_HEADER, REPLAYED_HEADER, RETRY_AFTER_HEADER, LOCATION_HEADER)
#: The span attributes above.
SPAN_ATTRIBUTES = (KEY_ATTRIBUTE, OUTCOME_ATTRIBUTE)
#: Every name this module declares, which no other module of the package spells as a literal.
DECLARED_NAMES = (*GRPC_NAMES, *HTTP_HEADERS, *SPAN_ATTRIBUTES)

__all__ = [
    "CALLER_HEADER",
    "CALLER_METADATA",
    "DECLARED_NAMES",
    "EXPIRES_AT_TRAILER",
    "GRPC_NAMES",
    "HTTP_HEADERS",
    "IDEMPOTENCY_KEY_HEADER",
    "KEY_ATTRIBUTE",
    "KEY_METADATA",
    "LOCATION_HEADER",
    "OUTCOME_ATTRIBUTE",
    "OUTCOME_TRAILER",
    "REPLAYED_HEADER",
    "REPLAYED_TRAILER",
    "REPLAYED_VALUE",
    "RETRY_AFTER_HEADER",
    "SPAN_ATTRIBUTES",
    "WAIT_APPLIED_TRAILER",
    "WAIT_METADATA",
    "OutcomeKind",
]
