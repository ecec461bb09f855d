"""The outbox relay's client certificate follows rotation without a restart.

Two real shard daemons in this process, each with its own database, with mTLS from Secret-like
folders (`tls.crt`, `tls.key`, `ca.crt` behind a `..data` symlink that an update swaps atomically).
The renewal moves both shards to a new CA: a shard then trusts only certificates of the new CA, so
the relay's old certificate really stops working at its next connection (forced by restarting the
receiving shard). (A relay that read its certificate only once would stall the credit there.)
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml

from shardrouter.core.shardmap import ShardMap, even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd import relay
from shardrouter.shardd.relay import ShardClients
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money
from tests.tls import TestCA, publish_like_a_secret

CREDIT = "/shardrouter.internal.v1.ShardLedgerService/CreditTransfer"
SHARDS = ("shard-0", "shard-1")


def _issue(ca: TestCA, common_name: str) -> tuple[bytes, bytes]:
    """A shard's certificate (server and client auth: the relay presents it to the other shards)."""
    files = ca.issue(common_name, server=True, client=True)
    return files.cert.read_bytes(), files.key.read_bytes()


@dataclass
class TlsShards:
    shard_map: ShardMap
    map_path: Path
    folders: dict[str, Path]
    dsns: dict[str, str]
    ports: dict[str, int]
    daemons: dict[str, ShardDaemon]

    def start(self, shard_id: str) -> None:
        folder = self.folders[shard_id]
        self.daemons[shard_id] = start_shard(
            make_settings(
                self.dsns[shard_id],
                shard_id=shard_id,
                listen=f"127.0.0.1:{self.ports[shard_id]}",
                shard_map=str(self.map_path),
                dev_mode=False,
                tls_cert=str(folder / "tls.crt"),
                tls_key=str(folder / "tls.key"),
                tls_ca=str(folder / "ca.crt"),
                relay_workers=1 if shard_id == "shard-0" else 0,  # shard-0's relay delivers the credits
                relay_call_timeout_s=2.0,
            )
        )

    def restart(self, shard_id: str) -> None:
        """Stop and start a shard on its port: every connection to it must be made again."""
        self.daemons.pop(shard_id).stop(0.2)
        self.start(shard_id)

    def account(self, shard_id: str) -> str:
        return next(f"acct-{i}" for i in range(1000) if self.shard_map.shard_for(f"acct-{i}").id == shard_id)

    def db(self, shard_id: str) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.dsns[shard_id], autocommit=True)


@pytest.fixture
def tls_shards(postgres: LocalPostgres, tmp_path: Path) -> Iterator[tuple[TlsShards, TestCA]]:
    ca_folder = tmp_path / "ca-1"
    ca_folder.mkdir()
    ca = TestCA(ca_folder)
    ports = {sid: free_port() for sid in SHARDS}
    shard_map = even_shard_map({sid: f"127.0.0.1:{port}" for sid, port in ports.items()})
    map_path = tmp_path / "shard-map.yaml"
    map_path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    folders, dsns = {}, {}
    for sid in SHARDS:
        folders[sid] = tmp_path / f"{sid}-tls"
        folders[sid].mkdir()
        publish_like_a_secret(folders[sid], "v1", *_issue(ca, sid), ca.ca_path.read_bytes())
        name = f"x{uuid.uuid4().hex[:10]}"
        postgres.create_database(name)
        dsns[sid] = postgres.dsn_for(name)
    cluster = TlsShards(shard_map, map_path, folders, dsns, ports, {})
    try:
        for sid in SHARDS:
            cluster.start(sid)
        yield cluster, ca
    finally:
        for daemon in cluster.daemons.values():
            daemon.stop(0.2)


def _caller(ca: TestCA, port: int, name: str) -> tuple[grpc.Channel, transfer_pb2_grpc.TransferServiceStub]:
    """A caller of one shard with a client certificate of `ca`."""
    files = ca.issue(name)
    creds = grpc.ssl_channel_credentials(
        ca.ca_path.read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
    )
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds)
    return channel, transfer_pb2_grpc.TransferServiceStub(channel)


def _deposit(cluster: TlsShards, ca: TestCA, account: str, amount: int) -> None:
    channel, stub = _caller(ca, cluster.ports[cluster.shard_map.shard_for(account).id], "team-a")
    with channel:
        stub.Deposit(
            transfer_pb2.DepositRequest(account_id=account, amount=money(amount)),
            metadata=key_metadata(),
            timeout=5,
        )


def _transfer(cluster: TlsShards, ca: TestCA, src: str, dst: str, amount: int) -> uuid.UUID:
    channel, stub = _caller(ca, cluster.ports["shard-0"], "team-a")
    with channel:
        transfer = stub.Transfer(
            transfer_pb2.TransferRequest(
                source_account_id=src, destination_account_id=dst, amount=money(amount)
            ),
            metadata=key_metadata(),
            timeout=5,
        ).transfer
    assert transfer.state == transfer_pb2.TRANSFER_STATE_PENDING
    return uuid.UUID(transfer.transfer_id)


def _wait_delivered(cluster: TlsShards, transfer_id: uuid.UUID, timeout_s: float = 15.0) -> None:
    """Wait for shard-0's relay to have the credit delivered (the transfer is completed)."""
    deadline = time.monotonic() + timeout_s
    with cluster.db("shard-0") as conn:
        while True:
            state = conn.execute("SELECT state FROM transfers WHERE id = %s", (transfer_id,)).fetchone()
            if state == ("completed",):
                return
            if time.monotonic() > deadline:
                attempts = conn.execute(
                    "SELECT status_code, message FROM delivery_attempts WHERE transfer_id = %s ORDER BY id",
                    (transfer_id,),
                ).fetchall()
                raise AssertionError(f"credit of {transfer_id} not delivered in {timeout_s} s: {attempts}")
            time.sleep(0.05)


def _credited_by(cluster: TlsShards, transfer_id: uuid.UUID) -> str:
    """The common name of the certificate that delivered a credit (the caller in the key's scope)."""
    with cluster.db("shard-1") as conn:
        row = conn.execute(
            "SELECT r.scope FROM ledger_entries e JOIN idempotency_record r ON r.key = e.idempotency_key"
            " WHERE e.transfer_id = %s AND e.kind = 'transfer_in'",
            (transfer_id,),
        ).fetchone()
    assert row is not None, f"no credit of {transfer_id} on shard-1"
    return str(row[0]).rsplit("|", 1)[1]


def test_credits_are_delivered_with_the_renewed_certificate_after_a_rotation(
    tls_shards: tuple[TlsShards, TestCA], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster, old_ca = tls_shards
    src, dst = cluster.account("shard-0"), cluster.account("shard-1")
    _deposit(cluster, old_ca, src, 1000)
    _deposit(cluster, old_ca, dst, 1)
    first = _transfer(cluster, old_ca, src, dst, 100)
    _wait_delivered(cluster, first)
    assert _credited_by(cluster, first) == "shard-0"

    # Renewal onto a new CA, as Kubernetes updates both shards' Secrets. The servers follow at their next
    # handshake; from now on a shard accepts only certificates of the new CA.
    ca_folder = tmp_path / "ca-2"
    ca_folder.mkdir()
    new_ca = TestCA(ca_folder)
    renewed = _issue(new_ca, "shard-0-renewed")
    publish_like_a_secret(cluster.folders["shard-0"], "v2", *renewed, new_ca.ca_path.read_bytes())
    publish_like_a_secret(
        cluster.folders["shard-1"], "v2", *_issue(new_ca, "shard-1-renewed"), new_ca.ca_path.read_bytes()
    )
    # The receiving shard restarts (a rollout, a node drain): the relay must connect again, and the old
    # certificate is refused there. The relay's connection to it before the restart is gone.
    cluster.restart("shard-1")
    second = _transfer(cluster, new_ca, src, dst, 200)
    _wait_delivered(cluster, second)
    assert _credited_by(cluster, second) == "shard-0-renewed"

    # A half-written renewal (the certificate not yet a certificate) is skipped: the relay keeps the last
    # good certificate, also for the new connection the next restart of the receiver forces.
    caplog.clear()
    publish_like_a_secret(
        cluster.folders["shard-0"], "v3", b"not a certificate", renewed[1], new_ca.ca_path.read_bytes()
    )
    cluster.restart("shard-1")
    time.sleep(relay._CERT_POLL_S + 0.1)  # the relay's next call checks the files again
    third = _transfer(cluster, new_ca, src, dst, 300)
    _wait_delivered(cluster, third)
    assert _credited_by(cluster, third) == "shard-0-renewed"
    skipped = [r.getMessage() for r in caplog.records if "TLS client certificate" in r.getMessage()]
    assert skipped and all("cannot be loaded yet" in message for message in skipped), skipped

    with cluster.db("shard-1") as conn:
        assert conn.execute("SELECT balance FROM accounts WHERE id = %s", (dst,)).fetchone() == (601,)


class _SlowLedger(grpc.GenericRpcHandler):
    """CreditTransfer that records the caller's certificate name and holds a request b"slow" a while."""

    def __init__(self) -> None:
        self.callers: list[tuple[bytes, str]] = []
        self.slow_started = threading.Event()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method != CREDIT:
            return None

        def credit(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.callers.append((request, context.auth_context()["x509_common_name"][0].decode()))
            if request == b"slow":
                self.slow_started.set()
                time.sleep(1.5)
            return b""

        return grpc.unary_unary_rpc_method_handler(credit)


def test_a_call_in_flight_during_a_rotation_finishes_on_the_old_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "_CERT_POLL_S", 0.05)
    ca = TestCA(tmp_path)
    server_cert, server_key = _issue(ca, "shard-1")
    ledger = _SlowLedger()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((ledger,))
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials(
            [(server_key, server_cert)], root_certificates=ca.ca_path.read_bytes(), require_client_auth=True
        ),
    )
    server.start()
    folder = tmp_path / "shard-0-tls"
    folder.mkdir()
    publish_like_a_secret(folder, "v1", *_issue(ca, "shard-0"), ca.ca_path.read_bytes())
    settings = make_settings(
        "postgresql://unused",
        tls_cert=str(folder / "tls.crt"),
        tls_key=str(folder / "tls.key"),
        tls_ca=str(folder / "ca.crt"),
        relay_call_timeout_s=5.0,
    )
    shard_map = even_shard_map({"shard-1": f"127.0.0.1:{port}"})
    clients = ShardClients(settings, lambda: shard_map)
    try:
        with futures.ThreadPoolExecutor(max_workers=1) as pool:
            slow = pool.submit(clients.call, "shard-1", "CreditTransfer", b"slow", uuid.uuid4(), 5.0)
            assert ledger.slow_started.wait(5)
            publish_like_a_secret(folder, "v2", *_issue(ca, "shard-0-renewed"), ca.ca_path.read_bytes())
            time.sleep(0.1)
            fast = clients.call("shard-1", "CreditTransfer", b"fast", uuid.uuid4(), 5.0)
            assert fast == (grpc.StatusCode.OK, "")
            assert slow.result(5) == (grpc.StatusCode.OK, "")  # not cancelled by the rotation
    finally:
        clients.close()
        server.stop(0)
    assert ledger.callers == [(b"slow", "shard-0"), (b"fast", "shard-0-renewed")]
