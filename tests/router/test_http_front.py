"""The router's HTTP/JSON front against a real shard daemon and PostgreSQL: one semantics with gRPC.

Real uvicorn on loopback, real router forwarding, real shard interceptor; plain `http.client` as the
caller (no framework test client), so what is checked is what goes over the wire.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import psycopg
import pytest
import yaml

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.router.server import RouterThread, start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.shardd.server import ShardDaemon, start_shard
from tests.helpers import make_settings

JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Front:
    port: int
    dsn: str
    grpc_port: int = 0

    def request(self, method: str, path: str, body: bytes | str | None = None, headers=None) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            data = body.encode() if isinstance(body, str) else body
            conn.request(method, path, body=data, headers=headers or {})
            response = conn.getresponse()
            return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        finally:
            conn.close()

    def post(self, path: str, payload: object, key: str | None = None, **headers: str) -> Answer:
        sent = dict(JSON)
        if key is not None:
            sent["Idempotency-Key"] = key
        sent.update({k.replace("_", "-"): v for k, v in headers.items()})
        return self.request("POST", path, json.dumps(payload), sent)

    def deposit(self, account: str, amount: int, key: str | None = None) -> Answer:
        return self.post(
            "/v1/deposits",
            {"accountId": account, "amount": {"amountMinor": str(amount), "currency": "EUR"}},
            key or str(new_key()),
        )

    def entries(self, account: str, kind: str) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM ledger_entries WHERE account_id = %s AND kind = %s", (account, kind)
            ).fetchone()
        assert row is not None
        return int(row[0])


def _router(shard: ShardDaemon, tmp_path, **overrides: object) -> RouterThread:
    path = tmp_path / "shard-map.yaml"
    path.write_text(yaml.safe_dump(shard_map_document(even_shard_map({"shard-0": f"127.0.0.1:{shard.port}"}))))
    values: dict[str, object] = {
        "listen": "127.0.0.1:0",
        "http_listen": "127.0.0.1:0",
        "shard_map": str(path),
        "dev_mode": True,
        "metrics_port": 0,
    }
    values.update(overrides)
    return start_router_thread(RouterSettings(**values))  # type: ignore[arg-type]


@pytest.fixture
def front(database: str, tmp_path) -> Iterator[Front]:
    # Admission well above the twenty parallel attempts below: these tests are about the answers, and
    # shedding (429/503, nothing stored) has tests of its own.
    shard = start_shard(make_settings(database, workers=128, max_in_flight=64, max_waiting=32))
    router = _router(shard, tmp_path, http_body_timeout_s=1.0)
    try:
        yield Front(router.http_port, database, router.port)
    finally:
        router.stop(1.0)
        shard.stop(0.5)


def test_a_deposit_is_created_once_and_replayed_byte_for_byte(front: Front) -> None:
    key = str(new_key())
    first = front.deposit("alice", 250, key)
    assert first.status == 201, first.body
    assert first.headers["content-type"] == "application/json"
    assert "idempotent-replayed" not in first.headers
    assert first.json["balance"] == {"amountMinor": "250", "currency": "EUR"}
    again = front.deposit("alice", 250, key)
    assert (again.status, again.body) == (201, first.body)
    assert again.headers["idempotent-replayed"] == "true"
    assert front.entries("alice", "deposit") == 1


def test_a_transfer_answers_its_location_and_reads_back(front: Front) -> None:
    front.deposit("ann", 1000)
    front.deposit("bo", 1)
    created = front.post(
        "/v1/transfers",
        {"source_account_id": "ann", "destinationAccountId": "bo", "amount": {"amountMinor": 300, "currency": "EUR"}},
        str(new_key()),
    )
    assert created.status == 201, created.body
    transfer = created.json["transfer"]
    assert created.headers["location"] == f"/v1/accounts/ann/transfers/{transfer['transferId']}"
    read = front.request("GET", created.headers["location"])
    assert read.status == 200
    assert read.json["transfer"]["transferId"] == transfer["transferId"]
    balance = front.request("GET", "/v1/accounts/bo/balance")
    assert balance.status == 200
    assert balance.json["balance"]["amountMinor"] == "301"


def test_the_source_documents_verification_as_written(front: Front) -> None:
    """Twenty parallel POST /transfers with one uuid4 key: one effect; 201 stored bytes or 409."""
    front.deposit("8842", 10_000)
    front.deposit("1190", 1)
    key = str(uuid.uuid4())
    body = '{"src":8842,"dst":1190,"amount":2500}'
    start = threading.Barrier(20)

    def attempt(_: int) -> Answer:
        start.wait()
        return front.request("POST", "/transfers", body, {**JSON, "Idempotency-Key": key})

    with futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(attempt, range(20)))
    created = [a for a in answers if a.status == 201]
    assert created, [a.status for a in answers]
    assert {a.body for a in created} == {created[0].body}
    for answer in answers:
        assert answer.status in (201, 409), answer.body
        if answer.status == 409:
            assert answer.json["reason"] == "IDEMPOTENCY_KEY_IN_FLIGHT"
            assert int(answer.headers["retry-after"]) >= 1
    assert front.entries("8842", "transfer_out") == 1
    later = front.request("POST", "/transfers", body, {**JSON, "Idempotency-Key": key})
    assert (later.status, later.body) == (201, created[0].body)
    assert later.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize("key", ["grpc-then-http-opaque", str(uuid.uuid4()), str(new_key())], ids=["opaque", "uuid4", "uuid7"])
def test_one_key_sent_over_grpc_then_http_is_one_operation(front: Front, key: str) -> None:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

    account = f"gh-{abs(hash(key)) % 10**6}"
    request = transfer_pb2.DepositRequest(
        account_id=account, amount=transfer_pb2.Money(amount_minor=70, currency="EUR"), reference="same"
    )
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as channel:
        reply = transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
            request, metadata=[("idempotency-key", key)], timeout=10
        )
    answer = front.post(
        "/v1/deposits",
        {"accountId": account, "amount": {"amountMinor": 70, "currency": "EUR"}, "reference": "same"},
        key,
    )
    assert answer.status == 201, answer.body
    assert answer.headers["idempotent-replayed"] == "true"
    assert answer.json == MessageToDict(reply, always_print_fields_with_no_presence=True)
    assert front.entries(account, "deposit") == 1


def test_quoted_and_bare_key_headers_are_one_key(front: Front) -> None:
    body = {"accountId": "quin", "amount": {"amountMinor": "5", "currency": "EUR"}}
    quoted = front.post("/v1/deposits", body, '"same-key-two-forms"')
    assert quoted.status == 201
    bare = front.post("/v1/deposits", body, "same-key-two-forms")
    assert (bare.status, bare.body) == (201, quoted.body)
    assert bare.headers["idempotent-replayed"] == "true"
    assert front.entries("quin", "deposit") == 1


def test_a_key_in_flight_is_409_with_retry_after_then_applies(front: Front) -> None:
    key = str(new_key())
    holder = psycopg.connect(front.dsn)  # holds the key's lock as an uncommitted first attempt would
    holder.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
        (f"/shardrouter.v1.TransferService/Deposit|anonymous {key}",),
    )
    try:
        conflict = front.deposit("rae", 9, key)
        assert conflict.status == 409, conflict.body
        assert conflict.json["reason"] == "IDEMPOTENCY_KEY_IN_FLIGHT"
        assert int(conflict.headers["retry-after"]) >= 1
        assert conflict.json["retry_after_ms"] > 0
    finally:
        holder.rollback()
        holder.close()
    applied = front.deposit("rae", 9, key)
    assert applied.status == 201
    assert "idempotent-replayed" not in applied.headers


def test_a_key_reused_for_another_body_is_422(front: Front) -> None:
    key = str(new_key())
    assert front.deposit("carol", 100, key).status == 201
    reused = front.deposit("carol", 999, key)
    assert reused.status == 422
    assert reused.headers["content-type"] == "application/problem+json"
    assert reused.json["reason"] == "IDEMPOTENCY_KEY_REUSED"


def test_a_business_refusal_is_stored_and_replayed_with_its_status(front: Front) -> None:
    front.deposit("dan", 10)
    front.deposit("eve", 10)
    key = str(new_key())
    payload = {"src": "dan", "dst": "eve", "amount": 5000}
    first = front.post("/transfers", payload, key)
    assert first.status == 422
    assert first.json["reason"] == "INSUFFICIENT_FUNDS"
    again = front.post("/transfers", payload, key)
    assert (again.status, again.body) == (422, first.body)
    assert again.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "IDEMPOTENCY_KEY_MISSING"),
        ({"Idempotency-Key": "has space"}, "IDEMPOTENCY_KEY_INVALID"),
        ({"Idempotency-Key": '"unterminated'}, "IDEMPOTENCY_KEY_INVALID"),
        ({"Idempotency-Key": "x" * 256}, "IDEMPOTENCY_KEY_INVALID"),
    ],
    ids=["missing", "space", "unterminated-quote", "too-long"],
)
def test_a_bad_key_header_is_400_and_nothing_is_stored(front: Front, headers: dict[str, str], reason: str) -> None:
    answer = front.request(
        "POST", "/v1/deposits", '{"accountId":"zed","amount":{"amountMinor":"1","currency":"EUR"}}', {**JSON, **headers}
    )
    assert answer.status == 400, answer.body
    assert answer.json["reason"] == reason
    assert front.entries("zed", "deposit") == 0


def test_two_key_headers_are_refused(front: Front) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    body = b'{"accountId":"zed","amount":{"amountMinor":"1","currency":"EUR"}}'
    conn.putrequest("POST", "/v1/deposits")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)))
    conn.putheader("Idempotency-Key", "one")
    conn.putheader("Idempotency-Key", "two")
    conn.endheaders(body)
    response = conn.getresponse()
    assert response.status == 400
    assert json.loads(response.read())["reason"] == "IDEMPOTENCY_KEY_INVALID"
    conn.close()


@pytest.mark.parametrize(
    ("body", "content_type", "status", "reason"),
    [
        ("{not json", "application/json", 400, "INVALID_REQUEST"),
        ('{"accountId":"zed","amount":{"amountMinor":"1","currency":"EUR"},"extra":1}', "application/json", 400, "INVALID_REQUEST"),
        ('{"accountId":"zed","amount":{"amountMinor":"1.5","currency":"EUR"}}', "application/json", 400, "INVALID_REQUEST"),
        ('{"accountId":"zed","amount":{"amountMinor":"1","currency":"EUR"}}', "text/plain", 415, "UNSUPPORTED_MEDIA_TYPE"),
        ('{"accountId":"zed","amount":{"amountMinor":"1","currency":"EUR"}}', "application/json; charset=latin-1", 415, "UNSUPPORTED_MEDIA_TYPE"),
        ('{"accountId":"' + "z" * 70_000 + '"}', "application/json", 413, "REQUEST_TOO_LARGE"),
    ],
    ids=["malformed-json", "unknown-field", "wrong-type", "wrong-content-type", "wrong-charset", "too-large"],
)
def test_bad_bodies_are_answered_specifically_and_nothing_is_stored(
    front: Front, body: str, content_type: str, status: int, reason: str
) -> None:
    answer = front.request(
        "POST", "/v1/deposits", body, {"Content-Type": content_type, "Idempotency-Key": str(new_key())}
    )
    assert answer.status == status, answer.body
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json["reason"] == reason
    assert front.entries("zed", "deposit") == 0


def test_a_huge_header_is_431(front: Front) -> None:
    answer = front.request("GET", "/v1/accounts/zed/balance", headers={"X-Filler": "f" * 40_000})
    assert answer.status == 431
    assert answer.json["reason"] == "HEADERS_TOO_LARGE"


def test_a_slow_body_is_cut_off_with_408(front: Front) -> None:
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/deposits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Idempotency-Key: slow-body-key\r\nContent-Length: 100\r\n\r\n{\"accountId\":"
        )
        started = time.monotonic()
        answer = sock.recv(65536)  # the server's body timeout (1 s here) ends the wait, not this test
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert time.monotonic() - started < 5


def test_unknown_routes_and_verbs_are_problems(front: Front) -> None:
    missing = front.request("GET", "/v1/nothing")
    assert missing.status == 404
    assert missing.json["reason"] == "NO_SUCH_ROUTE"
    wrong_verb = front.request("DELETE", "/v1/deposits")
    assert wrong_verb.status == 405


def test_reads_need_no_key_and_answer_404_for_an_unknown_account(front: Front) -> None:
    answer = front.request("GET", "/v1/accounts/nobody-here/balance")
    assert answer.status == 404
    assert answer.json["reason"] == "ACCOUNT_NOT_FOUND"


def test_the_api_document_and_its_page_are_served(front: Front) -> None:
    document = front.request("GET", "/openapi.json")
    assert document.status == 200
    assert "/v1/transfers" in document.json["paths"]
    page = front.request("GET", "/docs")
    assert page.status == 200
    assert b"openapi.json" in page.body


def test_answers_on_a_kept_alive_connection_are_not_held_back(front: Front) -> None:
    """Accepted sockets have TCP_NODELAY: later answers on one connection are not held back by Nagle."""
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        took = []
        for _ in range(5):
            started = time.monotonic()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            took.append(time.monotonic() - started)
    finally:
        conn.close()
    # Nagle behind a delayed ACK holds every such answer ~40 ms; the fastest of five says whether it did.
    assert min(took) < 0.02, took


@pytest.mark.parametrize(
    "sent", [b"", b"POST /v1/deposits HTTP/1.1\r\nHost: x\r\nIdempotency-Key: sl"], ids=["silent", "slow-headers"]
)
def test_a_connection_whose_headers_do_not_arrive_is_closed_with_408(front: Front, sent: bytes) -> None:
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        answer = sock.recv(65536)  # the server's header timeout (1 s here) ends the wait
        closed = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"REQUEST_TIMEOUT" in answer
    assert closed == b"", "the connection stays open"
    assert time.monotonic() - started < 5
