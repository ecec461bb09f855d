"""SPIFFE identities end to end: a caller's certificate with a `spiffe://` URI SAN is that URI to the
router, over gRPC and over HTTP, and the shard stores the URI in the key's scope; a certificate
named `router` that the shard does not trust as a proxy cannot speak for anyone.

Certificates are made in the test (`tests.tls`); the shards are real (PostgreSQL).
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.router.server import RouterThread, start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money
from tests.tls import CertFiles, TestCA

TEAM_A = "spiffe://cluster.local/ns/payments/sa/team-a"
TEAM_B = "spiffe://cluster.local/ns/payments/sa/team-b"
ROUTER = "spiffe://cluster.local/ns/shard-router/sa/router"
DEPOSIT = "/shardrouter.v1.TransferService/Deposit"


def _scopes(database: str, key: str) -> set[str]:
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT scope FROM idempotency_record WHERE key = %s", (key,)).fetchall()
    return {row[0] for row in rows}


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path)


@pytest.fixture
def router(shard: ShardDaemon, ca: TestCA, tmp_path: Path) -> Iterator[RouterThread]:
    """A router verifying its callers (mTLS, gRPC and HTTP) in front of a dev-mode shard (plaintext,
    which believes the router's x-caller-id as it would believe a trusted proxy's)."""
    server = ca.issue("router.local", server=True)
    shard_map = tmp_path / "shard-map.yaml"
    shard_map.write_text(yaml.safe_dump(shard_map_document(even_shard_map({"shard-0": f"127.0.0.1:{shard.port}"}))))
    thread = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0",
            http_listen="127.0.0.1:0",
            shard_map=str(shard_map),
            metrics_port=0,
            tls_cert=str(server.cert),
            tls_key=str(server.key),
            tls_ca=str(ca.ca_path),
        )
    )
    yield thread
    thread.stop(1.0)


def _grpc_deposit(port: int, ca: TestCA, files: CertFiles, key: str, claim: str | None = None) -> None:
    credentials = grpc.ssl_channel_credentials(ca.ca_path.read_bytes(), files.key.read_bytes(), files.cert.read_bytes())
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
            transfer_pb2.DepositRequest(account_id="spiffe-acct", amount=money(5)),
            metadata=key_metadata(key, claim),
            timeout=10,
        )


def _http_deposit(port: int, ca: TestCA, files: CertFiles, key: str, claim: str | None = None) -> int:
    context = ssl.create_default_context(cafile=str(ca.ca_path))
    context.load_cert_chain(str(files.cert), str(files.key))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        body = {"accountId": "spiffe-acct", "amount": {"amountMinor": "5", "currency": "EUR"}}
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        if claim is not None:
            headers["X-Caller-Id"] = claim
        conn.request("POST", "/v1/deposits", json.dumps(body), headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_grpc_caller_is_its_uri_san(router: RouterThread, ca: TestCA, database: str) -> None:
    key = str(new_key())
    team_a = ca.issue("team-a", uris=(TEAM_A,))
    _grpc_deposit(router.port, ca, team_a, key, claim="victim")
    assert _scopes(database, key) == {f"{DEPOSIT}|{TEAM_A}"}


def test_common_name_router_with_another_uri_is_that_uri(router: RouterThread, ca: TestCA, database: str) -> None:
    """CN=router does not make the router: the URI SAN is who the certificate is."""
    key = str(new_key())
    impostor = ca.issue("router", uris=(TEAM_B,), stem="impostor")
    _grpc_deposit(router.port, ca, impostor, key, claim="victim")
    assert _scopes(database, key) == {f"{DEPOSIT}|{TEAM_B}"}


def test_http_caller_is_its_uri_san(router: RouterThread, ca: TestCA, database: str) -> None:
    key = str(new_key())
    team_a = ca.issue("team-a", uris=(TEAM_A,))
    assert _http_deposit(router.http_port, ca, team_a, key, claim="victim") == 201
    # The same key from a certificate without a URI SAN is its common name's own operation.
    plain = ca.issue("billing")
    assert _http_deposit(router.http_port, ca, plain, key) == 201
    assert _scopes(database, key) == {f"{DEPOSIT}|{TEAM_A}", f"{DEPOSIT}|billing"}


def test_a_certificate_with_several_spiffe_ids_is_refused(router: RouterThread, ca: TestCA, database: str) -> None:
    key = str(new_key())
    ambiguous = ca.issue("team-a", uris=(TEAM_A, TEAM_B), stem="ambiguous")
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_deposit(router.port, ca, ambiguous, key)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _scopes(database, key) == set()


def test_common_name_router_not_a_trusted_proxy_cannot_speak_for_a_caller(database: str, ca: TestCA) -> None:
    """A shard that trusts the router by its SPIFFE ID: a certificate merely named `router` is a caller
    of its own, its x-caller-id not believed."""
    server = ca.issue("shard-0", server=True)
    shard = start_shard(
        make_settings(
            database,
            dev_mode=False,
            tls_cert=str(server.cert),
            tls_key=str(server.key),
            tls_ca=str(ca.ca_path),
            trusted_proxies=(ROUTER,),
        )
    )
    try:
        key = str(new_key())
        _grpc_deposit(shard.port, ca, ca.issue("router"), key, claim=TEAM_A)
        assert _scopes(database, key) == {f"{DEPOSIT}|router"}
    finally:
        shard.stop(0.2)
