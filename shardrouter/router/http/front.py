"""The router's HTTP/JSON front: the same RPCs over plain HTTP, with the `Idempotency-Key` header.

There is no second implementation of the semantics. A request on a route that an RPC declares
(`google.api.http` in the proto, read through `shardrouter.core.rpcs`) becomes that RPC's request
message (`json_mapping`), goes through the router's own `Forwarder` (same routing, redirects,
retries, caller identity) to the shard daemon, whose idempotency interceptor claims, runs, stores
and replays exactly as for gRPC; the shard's answer becomes the HTTP answer:

* OK: the response message as deterministic JSON (the same stored response gives the same bytes),
  201 with `Location` for a keyed call (first apply and replay alike: a replay is the stored answer),
  200 for a read; `Idempotent-Replayed: true` when the shard replayed a stored outcome.
* not OK: `application/problem+json` from the status and its rich details (`problems`: 409 +
  Retry-After in flight, 422 key reused, 400 bad key or request, 429/503 + Retry-After, ...), with
  the same `reason` as the gRPC ErrorInfo; a replayed business refusal carries `Idempotent-Replayed`.
* `Prefer: wait=N` (RFC 7240, `prefer`) on a keyed call becomes `idempotency-wait-ms`: a duplicate
  of a request still in flight waits up to N s for its outcome instead of 409; the answer's
  `Preference-Applied: wait=M` says the shard honoured it, and for how long at most.

What HTTP adds is answered here, before anything is forwarded, and never stored: a wrong content type
(415), a body over the limit (413), a body that does not arrive in time (408), headers over the limit
(431), a malformed key header (400). Whoever calls is decided by the router's caller rule: a verified
client certificate when the router serves TLS with a caller CA (the same as for gRPC), the
`X-Caller-Id` header in dev mode only, so two callers never share a key scope through the front.

Every request on a declared route is counted once in the router's `router_requests_total` and
`router_request_duration_seconds`, with `protocol="http"`: by the `Forwarder` when it is forwarded
(as a gRPC call is), here when the front refuses it first, under the route's method, the refusal's
gRPC code (the row of `problems` for an error of ours, `HTTP_ONLY_CODES` for what only HTTP says) and
shard "none". An unknown route or verb counts as method "unknown" (never the path: the series stay
bounded), code UNIMPLEMENTED. A refusal's duration runs from the request's first byte (the
protocol's clock read, its only cost on the forwarding path). What the connection's protocol answers
before the app runs is counted too, as method "unknown" (`UNREAD_REFUSAL_CODES`): a request line or
headers it cannot parse (400), headers that do not arrive in time (408), 503 over
`http_max_connections`. A failed TLS handshake (no client certificate, an untrusted one, plain HTTP
on the TLS port) is counted in `router_tls_handshake_failures_total{protocol="http",reason}`; a
renewed certificate or caller CA bundle, a CA taken out included, holds for new connections without
a restart (`_CallerTls`).

The source document's compact `POST /transfers` (`{"src":8842,"dst":1190,"amount":2500}`) is the
Transfer RPC; without a currency it is read from the source account (GetBalance) before sending.

Served by uvicorn (httptools) on the router's own event loop, beside the `grpc.aio` server: no extra
process or channel hop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import grpc
import uvicorn
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shardrouter.core import tls, tracing
from shardrouter.core.callers import certificate_identity
from shardrouter.core.errors import NotFound, Reason, ShardRouterError
from shardrouter.core.rpcs import PUBLIC_SERVICE, RpcDeclaration, rpc
from shardrouter.core.wire import MetadataEntry
from shardrouter.core.wire_names import (
    CALLER_HEADER,
    CALLER_METADATA,
    EXPIRES_AT_TRAILER,
    IDEMPOTENCY_KEY_HEADER,
    KEY_METADATA,
    LOCATION_HEADER,
    OUTCOME_ATTRIBUTE,
    OUTCOME_TRAILER,
    REPLAYED_HEADER,
    REPLAYED_TRAILER,
    REPLAYED_VALUE,
    WAIT_APPLIED_TRAILER,
    WAIT_METADATA,
    OutcomeKind,
)
from shardrouter.router.forwarding import Forwarder, Outcome
from shardrouter.router.http.idempotency_header import IdempotencyKeyHeaderError, parse_idempotency_key
from shardrouter.router.http.json_mapping import (
    COMPACT_TRANSFER_ROUTE,
    CompactTransfer,
    JsonRequestError,
    compact_transfer_request,
    created_location,
    message_to_json_bytes,
    request_from_http,
)
from shardrouter.router.http.openapi import openapi_json, openapi_page
from shardrouter.router.http.prefer import (
    PREFER_HEADER,
    PREFERENCE_APPLIED_HEADER,
    PreferWaitError,
    parse_prefer_wait,
    preference_applied,
)
from shardrouter.router.http.problems import (
    HTTP_ONLY_CODES,
    PROBLEM_CONTENT_TYPE,
    REASON_ROWS,
    HttpProblem,
    http_only_problem,
    problem_from_error,
    problem_from_trailers,
)
from shardrouter.router.metrics import HTTP, NO_SHARD, UNKNOWN_METHOD, RouterMetrics
from shardrouter.router.routing import ROUTED_METHODS
from shardrouter.router.settings import RouterSettings
from shardrouter.v1 import transfer_pb2

log = logging.getLogger(__name__)

__all__ = [
    "HTTP_ONLY_CODES",
    "UNKNOWN_METHOD",
    "UNREAD_REFUSAL_CODES",
    "HttpCall",
    "HttpFront",
    "HttpServer",
    "start_http_server",
]

_JSON = "application/json"
#: The status noted (span, access log) for a request whose caller left before it was answered; never
#: sent, as nobody is left to read it (nginx's "client closed request").
_CLIENT_GONE = 499
_TRACE_HEADERS = ("traceparent", "tracestate")
_GET_BALANCE = rpc(PUBLIC_SERVICE, "GetBalance")
#: Accounts whose currency the front remembers (for compact transfers that name none).
_CURRENCIES_KEPT = 100_000
#: ASGI scope extension the protocol below fills: the verified client certificate's common name, URI
#: SANs and identity (`client_identity`: its SPIFFE ID, else its common name; what the router forwards
#: as `x-caller-id`), whether the request's headers went over the limit, and when the request's first
#: byte was read (`started`, `time.perf_counter()`).
_EXTENSION = "shardrouter.connection"
#: The gRPC code of each request the server refuses before the app reads it (method "unknown": the
#: route is not read), by what went wrong: gRPC's own answer to the same fault where it has one.
UNREAD_REFUSAL_CODES: Mapping[str, grpc.StatusCode] = MappingProxyType(
    {
        "UNPARSEABLE_REQUEST": grpc.StatusCode.INVALID_ARGUMENT,  # 400: not HTTP/1.1 it can parse
        "REQUEST_TIMEOUT": grpc.StatusCode.DEADLINE_EXCEEDED,  # 408: the headers did not arrive in time
        "OVER_CONNECTION_LIMIT": grpc.StatusCode.RESOURCE_EXHAUSTED,  # 503: gRPC's max_concurrent_rpcs
    }
)


@dataclass(frozen=True)
class HttpCall:
    """An HTTP request as the forwarder sees a call (`router.metadata.CallContext`)."""

    metadata: tuple[MetadataEntry, ...]
    deadline: float  # time.monotonic() by which the call must be answered
    #: The common name of the caller's verified client certificate (mTLS), if any.
    common_name: str | None = None
    #: The URI SANs of that certificate: its `spiffe://` one is the caller (`core.callers.peer_identity`).
    uris: tuple[str, ...] = ()

    def invocation_metadata(self) -> tuple[MetadataEntry, ...]:
        """The metadata the HTTP request carries (key, caller, trace context)."""
        return self.metadata

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        """The verified peer's certificate names, in gRPC's shape (`x509_common_name`, `peer_uri`), so
        that the caller is decided as for a gRPC call (`core.callers.peer_identity`)."""
        names: dict[str, Iterable[bytes]] = {}
        if self.common_name:
            names["x509_common_name"] = [self.common_name.encode()]
        if self.uris:
            names["peer_uri"] = [uri.encode() for uri in self.uris]
        return names

    def time_remaining(self) -> float:
        """Seconds left before the deadline."""
        return max(0.0, self.deadline - time.monotonic())


class _Refusal(Exception):
    """An HTTP-level refusal, answered as it is (never forwarded, never stored); counted as `code`."""

    def __init__(self, problem: HttpProblem, code: grpc.StatusCode) -> None:
        super().__init__(problem.body.get("detail", ""))
        self.problem = problem
        self.code = code


def _refusal_code(reason: str) -> grpc.StatusCode:
    """The gRPC code of a refusal the front answers itself: its reason's row, else `HTTP_ONLY_CODES`."""
    row = REASON_ROWS.get(reason)
    return row.code if row is not None else HTTP_ONLY_CODES[reason]


def _http_refusal(status: int, title: str, detail: str, reason: str) -> _Refusal:
    """A refusal of the front's own (408, 413, 415, 431, a repeated X-Caller-Id), with its code."""
    return _Refusal(http_only_problem(status, title, detail, reason), _refusal_code(reason))


def _problem_response(problem: HttpProblem, replayed: bool = False) -> Response:
    headers = dict(problem.headers)
    if replayed:
        headers[REPLAYED_HEADER] = REPLAYED_VALUE
    return Response(problem.body_bytes(), problem.status, headers, media_type=PROBLEM_CONTENT_TYPE)


@dataclass
class HttpFront:
    """The ASGI application: the declared routes, the compact transfer, the OpenAPI document and page."""

    forwarder: Forwarder
    settings: RouterSettings
    tracer_provider: trace.TracerProvider | None = None
    traced: bool = False
    #: The router's metrics (the forwarder's own): refusals before forwarding are counted here.
    metrics: RouterMetrics | None = None
    app: Starlette = field(init=False)
    #: Set when the router starts its graceful stop: /healthz answers 503 from then on.
    draining: bool = False

    def __post_init__(self) -> None:
        routes = [
            Route(d.http.path, self._endpoint(d), methods=[d.http.verb])
            for d in ROUTED_METHODS
            if d.http is not None
        ]
        routes += [
            Route(COMPACT_TRANSFER_ROUTE.path, self._compact_transfer, methods=[COMPACT_TRANSFER_ROUTE.verb]),
            Route("/openapi.json", self._openapi, methods=["GET"]),
            Route("/docs", self._docs, methods=["GET"]),
            Route("/healthz", self._health, methods=["GET"]),
        ]
        self._tracer = tracing.get_tracer(self.tracer_provider) if self.traced else None
        self._currencies: OrderedDict[str, str] = OrderedDict()
        self._currency_reads: dict[str, asyncio.Future[str]] = {}
        self._openapi_bytes = openapi_json()
        self.app = Starlette(
            routes=routes,
            exception_handlers={HTTPException: self._http_exception},  # type: ignore[dict-item]
        )

    # --- the routes -------------------------------------------------------------------------------

    def _endpoint(self, declaration: RpcDeclaration) -> Any:
        async def endpoint(request: Request) -> Response:
            async def message(call: HttpCall) -> Message:
                body = await self._body(request) if declaration.http and declaration.http.body else b""
                return request_from_http(
                    declaration, request.path_params, body, request.query_params.multi_items()
                )

            return await self._serve(request, declaration, message)

        return endpoint

    async def _compact_transfer(self, request: Request) -> Response:
        async def message(call: HttpCall) -> Message:
            compact = compact_transfer_request(await self._body(request))
            if compact.currency_from_accounts:
                compact.request.amount.currency = await self._currency_of(
                    compact.request.source_account_id, call
                )
            return compact.request

        return await self._serve(request, CompactTransfer.declaration, message)

    async def _serve(
        self,
        request: Request,
        declaration: RpcDeclaration,
        message: Callable[[HttpCall], Awaitable[Message]],
    ) -> Response:
        """One HTTP call of `declaration`: read it (`message` builds the request), forward it, answer.

        Every refusal before the shard answers (HTTP's own, a bad key header or body, the router's)
        becomes problem+json here, in one place for every route. A call is counted once: by the
        forwarder once it is forwarded, else here as refused (`_count_refusal`)."""
        with self._span(request, declaration) as span:
            try:
                call = self._call(request, keyed=declaration.keyed)
                built = await message(call)
            except _Refusal as refused:
                self._count_refusal(request, declaration.full_name, refused.code)
                return self._finish(span, _problem_response(refused.problem))
            except (JsonRequestError, IdempotencyKeyHeaderError, PreferWaitError) as error:
                refusal = error.to_error()
                self._count_refusal(request, declaration.full_name, refusal.code)
                return self._finish(span, _problem_response(problem_from_error(refusal)))
            except ShardRouterError as error:  # a compact transfer's currency read failed
                self._count_refusal(request, declaration.full_name, error.code)
                return self._finish(span, _problem_response(problem_from_error(error)))
            except ClientDisconnect:
                # The caller closed the connection mid-body: nobody is left to answer, and it is not
                # the router's fault, so no traceback (re-raised, uvicorn would log one at ERROR).
                self._count_refusal(request, declaration.full_name, grpc.StatusCode.CANCELLED)
                return self._finish(span, Response(status_code=_CLIENT_GONE))
            except BaseException as error:  # cancelled (or a bug): counted, then as before
                gone = isinstance(error, asyncio.CancelledError)
                code = grpc.StatusCode.CANCELLED if gone else grpc.StatusCode.INTERNAL
                self._count_refusal(request, declaration.full_name, code)
                raise
            try:  # counted by the forwarder, whatever happens
                outcome = await self.forwarder.forward(
                    declaration, built.SerializeToString(deterministic=True), call
                )
            except ShardRouterError as error:
                return self._finish(span, _problem_response(problem_from_error(error)))
            return self._finish(span, self._answer(declaration, outcome), outcome)

    def _count_refusal(self, request: Request, method: str, code: grpc.StatusCode) -> None:
        """Count a request the front answered without forwarding it: `method` (a declared RPC's path,
        or `UNKNOWN_METHOD`), `code`, shard "none", timed from the request's first byte."""
        if self.metrics is None:
            return
        connection = request.scope.get("extensions", {}).get(_EXTENSION, {})
        started = connection.get("started")
        seconds = time.perf_counter() - started if isinstance(started, float) else 0.0
        self.metrics.observe(method, code, seconds, shard=NO_SHARD, protocol=HTTP)

    async def _openapi(self, request: Request) -> Response:
        return Response(self._openapi_bytes, media_type=_JSON)

    async def _docs(self, request: Request) -> Response:
        return HTMLResponse(openapi_page())

    async def _health(self, request: Request) -> Response:
        if self.draining:
            return Response(b'{"status":"NOT_SERVING"}', 503, media_type=_JSON)
        return Response(b'{"status":"SERVING"}', media_type=_JSON)

    async def _http_exception(self, request: Request, error: HTTPException) -> Response:
        # Unknown paths (404) and verbs (405) answer problem+json like every other refusal.
        reason = "NO_SUCH_ROUTE" if error.status_code == 404 else "METHOD_NOT_ALLOWED"
        problem = http_only_problem(
            error.status_code,
            "Not Found" if error.status_code == 404 else "Method Not Allowed",
            f"{request.method} {request.url.path}: {error.detail}; see /openapi.json for the routes",
            reason,
        )
        # Counted under no RPC: a verb a declared path does not take names no RPC either.
        self._count_refusal(request, UNKNOWN_METHOD, HTTP_ONLY_CODES[reason])
        response = _problem_response(problem)
        if error.headers:
            response.headers.update(error.headers)
        return response

    # --- reading the request ----------------------------------------------------------------------

    def _call(self, request: Request, *, keyed: bool) -> HttpCall:
        """The call's metadata and deadline; refuses oversized headers and a bad key header."""
        connection = request.scope.get("extensions", {}).get(_EXTENSION, {})
        if connection.get("headers_too_large"):
            raise _http_refusal(
                431,
                "Request Header Fields Too Large",
                f"the request's headers exceed {self.settings.max_metadata_bytes} bytes",
                "HEADERS_TOO_LARGE",
            )
        metadata: list[MetadataEntry] = []
        if keyed:
            key = parse_idempotency_key(request.headers.getlist(IDEMPOTENCY_KEY_HEADER))  # any letter case
            metadata.append((KEY_METADATA, key))
            wait_s = parse_prefer_wait(request.headers.getlist(PREFER_HEADER))
            if wait_s:  # a duplicate may wait for its original in flight (0: answer 409 at once)
                metadata.append((WAIT_METADATA, str(wait_s * 1000)))
        callers = request.headers.getlist(CALLER_HEADER)
        if len(callers) == 1:
            metadata.append((CALLER_METADATA, callers[0]))
        elif callers:
            raise _http_refusal(
                400, "Bad Request", f"{CALLER_HEADER} is given more than once", Reason.INVALID_CALLER
            )
        if not self.traced:  # traced: the forwarding span carries the trace on
            metadata += [(h, v) for h in _TRACE_HEADERS for v in request.headers.getlist(h)[:1]]
        return HttpCall(
            tuple(metadata),
            time.monotonic() + self.settings.http_deadline_s,
            connection.get("client_common_name"),
            connection.get("client_uris", ()),
        )

    async def _body(self, request: Request) -> bytes:
        """The JSON body, within the size limit and the time limit."""
        content_type = request.headers.get("content-type", "")
        media_type, _, parameters = content_type.partition(";")
        charset = parameters.strip().lower()
        if media_type.strip().lower() != _JSON or charset not in ("", "charset=utf-8", 'charset="utf-8"'):
            raise _http_refusal(
                415,
                "Unsupported Media Type",
                f"the body must be {_JSON} (UTF-8); got {content_type or 'no Content-Type'}",
                "UNSUPPORTED_MEDIA_TYPE",
            )
        limit = self.settings.http_max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_large(limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.settings.http_body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise self._too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise _http_refusal(
                408,
                "Request Timeout",
                f"the body did not arrive within {self.settings.http_body_timeout_s:g} s",
                "REQUEST_TIMEOUT",
            ) from None
        return b"".join(chunks)

    @staticmethod
    def _too_large(limit: int) -> _Refusal:
        return _http_refusal(413, "Content Too Large", f"the body exceeds {limit} bytes", "REQUEST_TOO_LARGE")

    async def _currency_of(self, account_id: str, call: HttpCall) -> str:
        """The source account's currency, for a compact transfer that names none.

        An account's currency never changes, so once read it is kept (a bounded map); concurrent
        first reads of one account share one GetBalance. Without this, the document's twenty parallel
        retries of one transfer were twenty reads before the first transfer even started, and a busy
        shard shed some of them (429) instead of answering the transfer's replay or 409.
        """
        known = self._currencies.get(account_id)
        if known is not None:
            self._currencies.move_to_end(account_id)
            return known
        reading = self._currency_reads.get(account_id)
        if reading is None:
            reading = asyncio.ensure_future(self._read_currency(account_id, call))
            self._currency_reads[account_id] = reading
            reading.add_done_callback(lambda _: self._currency_reads.pop(account_id, None))
        currency = await asyncio.shield(reading)
        self._currencies[account_id] = currency
        if len(self._currencies) > _CURRENCIES_KEPT:
            self._currencies.popitem(last=False)
        return currency

    async def _read_currency(self, account_id: str, call: HttpCall) -> str:
        reader = dataclasses.replace(call, metadata=tuple(e for e in call.metadata if e[0] != KEY_METADATA))
        request = transfer_pb2.GetBalanceRequest(account_id=account_id)
        outcome = await self.forwarder.forward(_GET_BALANCE, request.SerializeToString(), reader)
        if outcome.code is not grpc.StatusCode.OK or outcome.response is None:
            if outcome.code is grpc.StatusCode.NOT_FOUND:
                raise NotFound(
                    f"account {account_id} does not exist, so its currency is unknown: name a currency",
                    reason=Reason.ACCOUNT_NOT_FOUND,
                )
            raise _Refusal(
                problem_from_trailers(outcome.code, outcome.details, outcome.trailing_metadata), outcome.code
            )
        return transfer_pb2.GetBalanceResponse.FromString(outcome.response).balance.currency

    # --- the answer ---------------------------------------------------------------------------------

    def _answer(self, declaration: RpcDeclaration, outcome: Outcome) -> Response:
        replayed = _trailer(outcome.trailing_metadata, REPLAYED_TRAILER) == REPLAYED_VALUE
        applied = preference_applied(_trailer(outcome.trailing_metadata, WAIT_APPLIED_TRAILER))
        if outcome.code is not grpc.StatusCode.OK or outcome.response is None:
            problem = problem_from_trailers(outcome.code, outcome.details, outcome.trailing_metadata)
            answer = _problem_response(problem, replayed)
            if applied is not None:
                answer.headers[PREFERENCE_APPLIED_HEADER] = applied
            return answer
        response = declaration.response_type.FromString(outcome.response)
        headers: dict[str, str] = {}
        if applied is not None:
            headers[PREFERENCE_APPLIED_HEADER] = applied
        if replayed:
            headers[REPLAYED_HEADER] = REPLAYED_VALUE
        status = 200
        if declaration.keyed:
            status = 201
            location = created_location(declaration, response)
            if location is not None:
                headers[LOCATION_HEADER] = location
        return Response(message_to_json_bytes(response), status, headers, media_type=_JSON)

    # --- tracing ------------------------------------------------------------------------------------

    @contextmanager
    def _span(self, request: Request, declaration: RpcDeclaration) -> Iterator[trace.Span]:
        if self._tracer is None:
            yield trace.INVALID_SPAN
            return
        route = request.scope.get("route")
        path = getattr(route, "path", request.url.path)
        headers = [(k, v) for k, v in request.headers.items() if k in _TRACE_HEADERS]
        with self._tracer.start_as_current_span(
            f"{request.method} {path}",
            context=tracing.extract_trace_context(headers),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "http.route": path,
                "url.path": request.url.path,
                "rpc.method": declaration.full_name,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            keys = request.headers.getlist(IDEMPOTENCY_KEY_HEADER)
            if len(keys) == 1:
                span.set_attribute("idempotency.key.header", keys[0][:300])
            yield span

    @staticmethod
    def _finish(span: trace.Span, response: Response, outcome: Outcome | None = None) -> Response:
        if not span.is_recording():
            return response
        span.set_attribute("http.response.status_code", response.status_code)
        if outcome is not None:
            kind = _outcome_kind(outcome)
            if kind:
                span.set_attribute(OUTCOME_ATTRIBUTE, str(kind))
                if kind != OutcomeKind.NEW:
                    span.add_event(f"idempotency.{kind}")
        if response.status_code >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status_code}"))
        return response


def _outcome_kind(outcome: Outcome) -> str | None:
    """The shard's idempotency outcome of a keyed call (as its span names it), from the trailers."""
    refused = _trailer(outcome.trailing_metadata, OUTCOME_TRAILER)
    if refused:  # in_flight, key_reused, expired, ... (passed on as sent: a newer shard may say more)
        return refused
    if _trailer(outcome.trailing_metadata, REPLAYED_TRAILER) == REPLAYED_VALUE:
        return OutcomeKind.REPLAY
    if _trailer(outcome.trailing_metadata, EXPIRES_AT_TRAILER) is not None:  # only keyed calls carry it
        return OutcomeKind.NEW
    return None


def _trailer(trailers: Sequence[MetadataEntry], name: str) -> str | None:
    value = next((v for k, v in trailers if k == name), None)
    return value if isinstance(value, str) else None


class _FrontConfig(uvicorn.Config):
    """uvicorn's settings plus the front's own per-connection limits and metrics: one per HTTP
    server, so two routers in one process (tests, benchmarks) each keep their own settings."""

    def __init__(
        self,
        app: Starlette,
        *,
        max_header_bytes: int,
        header_timeout_s: float,
        metrics: RouterMetrics | None,
        caller_tls: _CallerTls | None = None,
        **options: Any,
    ) -> None:
        super().__init__(app, **options)
        #: The HTTPS front's TLS contexts (None: plain HTTP).
        self.caller_tls = caller_tls
        self.max_header_bytes = max_header_bytes
        #: Longest a request's headers may take to arrive (s), from the connection or the request's
        #: first byte: a slow sender (slowloris) cannot hold a connection for ever before the app sees it.
        self.header_timeout_s = header_timeout_s
        self.metrics = metrics


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus what the front needs of a connection: the verified client
    certificate's names and identity (ASGI scope extension), a bound on the bytes of a request's
    headers and on the time they take, and the count of the requests refused here, before the app
    (`UNREAD_REFUSAL_CODES`), in the router's metrics. Its limits are its server's (`_FrontConfig`)."""

    config: _FrontConfig

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peercert = transport.get_extra_info("peercert")
        self._common_name = _common_name(peercert)
        self._uris = _uris(peercert)
        self._headers_due: asyncio.TimerHandle | None = None
        self._started = time.perf_counter()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()
        self._header_bytes = 0
        self._started = time.perf_counter()
        self._connection: dict[str, Any] = {
            "started": self._started,  # what a refusal's duration is counted from
            "client_common_name": self._common_name,
            "client_uris": self._uris,
            "client_identity": certificate_identity(self._common_name, self._uris),
        }
        extensions: dict[str, Any] = {_EXTENSION: self._connection}
        self.scope["extensions"] = extensions

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self.config.max_header_bytes:
            self._connection["headers_too_large"] = True
            return  # dropped: the front answers 431 without keeping them
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            self._count("OVER_CONNECTION_LIMIT")  # uvicorn answers 503 itself, the app never runs
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        self._count("UNPARSEABLE_REQUEST")  # a request line or headers httptools cannot parse
        super().send_400_response(msg)

    def _count(self, refusal: str) -> None:
        if self.config.metrics is not None:
            self.config.metrics.observe(
                UNKNOWN_METHOD,
                UNREAD_REFUSAL_CODES[refusal],
                time.perf_counter() - self._started,
                shard=NO_SHARD,
                protocol=HTTP,
            )

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._headers_due = self.loop.call_later(self.config.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_too_slow(self) -> None:
        self._headers_due = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request is being answered: its own limits apply
        self._count("REQUEST_TIMEOUT")
        body = http_only_problem(
            408,
            "Request Timeout",
            f"the request's headers did not arrive within {self.config.header_timeout_s:g} s",
            "REQUEST_TIMEOUT",
        ).body_bytes()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
            b"content-type: application/problem+json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        self.transport.close()


def _common_name(peercert: Any) -> str | None:
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def _uris(peercert: Any) -> tuple[str, ...]:
    """The URI SANs of a verified certificate (`ssl`'s `getpeercert()` shape)."""
    return tuple(str(value) for kind, value in (peercert or {}).get("subjectAltName", ()) if kind == "URI")


class _Server(uvicorn.Server):
    """uvicorn's server, leaving signals to the router process (which stops it)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    """A running HTTP front on the router's event loop."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    front: HttpFront
    #: Follows the HTTPS certificate files (None without TLS).
    certificates: asyncio.Task[None] | None = None

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let running requests finish (at most `grace_s`), then close."""
        self.front.draining = True
        if self.certificates is not None:
            self.certificates.cancel()
        self.server.config.timeout_graceful_shutdown = max(1, int(grace_s))
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace_s + 5)
        except TimeoutError:
            self.task.cancel()


class _CallerTls:
    """The HTTPS front's TLS context for new handshakes, built afresh when its files change.

    A renewed certificate or caller CA bundle becomes a fresh context, never a change to the live one:
    `load_verify_locations` only adds to OpenSSL's store, so a CA taken out of the bundle would stay
    trusted. Each handshake (`_TlsAccept`) takes the context current when it starts; open connections
    keep theirs. A half-written set of files is skipped until it loads.

    A fresh context also has its own session cache and ticket keys: a client cannot resume a session
    from before the change and skip the verification of its certificate. (Switching contexts in an
    `sni_callback` verifies against the fresh CA store too, but a TLS 1.2 session cached by the
    listening context still resumes there.)
    """

    def __init__(self, settings: RouterSettings) -> None:
        self._cert, self._key, self._ca = settings.tls_cert, settings.tls_key, settings.tls_ca
        self._files = tls.WatchedFiles("HTTPS certificate", self._cert, self._key, self._ca)
        self.current = self._context()

    def _context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._cert, self._key)
        if self._ca:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self._ca)
        return context

    def reload_if_changed(self) -> None:
        """Build a fresh context if the files changed (and load): new handshakes use it."""
        fresh = self._files.load_if_changed(self._context)
        if fresh is not None:
            self.current = fresh


async def _follow_certificates(caller_tls: _CallerTls, interval_s: float) -> None:
    """Look at the HTTPS certificate files every `interval_s`, as the gRPC server does at its
    handshakes. Runs on the event loop's thread, where the handshakes run."""
    while True:
        await asyncio.sleep(interval_s)
        caller_tls.reload_if_changed()


#: OpenSSL's reasons for a first record that is not a TLS handshake (plain HTTP sent to the TLS port).
_NOT_TLS = frozenset(
    {
        "HTTP_REQUEST",
        "HTTPS_PROXY_REQUEST",
        "WRONG_VERSION_NUMBER",
        "UNKNOWN_PROTOCOL",
        "UNSUPPORTED_PROTOCOL",
        "PACKET_LENGTH_TOO_LONG",
        "RECORD_LAYER_FAILURE",
    }
)


def _handshake_failure_reason(exc: BaseException) -> str:
    """The `reason` label of a failed handshake: one of a fixed few, never OpenSSL's own text."""
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or ""
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return "no_certificate"
        if isinstance(exc, ssl.SSLCertVerificationError) or reason == "CERTIFICATE_VERIFY_FAILED":
            return "untrusted_certificate"
        if reason in _NOT_TLS:
            return "not_tls"
        return "client_refused" if "ALERT" in reason else "other"
    if isinstance(exc, ConnectionAbortedError):
        return "timeout"  # asyncio's ssl_handshake_timeout
    return "connection_lost" if isinstance(exc, OSError) else "other"


class _Handshaking(asyncio.Protocol):
    """Stands in for the connection's HTTP protocol during the TLS handshake: what arrives between
    the handshake's end and the hand-over (a request sent with the client's last handshake flight)
    is kept and given to the HTTP protocol, which never sees a connection whose handshake failed."""

    def __init__(self) -> None:
        self._early: list[bytes] = []
        self._eof = False

    def data_received(self, data: bytes) -> None:
        self._early.append(data)

    def eof_received(self) -> None:
        self._eof = True

    def hand_over(self, transport: asyncio.Transport, protocol: asyncio.Protocol) -> None:
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        for data in self._early:
            protocol.data_received(data)
        if self._eof:
            protocol.eof_received()


class _TlsAccept(asyncio.Protocol):
    """An accepted connection of the HTTPS front until its TLS handshake ends: the handshake runs
    through `loop.start_tls` (public asyncio), whose failure is raised here, so it is counted in
    `router_tls_handshake_failures_total`; then uvicorn's protocol (`_Protocol`) takes the connection.

    Why not uvicorn's own `ssl=`: asyncio reports a failed server-side handshake to no one (an
    `OSError` is not given to the loop's exception handler, the app protocol never hears of it)."""

    def __init__(self, *, config: _FrontConfig, **options: Any) -> None:
        self._config, self._options = config, options
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # start_tls reads from here on
        self._task = asyncio.get_running_loop().create_task(self._handshake(transport))

    async def _handshake(self, transport: asyncio.Transport) -> None:
        caller_tls = self._config.caller_tls
        assert caller_tls is not None
        handshaking = _Handshaking()
        try:
            tls_transport = await asyncio.get_running_loop().start_tls(
                transport,
                handshaking,
                caller_tls.current,
                server_side=True,
                ssl_handshake_timeout=self._config.header_timeout_s,
            )
        except Exception as exc:  # start_tls has closed the connection
            reason = _handshake_failure_reason(exc)
            log.debug("TLS handshake failed (%s): %s", reason, exc)
            if self._config.metrics is not None:
                self._config.metrics.tls_handshake_failed(reason)
            return
        assert isinstance(tls_transport, asyncio.Transport)
        handshaking.hand_over(tls_transport, _Protocol(config=self._config, **self._options))


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP said explicitly: asyncio sets TCP_NODELAY on accepted connections only for a socket
    # that says it is TCP. Without it an answer's body (uvicorn writes headers and body apart) waited
    # for the client's delayed ACK on a kept-alive connection: ~40 ms per answer.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def start_http_server(front: HttpFront, settings: RouterSettings) -> HttpServer:
    """Serve `front` on `settings.http_listen` (port 0: a free one) on the running event loop."""
    sock = _bind(settings.http_listen)
    caller_tls = _CallerTls(settings) if settings.tls_enabled else None
    config = _FrontConfig(
        front.app,
        max_header_bytes=settings.max_metadata_bytes,
        header_timeout_s=settings.http_body_timeout_s,
        metrics=front.metrics,
        caller_tls=caller_tls,
        # With TLS the handshake is ours (`_TlsAccept`), uvicorn's `ssl=` stays off.
        http=_Protocol if caller_tls is None else _TlsAccept,
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_keep_alive=int(settings.http_keep_alive_s),
        # uvicorn counts the connection asking among the open ones (and refuses at the limit):
        # one more lets exactly `http_max_connections` connections in.
        limit_concurrency=settings.http_max_connections + 1,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP front stopped while starting")
        await asyncio.sleep(0.01)
    port = int(sock.getsockname()[1])
    log.info("HTTP front serving on port %d", port)
    certificates = None
    if caller_tls is not None:
        certificates = asyncio.get_running_loop().create_task(
            _follow_certificates(caller_tls, settings.reload_interval_s)
        )
    return HttpServer(server, task, port, front, certificates)
