"""The HTTP front's refusals before forwarding appear in the router's metrics, each counted once.

A router in this process (its real uvicorn front on loopback, its real /metrics endpoint) over a fake
shard. Each request below is sent alone and the scrape before and after it is compared: a refusal the
front answers itself counts once in `router_requests_total` and `router_request_duration_seconds`,
under the route's RPC (or "unknown" for a route no RPC declares), the gRPC code the refusal maps to
and shard "none"; a forwarded request counts once, by the forwarder, and not a second time.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import yaml

from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.server import RouterThread, start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.v1 import transfer_pb2
from tests.helpers import money
from tests.metrics import Labels, samples, scrape_text
from tests.router.fakeshard import FakeShard, SeenCall, start_fake_shard

JSON = "application/json"
DEPOSIT = b'{"accountId":"zed","amount":{"amountMinor":"1","currency":"EUR"}}'
#: The router's body (and header) timeout here (s): a slow body is cut off after it.
BODY_TIMEOUT_S = 1.0



def _balance(call: SeenCall, context: grpc.ServicerContext) -> bytes:
    account = transfer_pb2.GetBalanceRequest.FromString(call.request).account_id
    if account == "nobody":
        context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
    return transfer_pb2.GetBalanceResponse(account_id=account, balance=money(5)).SerializeToString()


@dataclass
class Front:
    router: RouterThread
    shard: FakeShard

    @property
    def port(self) -> int:
        return self.router.http_port

    def scrape(self) -> str:
        return scrape_text(self.router.router.metrics_port)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    shard = start_fake_shard()
    shard.reset(_balance)
    path = tmp_path_factory.mktemp("http-metrics") / "shard-map.yaml"
    path.write_text(yaml.safe_dump(shard_map_document(even_shard_map({"s0": shard.address}))))
    router = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0",
            http_listen="127.0.0.1:0",
            shard_map=str(path),
            dev_mode=True,
            metrics_port=free_port(),
            http_body_timeout_s=BODY_TIMEOUT_S,
        )
    )
    try:
        yield Front(router, shard)
    finally:
        router.stop(0.5)
        shard.stop()


def _delta(before: str, after: str, name: str) -> dict[Labels, float]:
    """The samples of `name` that changed between two scrapes, by how much."""
    old, new = samples(before, name), samples(after, name)
    return {labels: value - old.get(labels, 0.0) for labels, value in new.items() if value != old.get(labels, 0.0)}


def _series(method: str, code: str, shard: str = "none") -> Labels:
    return (("code", code), ("method", method), ("protocol", "http"), ("shard", shard))


def _slow_body(front: Front) -> int:
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/deposits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Idempotency-Key: slow-body-key\r\nContent-Length: 100\r\n\r\n{"accountId":'
        )
        answer = sock.recv(65536)  # the router's body timeout ends the wait
    return int(answer.split(b" ", 2)[1])


def _two_caller_ids(front: Front) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/deposits")
        conn.putheader("Content-Type", JSON)
        conn.putheader("Content-Length", str(len(DEPOSIT)))
        conn.putheader("Idempotency-Key", "two-callers")
        conn.putheader("X-Caller-Id", "one")
        conn.putheader("X-Caller-Id", "two")
        conn.endheaders(DEPOSIT)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _post(path: str, body: bytes, content_type: str = JSON, key: str | None = "k-1") -> Callable[[Front], int]:
    headers = {"Content-Type": content_type} | ({"Idempotency-Key": key} if key is not None else {})
    return lambda front: front.request("POST", path, body, headers)


def _get(path: str, **headers: str) -> Callable[[Front], int]:
    return lambda front: front.request("GET", path, headers={k.replace("_", "-"): v for k, v in headers.items()})


CASES: list[tuple[str, Callable[[Front], int], int, Labels | dict[Labels, float]]] = [
    # refused by the front before anything is forwarded: shard "none"
    ("malformed-json", _post("/v1/deposits", b"{not json"), 400, _series("Deposit", "INVALID_ARGUMENT")),
    ("unknown-field", _post("/v1/deposits", DEPOSIT[:-1] + b',"extra":1}'), 400, _series("Deposit", "INVALID_ARGUMENT")),
    ("not-json", _post("/v1/deposits", DEPOSIT, "text/plain"), 415, _series("Deposit", "INVALID_ARGUMENT")),
    ("too-large", _post("/v1/deposits", b'{"accountId":"' + b"z" * 70_000 + b'"}'), 413, _series("Deposit", "RESOURCE_EXHAUSTED")),
    ("too-slow", _slow_body, 408, _series("Deposit", "DEADLINE_EXCEEDED")),
    ("headers-too-large", _get("/v1/accounts/zed/balance", X_Filler="f" * 40_000), 431, _series("GetBalance", "RESOURCE_EXHAUSTED")),
    ("key-missing", _post("/v1/deposits", DEPOSIT, key=None), 400, _series("Deposit", "INVALID_ARGUMENT")),
    ("key-malformed", _post("/v1/deposits", DEPOSIT, key='"unterminated'), 400, _series("Deposit", "INVALID_ARGUMENT")),
    ("two-caller-ids", _two_caller_ids, 400, _series("Deposit", "INVALID_ARGUMENT")),
    ("bad-query-variable", _get("/v1/accounts/zed/transfers/t-1?wait_for_completion_ms=soon"), 400, _series("GetTransfer", "INVALID_ARGUMENT")),
    ("compact-transfer-malformed", _post("/transfers", b'{"src":'), 400, _series("Transfer", "INVALID_ARGUMENT")),
    ("unknown-route", _get("/v1/nothing/here"), 404, _series("unknown", "UNIMPLEMENTED")),
    ("unknown-verb", lambda front: front.request("DELETE", "/v1/deposits"), 405, _series("unknown", "UNIMPLEMENTED")),
    # the router refuses a bad routing account (a path variable) as it forwards: counted once, by it
    ("bad-path-variable", _get("/v1/accounts/-bad!/balance"), 400, _series("GetBalance", "INVALID_ARGUMENT")),
    # forwarded to the shard: counted once, under the shard, by the forwarder alone
    ("forwarded-ok", _get("/v1/accounts/zed/balance"), 200, _series("GetBalance", "OK", "s0")),
    ("forwarded-refused", _get("/v1/accounts/nobody/balance"), 404, _series("GetBalance", "NOT_FOUND", "s0")),
    # a compact transfer without a currency reads the source's first: that read is forwarded and
    # counted; the transfer, refused when the read fails, is counted once as refused
    (
        "compact-transfer-currency-read-fails",
        _post("/transfers", b'{"src":"nobody","dst":"zed","amount":5}'),
        404,
        {_series("GetBalance", "NOT_FOUND", "s0"): 1.0, _series("Transfer", "NOT_FOUND"): 1.0},
    ),
]


@pytest.mark.parametrize(("send", "status", "series"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_http_request_counts_once(
    front: Front, send: Callable[[Front], int], status: int, series: Labels | dict[Labels, float]
) -> None:
    expected = series if isinstance(series, dict) else {series: 1.0}
    before = front.scrape()
    calls_before = len(front.shard.calls)
    assert send(front) == status
    # The front counts a call before its answer goes out: the scrape after the answer has it.
    after = front.scrape()
    forwarded = sum(1 for labels in expected if dict(labels)["shard"] != "none")
    assert len(front.shard.calls) - calls_before == forwarded
    assert _delta(before, after, "router_requests_total") == expected, after
    assert _delta(before, after, "router_request_duration_seconds_count") == expected, after


def test_a_caller_gone_before_its_body_arrived_counts_as_cancelled(front: Front) -> None:
    before = front.scrape()
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/deposits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Idempotency-Key: gone-key\r\nContent-Length: 100\r\n\r\n{"accountId":'
        )
        time.sleep(0.2)  # the front is reading the body
    series = _series("Deposit", "CANCELLED")
    deadline = time.monotonic() + 5  # counted once the front sees the connection closed
    while (delta := _delta(before, front.scrape(), "router_requests_total")) != {series: 1.0}:
        assert time.monotonic() < deadline, delta
        time.sleep(0.05)


def test_a_refusal_is_timed_from_the_requests_first_byte(front: Front) -> None:
    """A slow body's 408 comes after the body timeout: its duration says so."""
    before = front.scrape()
    started = time.monotonic()
    assert _slow_body(front) == 408
    took = time.monotonic() - started
    after = front.scrape()
    series = _series("Deposit", "DEADLINE_EXCEEDED")
    sums = _delta(before, after, "router_request_duration_seconds_sum")
    assert BODY_TIMEOUT_S <= sums[series] <= took + 0.1, (sums, took)


def test_probes_and_documents_are_not_calls(front: Front) -> None:
    """/healthz, /openapi.json and /docs answer no RPC: they are not counted (as gRPC health is not)."""
    before = front.scrape()
    for path in ("/healthz", "/openapi.json", "/docs"):
        assert _get(path)(front) == 200
    assert _delta(before, front.scrape(), "router_requests_total") == {}
