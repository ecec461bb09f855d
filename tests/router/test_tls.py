"""The router with mTLS on both sides: callers' verified identity replaces any `x-caller-id` they send.

Certificates come from the shared test CA (`tests.tls`): the router's server and client certificates,
a caller's, and a fake shard's, all for 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardrouter.core.errors import Reason
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.v1 import transfer_pb2
from tests.processes import ROOT, router_process
from tests.router.fakeshard import FakeShard, single_shard_map, start_fake_shard
from tests.tls import CertFiles, TestCA, publish_like_a_secret

GET_BALANCE = "/shardrouter.v1.TransferService/GetBalance"
REQUEST = transfer_pb2.GetBalanceRequest(account_id="acct-1").SerializeToString()


@dataclass
class Pki:
    ca: Path
    certs: dict[str, CertFiles]

    def client_credentials(self, name: str) -> grpc.ChannelCredentials:
        files = self.certs[name]
        return grpc.ssl_channel_credentials(
            self.ca.read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = TestCA(tmp_path_factory.mktemp("pki"))
    certs = {
        "router-server": ca.issue("router.local", server=True),
        "router-client": ca.issue("router"),
        "router-renewed": ca.issue("router-renewed"),
        "alice": ca.issue("alice"),
        "shard": ca.issue("shard-0", server=True),
    }
    return Pki(ca.ca_path, certs)


@pytest.fixture(scope="module")
def tls_setup(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeShard, str]]:
    tmp = tmp_path_factory.mktemp("router-tls")
    cert, key = pki.certs["shard"].cert, pki.certs["shard"].key
    fake = start_fake_shard(
        credentials=grpc.ssl_server_credentials(
            [(key.read_bytes(), cert.read_bytes())],
            root_certificates=pki.ca.read_bytes(),
            require_client_auth=True,
        )
    )
    map_path = tmp / "map.json"
    map_path.write_text(json.dumps(single_shard_map(fake.address)))
    server_cert, server_key = pki.certs["router-server"].cert, pki.certs["router-server"].key
    client_cert, client_key = pki.certs["router-client"].cert, pki.certs["router-client"].key
    router = router_process(
        tmp,
        shard_map=map_path,
        extra_env={
            "ROUTER_DEV_MODE": "false",
            "ROUTER_TLS_CERT": str(server_cert),
            "ROUTER_TLS_KEY": str(server_key),
            "ROUTER_TLS_CA": str(pki.ca),
            "ROUTER_SHARD_TLS_CERT": str(client_cert),
            "ROUTER_SHARD_TLS_KEY": str(client_key),
            "ROUTER_SHARD_TLS_CA": str(pki.ca),
        },
    )
    # ServiceProcess.start waits on a plaintext health check; this router speaks only TLS.
    with router.log_path.open("ab") as log:
        router.proc = subprocess.Popen(
            [sys.executable, *router.args], env=router.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
    try:
        _wait_serving_tls(router.address, pki.client_credentials("alice"), router)
        yield fake, router.address
    finally:
        router.kill()
        fake.stop()


def _wait_serving_tls(address: str, credentials: grpc.ChannelCredentials, router: object) -> None:
    deadline = time.monotonic() + 30
    with grpc.secure_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert router.proc.poll() is None, router.log_text()  # type: ignore[attr-defined]
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                time.sleep(0.05)
    raise TimeoutError(router.log_text())  # type: ignore[attr-defined]


def test_verified_caller_identity_overwrites_a_claimed_one(
    pki: Pki, tls_setup: tuple[FakeShard, str]
) -> None:
    fake, address = tls_setup
    fake.reset()
    with grpc.secure_channel(address, pki.client_credentials("alice")) as channel:
        call = channel.unary_unary(GET_BALANCE, request_serializer=None, response_deserializer=None)
        reply = call(
            REQUEST, metadata=[("x-caller-id", "mallory"), ("x-caller-id", "eve"), ("x-foo", "1")], timeout=5
        )
    assert reply == REQUEST
    (seen,) = fake.calls
    assert [v for k, v in seen.metadata if k == "x-caller-id"] == ["alice"]
    assert ("x-foo", "1") in seen.metadata
    assert seen.peer_common_name == "router"  # the router's client certificate, over mTLS to the shard


def test_caller_without_a_certificate_is_refused(pki: Pki, tls_setup: tuple[FakeShard, str]) -> None:
    fake, address = tls_setup
    fake.reset()
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(pki.ca.read_bytes())) as channel:
        call = channel.unary_unary(GET_BALANCE, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            call(REQUEST, metadata=[("x-caller-id", "mallory")], timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails
    assert fake.calls == []


def test_without_verified_callers_outside_dev_mode_every_call_is_refused(tmp_path: Path) -> None:
    fake = start_fake_shard()
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(single_shard_map(fake.address)))
    router = start_router_thread(
        RouterSettings(listen="127.0.0.1:0", shard_map=str(map_path), metrics_port=0)
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            call = channel.unary_unary(GET_BALANCE, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as caught:
                call(REQUEST, metadata=[("x-caller-id", "mallory")], timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (
            Reason.UNAUTHENTICATED.encode()
            in dict(caught.value.trailing_metadata())["grpc-status-details-bin"]
        )
        assert fake.calls == []
    finally:
        router.stop(0)
        fake.stop()


def _publish(folder: Path, version: str, files: CertFiles) -> None:
    publish_like_a_secret(folder, version, files.cert.read_bytes(), files.key.read_bytes())


def test_a_rotated_client_certificate_is_used_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    """The router's certificate towards the shards is re-read when its files change: calls after the
    rotation arrive over new connections that present the new certificate."""
    folder = tmp_path / "shard-client-tls"
    folder.mkdir()
    _publish(folder, "v1", pki.certs["router-client"])
    cert, key = pki.certs["shard"].cert, pki.certs["shard"].key
    fake = start_fake_shard(
        credentials=grpc.ssl_server_credentials(
            [(key.read_bytes(), cert.read_bytes())],
            root_certificates=pki.ca.read_bytes(),
            require_client_auth=True,
        )
    )
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(single_shard_map(fake.address)))
    router = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0",
            shard_map=str(map_path),
            dev_mode=True,
            metrics_port=0,
            reload_interval_s=0.1,
            shard_tls_cert=str(folder / "tls.crt"),
            shard_tls_key=str(folder / "tls.key"),
            shard_tls_ca=str(pki.ca),
        )
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            call = channel.unary_unary(GET_BALANCE, request_serializer=None, response_deserializer=None)
            assert call(REQUEST, timeout=5) == REQUEST
            _publish(folder, "v2", pki.certs["router-renewed"])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and fake.calls[-1].peer_common_name != "router-renewed":
                time.sleep(0.1)
                assert call(REQUEST, timeout=5) == REQUEST
            # A half-written rotation is skipped: calls go on with the last good certificate.
            publish_like_a_secret(folder, "v3", b"not a certificate", b"")
            time.sleep(0.5)
            assert call(REQUEST, timeout=5) == REQUEST
    finally:
        router.stop(0.5)
        fake.stop()
    names = [c.peer_common_name for c in fake.calls]
    assert names[0] == "router"
    assert names[-1] == "router-renewed", names
    assert names[-2:] == ["router-renewed", "router-renewed"]
