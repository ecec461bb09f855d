"""mTLS between callers (the router, or a service) and a shard; caller identity from the certificate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardrouter.core.keys import new_key
from shardrouter.core.tls import channel_credentials
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money
from tests.tls import TestCA, publish_like_a_secret


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


def _served_common_name(port: int, ca: TestCA, client) -> str:
    """The common name of the certificate the shard presents to a new TLS connection."""
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(ca.ca_path))
    context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            subject = dict(pair[0] for pair in tls.getpeercert()["subject"])
    return str(subject["commonName"])


def test_a_rotated_server_certificate_reaches_new_connections_without_a_restart(database, ca, tmp_path):
    folder = tmp_path / "tls"
    folder.mkdir()
    first, renewed = ca.issue("shard-0", server=True), ca.issue("shard-0-renewed", server=True)
    publish_like_a_secret(folder, "v1", first.cert.read_bytes(), first.key.read_bytes())
    daemon = start_shard(
        make_settings(
            database,
            dev_mode=False,
            tls_cert=str(folder / "tls.crt"),
            tls_key=str(folder / "tls.key"),
            tls_ca=str(ca.ca_path),
        )
    )
    client = ca.issue("team-a")
    try:
        old_channel, old_stub = _stub(daemon.port, ca, "team-a")
        _deposit(old_stub, new_key())
        assert _served_common_name(daemon.port, ca, client) == "shard-0"

        publish_like_a_secret(folder, "v2", renewed.cert.read_bytes(), renewed.key.read_bytes())
        assert _served_common_name(daemon.port, ca, client) == "shard-0-renewed"
        channel, stub = _stub(daemon.port, ca, "team-a")
        _deposit(stub, new_key())  # a new connection works with the new certificate
        _deposit(old_stub, new_key())  # and the connection made before the rotation still does

        # A broken set (a half-finished rotation) is not loaded: the last good one stays.
        publish_like_a_secret(folder, "v3", b"not a certificate", renewed.key.read_bytes())
        assert _served_common_name(daemon.port, ca, client) == "shard-0-renewed"
        _deposit(stub, new_key())
        channel.close()
        old_channel.close()
    finally:
        daemon.stop(0.2)
