"""The HTTP front's edges, over a real router (uvicorn on loopback, its /metrics) and a real shard
daemon on PostgreSQL: the nil UUID refused as a key over both protocols, a caller leaving mid-body
without a traceback, the `protocol` label, one scheme for problem types, settings per router, and
the refusals made before the app runs (uvicorn's, gRPC's own) counted."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import psycopg
import pytest

from shardrouter.core.keys import new_key
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.http.problems import PROBLEM_TYPE_PREFIX
from shardrouter.router.server import RouterThread
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2
from tests.helpers import make_settings, money
from tests.metrics import Labels, samples
from tests.router.test_http_front import _router as http_front_router

NIL = "00000000-0000-0000-0000-000000000000"
DEPOSIT = b'{"accountId":"zed","amount":{"amountMinor":"1","currency":"EUR"}}'
BODY_TIMEOUT_S = 1.0


@dataclass
class Lab:
    router: RouterThread
    shard: ShardDaemon
    dsn: str

    @property
    def port(self) -> int:
        return self.router.http_port

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
        finally:
            conn.close()

    def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.router.router.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.read().decode()

    def records(self) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT count(*) FROM idempotency_record").fetchone()
        assert row is not None
        return int(row[0])


def _router(shard: ShardDaemon, tmp_path, **overrides: object) -> RouterThread:
    """The HTTP front tests' router, with a metrics port to scrape and this module's body timeout."""
    values: dict[str, object] = {"metrics_port": free_port(), "http_body_timeout_s": BODY_TIMEOUT_S}
    values.update(overrides)
    return http_front_router(shard, tmp_path, **values)


@pytest.fixture
def lab(database: str, tmp_path) -> Iterator[Lab]:
    shard = start_shard(make_settings(database))
    router = _router(shard, tmp_path)
    try:
        yield Lab(router, shard, database)
    finally:
        router.stop(1.0)
        shard.stop(0.5)


def _delta(before: str, after: str, name: str = "router_requests_total") -> dict[Labels, float]:
    old, new = samples(before, name), samples(after, name)
    return {
        labels: value - old.get(labels, 0.0) for labels, value in new.items() if value != old.get(labels, 0.0)
    }


def _series(method: str, code: str, protocol: str, shard: str = "none") -> Labels:
    return (("code", code), ("method", method), ("protocol", protocol), ("shard", shard))


def _grpc_deposit(lab: Lab, key: str) -> grpc.RpcError | transfer_pb2.DepositResponse:
    with grpc.insecure_channel(f"127.0.0.1:{lab.router.port}") as channel:
        deposit = channel.unary_unary(
            "/shardrouter.v1.TransferService/Deposit",
            request_serializer=transfer_pb2.DepositRequest.SerializeToString,
            response_deserializer=transfer_pb2.DepositResponse.FromString,
        )
        try:
            return deposit(
                transfer_pb2.DepositRequest(account_id="zed", amount=money(1)),
                metadata=(("idempotency-key", key),),
                timeout=10,
            )
        except grpc.RpcError as error:
            return error


def test_the_nil_uuid_is_refused_as_a_key_over_grpc_and_http(lab: Lab) -> None:
    status, body = lab.request(
        "POST", "/v1/deposits", DEPOSIT, {"Content-Type": "application/json", "Idempotency-Key": NIL}
    )
    assert status == 400, body
    assert body["reason"] == "IDEMPOTENCY_KEY_INVALID"
    assert "almost always a client bug" in body["detail"]
    refused = _grpc_deposit(lab, NIL)
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "almost always a client bug" in (refused.details() or "")
    assert lab.records() == 0
    assert isinstance(_grpc_deposit(lab, str(new_key())), transfer_pb2.DepositResponse)  # any other key


def test_a_caller_gone_mid_body_leaves_no_traceback(lab: Lab, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    before = lab.scrape()
    with socket.create_connection(("127.0.0.1", lab.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/deposits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Idempotency-Key: gone-mid-body\r\nContent-Length: 100\r\n\r\n" + DEPOSIT[:20]
        )
        time.sleep(0.2)  # the front is reading the body
    series = _series("Deposit", "CANCELLED", "http")
    deadline = time.monotonic() + 5
    while _delta(before, lab.scrape()) != {series: 1.0}:
        assert time.monotonic() < deadline, _delta(before, lab.scrape())
        time.sleep(0.05)
    time.sleep(0.2)  # whatever uvicorn logs after the app returned
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert noisy == [], [(r.name, r.getMessage()) for r in noisy]


def test_calls_are_labelled_with_their_protocol(lab: Lab) -> None:
    before = lab.scrape()
    assert isinstance(_grpc_deposit(lab, str(new_key())), transfer_pb2.DepositResponse)
    status, _ = lab.request(
        "POST",
        "/v1/deposits",
        DEPOSIT,
        {"Content-Type": "application/json", "Idempotency-Key": str(new_key())},
    )
    assert status == 201
    expected = {
        _series("Deposit", "OK", "grpc", "shard-0"): 1.0,
        _series("Deposit", "OK", "http", "shard-0"): 1.0,
    }
    after = lab.scrape()
    assert _delta(before, after) == expected
    assert _delta(before, after, "router_request_duration_seconds_count") == expected


def test_every_problem_type_is_a_tag_uri_named_after_its_reason(lab: Lab) -> None:
    json_type = {"Content-Type": "application/json"}
    answers = [
        lab.request("GET", "/v1/nothing/here"),  # only HTTP says it: 404 no such route
        lab.request("DELETE", "/v1/deposits"),  # 405
        lab.request(
            "POST", "/v1/deposits", DEPOSIT, {"Content-Type": "text/plain", "Idempotency-Key": "k"}
        ),  # 415
        lab.request(
            "POST",
            "/v1/deposits",
            b'{"accountId":"' + b"z" * 70_000 + b'"}',
            json_type | {"Idempotency-Key": "k"},
        ),
        lab.request("POST", "/v1/deposits", DEPOSIT, json_type),  # 400 key missing (the front)
        lab.request("POST", "/v1/deposits", DEPOSIT, json_type | {"Idempotency-Key": NIL}),  # 400 (the shard)
        lab.request("GET", "/v1/accounts/nobody/balance"),  # 404 (the shard)
    ]
    assert [status for status, _ in answers] == [404, 405, 415, 413, 400, 400, 404]
    for _, body in answers:
        assert body["type"] == PROBLEM_TYPE_PREFIX + body["reason"].lower().replace("_", "-"), body


def test_each_router_keeps_its_own_http_settings(lab: Lab, tmp_path) -> None:
    """A second router in the same process with other limits leaves the first one's alone."""
    other = _router(lab.shard, tmp_path, max_metadata_bytes=64 * 1024, http_body_timeout_s=30.0)
    try:
        filler = {"X-Filler": "f" * 20_000}  # over the first router's 16 KiB, under the other's 64 KiB
        assert lab.request("GET", "/v1/accounts/nobody/balance", headers=filler)[0] == 431
        conn = http.client.HTTPConnection("127.0.0.1", other.http_port, timeout=10)
        try:
            conn.request("GET", "/v1/accounts/nobody/balance", headers=filler)
            assert conn.getresponse().status == 404
        finally:
            conn.close()
        # The first router's header timeout is still its own 1 s, not the other's 30 s.
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", lab.port), timeout=10) as sock:
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < 10
    finally:
        other.stop(0.5)


def test_refusals_before_the_app_runs_are_counted(lab: Lab) -> None:
    before = lab.scrape()
    with socket.create_connection(("127.0.0.1", lab.port), timeout=10) as sock:  # not HTTP at all
        sock.sendall(b"\x16\x03\x01 this is no request line\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", lab.port), timeout=10) as sock:  # headers never come
        assert sock.recv(65536).startswith(b"HTTP/1.1 408")
    with grpc.insecure_channel(f"127.0.0.1:{lab.router.port}") as channel:
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary("/shardrouter.v1.TransferService/NoSuchMethod")(b"", timeout=10)
        assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError):
            channel.unary_unary("/no.such.Service/Method")(b"", timeout=10)
    assert _delta(before, lab.scrape()) == {
        _series("unknown", "INVALID_ARGUMENT", "http"): 1.0,
        _series("unknown", "DEADLINE_EXCEEDED", "http"): 1.0,
        _series("unknown", "UNIMPLEMENTED", "grpc"): 2.0,
    }


def test_a_request_over_the_connection_limit_is_counted(lab: Lab, tmp_path) -> None:
    # One connection at most: it is served, a second one is answered 503.
    limited = _router(lab.shard, tmp_path, http_max_connections=1)
    try:
        url = f"http://127.0.0.1:{limited.router.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            before = reply.read().decode()
        with socket.create_connection(("127.0.0.1", limited.http_port), timeout=10) as holder:
            holder.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert holder.recv(65536).startswith(b"HTTP/1.1 200")  # kept open: the limit is reached
            conn = http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=10)
            try:
                conn.request("GET", "/v1/accounts/nobody/balance")
                assert conn.getresponse().status == 503
            finally:
                conn.close()
        with urllib.request.urlopen(url, timeout=5) as reply:
            after = reply.read().decode()
        assert _delta(before, after) == {_series("unknown", "RESOURCE_EXHAUSTED", "http"): 1.0}
    finally:
        limited.stop(0.5)
