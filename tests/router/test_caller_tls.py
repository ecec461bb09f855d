"""Callers' TLS on both fronts of a real router process: a caller CA taken out of the bundle is
distrusted by new connections without a restart (HTTP and gRPC), and the HTTP front counts the
handshakes it refuses (`router_tls_handshake_failures_total`), by reason."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardrouter.localcluster.postgres import free_port
from tests.metrics import samples, scrape_text
from tests.processes import ROOT, ServiceProcess, router_process
from tests.router.fakeshard import single_shard_map, start_fake_shard
from tests.tls import CertFiles, TestCA, publish_like_a_secret


@dataclass
class Callers:
    first_ca: TestCA
    second_ca: TestCA
    server: CertFiles
    alice: CertFiles  # issued by the first CA
    bob: CertFiles  # issued by the second CA
    secret: Path

    def publish(self, version: str, *cas: TestCA) -> None:
        bundle = b"".join(ca.ca_path.read_bytes() for ca in cas)
        publish_like_a_secret(
            self.secret, version, self.server.cert.read_bytes(), self.server.key.read_bytes(), bundle
        )


@dataclass
class RouterUnderTest:
    process: ServiceProcess
    http_port: int
    metrics_port: int

    @property
    def grpc_address(self) -> str:
        return self.process.address

    def scrape(self) -> str:
        return scrape_text(self.metrics_port)


@pytest.fixture
def callers(tmp_path: Path) -> Callers:
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first, second = TestCA(tmp_path / "first"), TestCA(tmp_path / "second", "second caller CA")
    secret = tmp_path / "router-tls"
    secret.mkdir()
    found = Callers(
        first,
        second,
        first.issue("router.local", server=True),
        first.issue("alice"),
        second.issue("bob"),
        secret,
    )
    found.publish("v1", first, second)
    return found


@pytest.fixture
def router(callers: Callers, tmp_path: Path) -> Iterator[RouterUnderTest]:
    fake = start_fake_shard()
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(single_shard_map(fake.address)))
    http_port, metrics_port = free_port(), free_port()
    process = router_process(
        tmp_path,
        shard_map=map_path,
        extra_env={
            "ROUTER_DEV_MODE": "false",
            "ROUTER_HTTP_LISTEN": f"127.0.0.1:{http_port}",
            "ROUTER_METRICS_PORT": str(metrics_port),
            "ROUTER_TLS_CERT": str(callers.secret / "tls.crt"),
            "ROUTER_TLS_KEY": str(callers.secret / "tls.key"),
            "ROUTER_TLS_CA": str(callers.secret / "ca.crt"),
            "ROUTER_RELOAD_INTERVAL_S": "0.1",
        },
    )
    # ServiceProcess.start waits on a plaintext health check; this router speaks only TLS.
    with process.log_path.open("ab") as log:
        process.proc = subprocess.Popen(
            [sys.executable, *process.args], env=process.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
    try:
        under_test = RouterUnderTest(process, http_port, metrics_port)
        deadline = time.monotonic() + 30
        while _grpc_check(under_test, callers, callers.alice) != "SERVING":
            assert process.proc.poll() is None, process.log_text()
            assert time.monotonic() < deadline, process.log_text()
            time.sleep(0.1)
        yield under_test
    finally:
        process.kill()
        fake.stop()


def _grpc_check(router: RouterUnderTest, callers: Callers, client: CertFiles) -> str:
    """A health check over a new connection (its own subchannel pool): SERVING, or the error's code."""
    credentials = grpc.ssl_channel_credentials(
        callers.first_ca.ca_path.read_bytes(), client.key.read_bytes(), client.cert.read_bytes()
    )
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.secure_channel(router.grpc_address, credentials, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            return str(exc.code().name)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _https_status(router: RouterUnderTest, callers: Callers, client: CertFiles | None) -> int | str:
    """GET on no route over a new HTTPS connection: 404 once through the handshake, else the error."""
    context = ssl.create_default_context(cafile=str(callers.first_ca.ca_path))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    conn = http.client.HTTPSConnection("127.0.0.1", router.http_port, context=context, timeout=10)
    try:
        conn.request("GET", "/no-such-route")
        response = conn.getresponse()
        response.read()
        return response.status
    except (ssl.SSLError, ConnectionError, OSError) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def test_a_caller_ca_taken_out_of_the_bundle_is_distrusted_without_a_restart(
    callers: Callers, router: RouterUnderTest
) -> None:
    assert _https_status(router, callers, callers.alice) == 404
    assert _https_status(router, callers, callers.bob) == 404
    assert _grpc_check(router, callers, callers.bob) == "SERVING"
    # Open connections keep their handshake; this one stays open across the change.
    kept = http.client.HTTPSConnection(
        "127.0.0.1",
        router.http_port,
        context=_client_context(callers, callers.bob),
        timeout=10,
    )
    kept.request("GET", "/no-such-route")
    kept.getresponse().read()
    tls12 = _client_context(callers, callers.bob)
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2  # its session is resumable by id or ticket
    status, session, _ = _raw_get(router, tls12)
    assert status == 404 and session is not None
    assert _raw_get(router, tls12, session)[2], (
        "the router resumes sessions (else the check below proves nothing)"
    )

    callers.publish("v2", callers.first_ca)  # the second CA removed

    deadline = time.monotonic() + 10
    while (bob := _https_status(router, callers, callers.bob)) == 404 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert bob != 404, "a new HTTPS connection with the removed CA's certificate still gets through"
    assert _grpc_check(router, callers, callers.bob) == "UNAVAILABLE"  # refused at the handshake
    # Nor does resuming a session from before the removal skip the verification.
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        _raw_get(router, tls12, session)
    assert _https_status(router, callers, callers.alice) == 404
    assert _grpc_check(router, callers, callers.alice) == "SERVING"
    kept.request("GET", "/no-such-route")
    assert kept.getresponse().status == 404
    kept.close()
    assert router.process.proc is not None and router.process.proc.poll() is None  # never restarted

    callers.publish("v3", callers.first_ca, callers.second_ca)  # and trusted again when it comes back
    deadline = time.monotonic() + 10
    while _https_status(router, callers, callers.bob) != 404 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _https_status(router, callers, callers.bob) == 404
    assert _grpc_check(router, callers, callers.bob) == "SERVING"


def _client_context(callers: Callers, client: CertFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(callers.first_ca.ca_path))
    context.load_cert_chain(str(client.cert), str(client.key))
    return context


def _raw_get(
    router: RouterUnderTest, context: ssl.SSLContext, session: ssl.SSLSession | None = None
) -> tuple[int, ssl.SSLSession | None, bool]:
    """GET on no route over a new connection, offering `session` for resumption: the status, the
    session, whether it was resumed."""
    with socket.create_connection(("127.0.0.1", router.http_port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost", session=session) as sock:
            sock.sendall(b"GET /no-such-route HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            if not reply:
                raise ConnectionError("closed without an answer")
            return int(reply.split(b" ", 2)[1]), sock.session, sock.session_reused


def _failures(text: str) -> dict[str, float]:
    return {
        dict(labels)["reason"]: value
        for labels, value in samples(text, "router_tls_handshake_failures_total").items()
        if dict(labels)["protocol"] == "http"
    }


def _plain_http(router: RouterUnderTest) -> bytes:
    with socket.create_connection(("127.0.0.1", router.http_port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: router\r\n\r\n")
        try:
            return sock.recv(4096)
        except ConnectionError:
            return b""


def test_refused_handshakes_are_counted_by_reason(callers: Callers, router: RouterUnderTest) -> None:
    callers.publish("v2", callers.first_ca)
    deadline = time.monotonic() + 10
    while _https_status(router, callers, callers.bob) == 404 and time.monotonic() < deadline:
        time.sleep(0.1)
    # The handshake that ended the loop was refused; the router counts it once its side of the
    # handshake has failed, which may come after the client saw it: wait for it to be counted.
    before = _failures(router.scrape())
    while before.get("untrusted_certificate", 0.0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        before = _failures(router.scrape())

    assert _https_status(router, callers, None) != 404
    assert _https_status(router, callers, callers.bob) != 404
    assert not _plain_http(router).startswith(b"HTTP/1.1 200")
    assert _https_status(router, callers, callers.alice) == 404  # a good handshake counts nothing

    expected = {"no_certificate": 1.0, "untrusted_certificate": 1.0, "not_tls": 1.0}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = _failures(router.scrape())
        delta = {reason: value - before.get(reason, 0.0) for reason, value in after.items()}
        delta = {reason: value for reason, value in delta.items() if value}
        if delta == expected:
            break
        time.sleep(0.1)
    assert delta == expected, router.process.log_text()
