"""The HTTP front over mTLS: the verified client certificate is the caller (its key scope), a caller
without one is refused at the handshake, and a renewed server certificate reaches new connections."""

from __future__ import annotations

import http.client
import json
import ssl
import time

import psycopg
import pytest
import yaml

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.shardd.server import ShardDaemon
from tests.tls import TestCA, publish_like_a_secret


def _context(ca: TestCA, client: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.ca_path))
    if client is not None:
        files = ca.issue(client)
        context.load_cert_chain(str(files.cert), str(files.key))
    return context


def _deposit(port: int, context: ssl.SSLContext, key: str, account: str) -> tuple[int, dict, int]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        body = {"accountId": account, "amount": {"amountMinor": "10", "currency": "EUR"}}
        conn.request("POST", "/v1/deposits", json.dumps(body), {"Content-Type": "application/json", "Idempotency-Key": key})
        response = conn.getresponse()
        cert = conn.sock.getpeercert()
        assert cert is not None
        return response.status, json.loads(response.read()), int(cert["serialNumber"], 16)
    finally:
        conn.close()


def test_https_caller_identity_refusal_and_certificate_renewal(shard: ShardDaemon, database: str, tmp_path) -> None:
    ca = TestCA(tmp_path)
    first = ca.issue("router.local", server=True)
    secret = tmp_path / "router-tls"
    secret.mkdir()
    publish_like_a_secret(secret, "v1", first.cert.read_bytes(), first.key.read_bytes(), ca.ca_path.read_bytes())
    shard_map = tmp_path / "shard-map.yaml"
    shard_map.write_text(yaml.safe_dump(shard_map_document(even_shard_map({"shard-0": f"127.0.0.1:{shard.port}"}))))
    router = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0",
            http_listen="127.0.0.1:0",
            shard_map=str(shard_map),
            metrics_port=0,
            tls_cert=str(secret / "tls.crt"),
            tls_key=str(secret / "tls.key"),
            tls_ca=str(secret / "ca.crt"),
            reload_interval_s=0.1,
        )
    )
    try:
        key = str(new_key())
        status, _, serial = _deposit(router.http_port, _context(ca, "alice-billing"), key, "tls-acct")
        assert status == 201
        # The same key from another verified caller is another operation (its own scope).
        other, _, _ = _deposit(router.http_port, _context(ca, "bob-payroll"), key, "tls-acct")
        assert other == 201
        with psycopg.connect(database) as conn:
            scopes = {r[0].rsplit("|", 1)[1] for r in conn.execute(
                "SELECT scope FROM idempotency_record WHERE key = %s", (key,)
            ).fetchall()}
        assert scopes == {"alice-billing", "bob-payroll"}
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            _deposit(router.http_port, _context(ca, None), str(new_key()), "tls-acct")
        renewed = ca.issue("router-renewed.local", server=True)
        publish_like_a_secret(secret, "v2", renewed.cert.read_bytes(), renewed.key.read_bytes(), ca.ca_path.read_bytes())
        deadline = time.monotonic() + 10
        seen = serial
        while seen == serial and time.monotonic() < deadline:  # the router looks every 0.1 s
            _, _, seen = _deposit(router.http_port, _context(ca, "alice-billing"), str(new_key()), "tls-acct")
        assert seen != serial, "new connections still get the old certificate"
    finally:
        router.stop(1.0)
