"""The checker's workload over the router's HTTP/JSON front instead of gRPC (`--http URL`): the same
requests, as JSON, posted to each RPC's declared route with the `Idempotency-Key` header.

An answer is recorded in the gRPC vocabulary the proofs read: 2xx is OK, and a problem's `reason` gives
its gRPC code through the front's own table (`router.http.problems`), so a refusal is definite or
not exactly as over gRPC. The response bytes recorded are the JSON body the front wrote, which it
renders deterministically from the stored answer: a replay is compared byte for byte there too.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

from google.protobuf import json_format

from shardrouter.core.rpcs import RPCS_BY_PATH
from shardrouter.core.wire_names import (
    CALLER_HEADER,
    IDEMPOTENCY_KEY_HEADER,
    REPLAYED_HEADER,
    REPLAYED_VALUE,
    RETRY_AFTER_HEADER,
)
from shardrouter.router.http.problems import REASON_ROWS

#: Statuses without a known reason, in the gRPC code the front gives them (others are indefinite).
_BY_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 422: "FAILED_PRECONDITION"}


@dataclass(frozen=True)
class CallerTls:
    """The checker's TLS towards the router: the CA that signed the router's certificate, and a
    client certificate and key for a router that verifies its callers (mTLS; "" for none)."""

    ca: str
    cert: str = ""
    key: str = ""

    def ssl_context(self) -> ssl.SSLContext:
        """The same, for the HTTPS front."""
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True)
class Exchange:
    """One request's answer, in the terms of a gRPC answer."""

    sent: bytes
    code: str
    reason: str
    message: str
    response: bytes
    replayed: bool
    #: Seconds the answer asks to wait before a resend (None: not said).
    wait_s: float | None
    #: The shard's idempotency-outcome trailer (gRPC only).
    outcome: str = ""


def json_request(method: str, proto_bytes: bytes) -> bytes:
    """The request as the front's JSON: proto field names, keys sorted, compact."""
    message = RPCS_BY_PATH[method].request_type.FromString(proto_bytes)
    as_dict = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return json.dumps(as_dict, sort_keys=True, separators=(",", ":")).encode()


def post(
    base_url: str,
    method: str,
    proto_bytes: bytes,
    key: str,
    caller: str,
    timeout_s: float,
    context: ssl.SSLContext | None = None,
) -> Exchange:
    """POST the request to its route and read the answer (a connection failure is UNAVAILABLE)."""
    route = RPCS_BY_PATH[method].http
    assert route is not None, f"{method} has no HTTP route"
    body = json_request(method, proto_bytes)
    headers = {IDEMPOTENCY_KEY_HEADER: key, "Content-Type": "application/json"}
    if caller:
        headers[CALLER_HEADER] = caller
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--http {base_url}: give an http:// or https:// URL")
    url = base_url.rstrip("/") + route.path
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310 (scheme checked above)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:  # noqa: S310 (scheme checked above)
            return Exchange(
                body, "OK", "", "", answer.read(), answer.headers.get(REPLAYED_HEADER) == REPLAYED_VALUE, None
            )
    except urllib.error.HTTPError as err:
        payload = err.read()
        replayed = err.headers.get(REPLAYED_HEADER) == REPLAYED_VALUE
        wait = err.headers.get(RETRY_AFTER_HEADER)
        return _problem(body, err.code, payload, replayed, float(wait) if wait and wait.isdigit() else None)
    except (OSError, TimeoutError) as exc:
        return Exchange(body, "UNAVAILABLE", "", str(exc), b"", False, None)


def _problem(sent: bytes, status: int, payload: bytes, replayed: bool, wait_s: float | None) -> Exchange:
    try:
        problem = json.loads(payload)
    except ValueError:
        problem = {}
    reason = str(problem.get("reason") or "") if isinstance(problem, dict) else ""
    detail = str(problem.get("detail") or "") if isinstance(problem, dict) else ""
    row = REASON_ROWS.get(reason)
    code = (
        row.code.name
        if row is not None and row.http_status == status
        else _BY_STATUS.get(status, f"HTTP_{status}")
    )
    return Exchange(sent, code, reason, detail, b"", replayed, wait_s)


__all__ = ["CallerTls", "Exchange", "json_request", "post"]
