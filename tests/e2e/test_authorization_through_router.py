"""The shard's authorization policy through the router, with mTLS on both hops and certificates made
here: the router verifies the caller and speaks for it (a trusted proxy), the shard judges the caller
it names; a denial comes back through the router untouched (gRPC) or as 403 problem+json (HTTP).
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.router.server import RouterThread, start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import error_info, key_metadata, make_settings, money
from tests.tls import CertFiles, TestCA

POLICY = {
    "name": "team-a-only",
    "allow_policies": [
        {
            "name": "team-a",
            "source": {"principals": ["team-a"]},
            "request": {"paths": ["/shardrouter.v1.TransferService/*"], "accounts": ["team-a-*"]},
        }
    ],
}


@dataclass
class Setup:
    router: RouterThread
    ca: TestCA
    database: str


@pytest.fixture
def setup(database: str, tmp_path: Path) -> Iterator[Setup]:
    ca = TestCA(tmp_path)
    shard_server = ca.issue("shard-0", server=True)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    shard = start_shard(
        make_settings(
            database,
            dev_mode=False,
            tls_cert=str(shard_server.cert),
            tls_key=str(shard_server.key),
            tls_ca=str(ca.ca_path),
            authz_policy_file=str(policy),
        )
    )
    router_server = ca.issue("router.local", server=True)
    router_client = ca.issue("router")  # the name the shard trusts as a proxy
    shard_map = tmp_path / "shard-map.yaml"
    shard_map.write_text(
        yaml.safe_dump(shard_map_document(even_shard_map({"shard-0": f"127.0.0.1:{shard.port}"})))
    )
    router = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0",
            http_listen="127.0.0.1:0",
            shard_map=str(shard_map),
            metrics_port=0,
            tls_cert=str(router_server.cert),
            tls_key=str(router_server.key),
            tls_ca=str(ca.ca_path),
            shard_tls_cert=str(router_client.cert),
            shard_tls_key=str(router_client.key),
            shard_tls_ca=str(ca.ca_path),
        )
    )
    try:
        yield Setup(router, ca, database)
    finally:
        router.stop(1.0)
        shard.stop(0.2)


def _stub(setup: Setup, files: CertFiles) -> tuple[grpc.Channel, transfer_pb2_grpc.TransferServiceStub]:
    credentials = grpc.ssl_channel_credentials(
        setup.ca.ca_path.read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
    )
    channel = grpc.secure_channel(f"localhost:{setup.router.port}", credentials)
    return channel, transfer_pb2_grpc.TransferServiceStub(channel)


def _records(database: str) -> int:
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM idempotency_record").fetchone()
    assert row is not None
    return int(row[0])


def test_the_router_forwards_the_callers_identity_and_the_shards_refusal(setup: Setup) -> None:
    channel, team_a = _stub(setup, setup.ca.issue("team-a"))
    with channel:
        team_a.Deposit(
            transfer_pb2.DepositRequest(account_id="team-a-1", amount=money(5)),
            metadata=key_metadata(new_key(), "team-b"),  # a claim the router overwrites
            timeout=10,
        )
        before = _records(setup.database)
        with pytest.raises(grpc.RpcError) as refused:
            team_a.Deposit(
                transfer_pb2.DepositRequest(account_id="team-b-1", amount=money(5)),
                metadata=key_metadata(),
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        info, _ = error_info(refused.value)
        assert info.reason == "PERMISSION_DENIED"
        assert dict(info.metadata)["caller"] == "team-a" and dict(info.metadata)["account"] == "team-b-1"
        with pytest.raises(grpc.RpcError) as read:
            team_a.GetBalance(transfer_pb2.GetBalanceRequest(account_id="team-b-1"), timeout=10)
        assert read.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _records(setup.database) == before

    channel, team_b = _stub(setup, setup.ca.issue("team-b"))
    with channel, pytest.raises(grpc.RpcError) as other:
        team_b.Deposit(
            transfer_pb2.DepositRequest(account_id="team-a-1", amount=money(5)),
            metadata=key_metadata(new_key(), "team-a"),  # claiming to be team-a does not help
            timeout=10,
        )
    assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_over_http_a_denial_is_403_problem_json(setup: Setup) -> None:
    files = setup.ca.issue("team-a")
    context = ssl.create_default_context(cafile=str(setup.ca.ca_path))
    context.load_cert_chain(str(files.cert), str(files.key))
    assert setup.router.http_port
    conn = http.client.HTTPSConnection("localhost", setup.router.http_port, context=context, timeout=10)
    try:
        body = {"accountId": "team-b-1", "amount": {"amountMinor": "5", "currency": "EUR"}}
        headers = {"Content-Type": "application/json", "Idempotency-Key": str(new_key())}
        conn.request("POST", "/v1/deposits", json.dumps(body), headers)
        response = conn.getresponse()
        problem = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 403, problem
    assert "team-a" in json.dumps(problem) and "team-b-1" in json.dumps(problem)
