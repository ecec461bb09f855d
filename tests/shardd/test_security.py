"""mTLS between callers (the router, or a service) and a shard; caller identity from the certificate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardd.server import ShardDaemon, start_shard
from shardrouter.grpcserver import channel_credentials
from shardrouter.keys import new_key
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.conftest import key_metadata, make_settings, money
from tests.tls import TestCA


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path)


@pytest.fixture
def tls_shard(database: str, ca: TestCA) -> Iterator[ShardDaemon]:
    server = ca.issue("shard-0", server=True)
    daemon = start_shard(
        make_settings(
            database,
            dev_mode=False,
            tls_cert=str(server.cert),
            tls_key=str(server.key),
            tls_ca=str(ca.ca_path),
        )
    )
    yield daemon
    daemon.stop(0.2)


def _stub(
    port: int, ca: TestCA, name: str | None
) -> tuple[grpc.Channel, transfer_pb2_grpc.TransferServiceStub]:
    files = ca.issue(name) if name else None
    creds = channel_credentials(
        str(files.cert) if files else "", str(files.key) if files else "", str(ca.ca_path)
    )
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds)
    return channel, transfer_pb2_grpc.TransferServiceStub(channel)


def _deposit(stub, key, caller=None, amount=5):
    return stub.Deposit.with_call(
        transfer_pb2.DepositRequest(account_id="alice", amount=money(amount)),
        metadata=key_metadata(key, caller),
        timeout=5,
    )


def test_plaintext_and_certificate_less_callers_are_refused(tls_shard, ca):
    with grpc.insecure_channel(f"127.0.0.1:{tls_shard.port}") as plain:
        with pytest.raises(grpc.RpcError) as info:
            transfer_pb2_grpc.TransferServiceStub(plain).Deposit(
                transfer_pb2.DepositRequest(account_id="a", amount=money(1)),
                metadata=key_metadata(),
                timeout=3,
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    channel, stub = _stub(tls_shard.port, ca, None)
    with channel, pytest.raises(grpc.RpcError) as info:
        _deposit(stub, new_key())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # handshake fails: no client certificate


def test_identity_comes_from_the_certificate_not_the_header(tls_shard, ca, db):
    key = new_key()
    ch_a, team_a = _stub(tls_shard.port, ca, "team-a")
    ch_b, team_b = _stub(tls_shard.port, ca, "team-b")
    with ch_a, ch_b:
        first, _ = _deposit(team_a, key, amount=5)
        # team-b reuses team-a's key and even claims to be team-a: it gets its own operation, not a replay.
        other, call = _deposit(team_b, key, caller="team-a", amount=5)
        assert dict(call.trailing_metadata()).get("idempotency-replayed") is None
        assert other.entry_id != first.entry_id
        # team-b cannot learn team-a's stored response (a different body with the key is its own, too).
        mine, _ = _deposit(team_b, new_key(), caller="team-a", amount=7)
        assert mine.balance.amount_minor == 17
    scopes = sorted(r[0] for r in db.execute("SELECT scope FROM idempotency_record"))
    assert scopes == [
        "/shardrouter.v1.TransferService/Deposit|team-a",
        "/shardrouter.v1.TransferService/Deposit|team-b",
        "/shardrouter.v1.TransferService/Deposit|team-b",
    ]


def test_a_trusted_proxy_may_speak_for_the_caller_it_authenticated(tls_shard, ca, db):
    channel, router = _stub(tls_shard.port, ca, "router")
    with channel:
        _deposit(router, new_key(), caller="team-c")
    assert [r[0] for r in db.execute("SELECT scope FROM idempotency_record")] == [
        "/shardrouter.v1.TransferService/Deposit|team-c"
    ]


def test_without_tls_outside_dev_mode_every_call_is_unauthenticated(database):
    daemon = start_shard(make_settings(database, dev_mode=False))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
                    transfer_pb2.DepositRequest(account_id="a", amount=money(1)),
                    metadata=key_metadata(caller="x"),
                )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        daemon.stop(0.2)
