"""The shard's authorization policy, enforced on a real daemon with mTLS and certificates made here.

A caller allowed on some accounts is refused on others (Deposit, Transfer, GetBalance, the internal
API) with PERMISSION_DENIED and reason PERMISSION_DENIED, and nothing is stored: no idempotency record,
no ledger entry. A trusted proxy (the router) is judged by the caller it speaks for. A new policy file
takes effect within seconds; a broken one is refused and the last good one stays, as the metrics show.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
import yaml
from prometheus_client import generate_latest

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.core.tls import channel_credentials
from shardrouter.internal.v1 import ledger_pb2, ledger_pb2_grpc
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd.authorization_policy import AuthzPolicyError
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import error_info, key_metadata, make_settings, money
from tests.tls import TestCA

TEAM_A_ONLY = {
    "name": "team-a-only",
    "allow_policies": [
        {
            "name": "team-a",
            "source": {"principals": ["team-a"]},
            "request": {"paths": ["/shardrouter.v1.TransferService/*"], "accounts": ["team-a-*"]},
        },
        {
            "name": "shards",
            "source": {"principals": ["shard-*"]},
            "request": {"paths": ["/shardrouter.internal.v1.ShardLedgerService/*"]},
        },
    ],
}


@dataclass
class Lab:
    daemon: ShardDaemon
    ca: TestCA
    policy_path: Path
    db: psycopg.Connection[Any]
    channels: list[grpc.Channel]

    def stub(self, name: str) -> transfer_pb2_grpc.TransferServiceStub:
        return transfer_pb2_grpc.TransferServiceStub(self._channel(name))

    def ledger(self, name: str) -> ledger_pb2_grpc.ShardLedgerServiceStub:
        return ledger_pb2_grpc.ShardLedgerServiceStub(self._channel(name))

    def _channel(self, name: str) -> grpc.Channel:
        files = self.ca.issue(name)
        creds = channel_credentials(str(files.cert), str(files.key), str(self.ca.ca_path))
        channel = grpc.secure_channel(f"127.0.0.1:{self.daemon.port}", creds)
        self.channels.append(channel)
        return channel

    def stored(self) -> tuple[int, int]:
        """Idempotency records and ledger entries."""
        records = self.db.execute("SELECT count(*) FROM idempotency_record").fetchone()
        entries = self.db.execute("SELECT count(*) FROM ledger_entries").fetchone()
        assert records is not None and entries is not None
        return int(records[0]), int(entries[0])

    def metrics(self) -> str:
        assert self.daemon.metrics is not None
        return generate_latest(self.daemon.metrics.registry).decode()

    def write_policy(self, document: object) -> None:
        tmp = self.policy_path.with_suffix(".tmp")
        tmp.write_text(document if isinstance(document, str) else json.dumps(document))
        tmp.replace(self.policy_path)


@pytest.fixture
def lab(database: str, tmp_path: Path) -> Iterator[Lab]:
    ca = TestCA(tmp_path)
    server = ca.issue("shard-0", server=True)
    policy_path = tmp_path / "policy.json"
    policy_path.write_text(json.dumps(TEAM_A_ONLY))
    daemon = start_shard(
        make_settings(
            database,
            dev_mode=False,
            tls_cert=str(server.cert),
            tls_key=str(server.key),
            tls_ca=str(ca.ca_path),
            authz_policy_file=str(policy_path),
            authz_policy_reload_s=0.1,
            metrics_port=free_port(),
        )
    )
    conn = psycopg.connect(database, autocommit=True)
    lab = Lab(daemon, ca, policy_path, conn, [])
    try:
        yield lab
    finally:
        for channel in lab.channels:
            channel.close()
        conn.close()
        daemon.stop(0.2)


def _denied(error: pytest.ExceptionInfo[grpc.RpcError], caller: str, method: str, account: str) -> None:
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info, retryable = error_info(error.value)
    assert info.reason == "PERMISSION_DENIED" and not retryable
    assert dict(info.metadata) == {"caller": caller, "method": method, "account": account}
    message = error.value.details() or ""
    assert caller in message and method in message and account in message


def _deposit(stub: transfer_pb2_grpc.TransferServiceStub, account: str, caller: str | None = None) -> Any:
    return stub.Deposit(
        transfer_pb2.DepositRequest(account_id=account, amount=money(50)),
        metadata=key_metadata(new_key(), caller),
        timeout=5,
    )


def test_a_caller_allowed_on_some_accounts_is_refused_on_others(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    team_a = lab.stub("team-a")
    assert _deposit(team_a, "team-a-1").balance.amount_minor == 50
    before = lab.stored()

    with caplog.at_level(logging.WARNING, logger="shardrouter.shardd.authorization"):
        with pytest.raises(grpc.RpcError) as deposit:
            _deposit(team_a, "team-b-1")
    _denied(deposit, "team-a", "/shardrouter.v1.TransferService/Deposit", "team-b-1")
    assert any(
        "team-a" in r.getMessage() and "team-b-1" in r.getMessage() and "Deposit" in r.getMessage()
        for r in caplog.records
    )

    with pytest.raises(grpc.RpcError) as transfer:
        team_a.Transfer(
            transfer_pb2.TransferRequest(
                source_account_id="team-b-1", destination_account_id="team-a-1", amount=money(1)
            ),
            metadata=key_metadata(),
            timeout=5,
        )
    _denied(transfer, "team-a", "/shardrouter.v1.TransferService/Transfer", "team-b-1")

    with pytest.raises(grpc.RpcError) as balance:
        team_a.GetBalance(transfer_pb2.GetBalanceRequest(account_id="team-b-1"), timeout=5)
    _denied(balance, "team-a", "/shardrouter.v1.TransferService/GetBalance", "team-b-1")
    assert lab.stored() == before  # no idempotency record, no ledger entry

    # The source account's rule decides a transfer: team-a may pay into an account it may not touch.
    lab.db.execute("INSERT INTO accounts (id, currency) VALUES ('team-b-2', 'EUR')")
    done = team_a.Transfer(
        transfer_pb2.TransferRequest(
            source_account_id="team-a-1", destination_account_id="team-b-2", amount=money(1)
        ),
        metadata=key_metadata(),
        timeout=5,
    )
    assert done.transfer.transfer_id
    assert (
        team_a.GetBalance(
            transfer_pb2.GetBalanceRequest(account_id="team-a-1"), timeout=5
        ).balance.amount_minor
        == 49
    )

    # Another caller with a valid certificate may do nothing at all here.
    with pytest.raises(grpc.RpcError) as other:
        _deposit(lab.stub("team-b"), "team-a-1")
    _denied(other, "team-b", "/shardrouter.v1.TransferService/Deposit", "team-a-1")

    text = lab.metrics()
    assert 'shardd_authz_decisions_total{method="Deposit",outcome="denied"} 2.0' in text
    assert 'shardd_authz_decisions_total{method="Deposit",outcome="allowed"} 1.0' in text
    assert 'shardd_authz_policy_info{hash="' in text and 'name="team-a-only"' in text


def test_a_trusted_proxy_is_judged_by_the_caller_it_speaks_for(lab: Lab) -> None:
    router = lab.stub("router")
    assert _deposit(router, "team-a-7", caller="team-a").balance.amount_minor == 50
    with pytest.raises(grpc.RpcError) as refused:
        _deposit(router, "team-b-7", caller="team-a")
    _denied(refused, "team-a", "/shardrouter.v1.TransferService/Deposit", "team-b-7")
    with pytest.raises(grpc.RpcError) as itself:
        _deposit(router, "team-a-7")  # the router's own name is no caller of the policy
    assert itself.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_internal_api_is_for_shards_only(lab: Lab) -> None:
    lab.db.execute("INSERT INTO accounts (id, currency) VALUES ('team-a-1', 'EUR')")
    request = ledger_pb2.CreditTransferRequest(
        transfer_id=str(new_key()),
        destination_account_id="team-a-1",
        amount=money(5),
        source_shard_id="shard-9",
        source_account_id="far-1",
    )
    before = lab.stored()
    with pytest.raises(grpc.RpcError) as refused:
        lab.ledger("team-a").CreditTransfer(request, metadata=key_metadata(), timeout=5)
    _denied(refused, "team-a", "/shardrouter.internal.v1.ShardLedgerService/CreditTransfer", "team-a-1")
    assert lab.stored() == before
    lab.ledger("shard-1").CreditTransfer(request, metadata=key_metadata(), timeout=5)
    assert lab.stored() != before


def _poll(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "the policy change did not take effect in time"
        time.sleep(0.05)


def test_a_new_policy_takes_effect_and_a_broken_one_keeps_the_last_good(lab: Lab) -> None:
    team_b = lab.stub("team-b")
    with pytest.raises(grpc.RpcError):
        _deposit(team_b, "team-b-1")
    widened = json.loads(json.dumps(TEAM_A_ONLY))
    widened["name"] = "team-a-and-b"
    widened["allow_policies"][0]["source"]["principals"] = ["team-a", "team-b"]
    widened["allow_policies"][0]["request"]["accounts"] = ["team-a-*", "team-b-*"]
    started = time.monotonic()
    lab.write_policy(widened)
    _poll(lambda: _deposit(team_b, "team-b-1").balance.amount_minor > 0)
    assert time.monotonic() - started < 5
    assert 'shardd_authz_policy_reloads_total{result="loaded"} 2.0' in lab.metrics()

    lab.write_policy('{"name": "broken", "allow_policies": [{"name": "x", "request": {"headers": []}}]}')
    _poll(lambda: 'shardd_authz_policy_reloads_total{result="refused"} 1.0' in lab.metrics())
    assert _deposit(team_b, "team-b-1").balance.amount_minor == 100  # the last good policy stays
    assert lab.daemon.policies is not None and lab.daemon.policies.current.name == "team-a-and-b"
    assert 'name="team-a-and-b"' in lab.metrics()

    lab.policy_path.unlink()  # gone: refused too, still the last good one
    _poll(lambda: 'shardd_authz_policy_reloads_total{result="refused"} 2.0' in lab.metrics())
    assert _deposit(team_b, "team-b-2").balance.amount_minor == 50


def test_production_mode_needs_a_valid_policy(database: str, tmp_path: Path) -> None:
    with pytest.raises(AuthzPolicyError, match=r"authz_policy_file \(SHARDD_AUTHZ_POLICY_FILE"):
        start_shard(make_settings(database, dev_mode=False, authz_policy_file=""))
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "p", "allow_policies": [{"name": "a", "source": {"principals": [1]}}]}')
    with pytest.raises(
        AuthzPolicyError, match=r"allow_policies\[0\]\.source\.principals\[0\]: expected a string"
    ):
        start_shard(make_settings(database, dev_mode=False, authz_policy_file=str(bad)))


def test_dev_mode_without_a_policy_allows_everything_and_says_so(
    database: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shardrouter.shardd.server"):
        daemon = start_shard(make_settings(database))
    try:
        warnings = [r.getMessage() for r in caplog.records if "authorization policy" in r.getMessage()]
        assert len(warnings) == 1 and "every caller may call every method" in warnings[0]
        assert daemon.policies is None
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            assert _deposit(stub, "anyone", caller="whoever").balance.amount_minor == 50
    finally:
        daemon.stop(0.2)


def test_a_cross_shard_credit_is_sent_with_the_relays_own_identity(
    postgres: LocalPostgres, tmp_path: Path
) -> None:
    """The source account's rule decides the transfer; the destination's CreditTransfer is the source
    shard relay's own call, made with its shard certificate ("shard-0"), which the policy allows."""
    ca = TestCA(tmp_path)
    policy_path = tmp_path / "policy.json"
    policy_path.write_text(json.dumps(TEAM_A_ONLY))
    ports = {sid: free_port() for sid in ("shard-0", "shard-1")}
    shard_map = even_shard_map({sid: f"127.0.0.1:{port}" for sid, port in ports.items()})
    map_path = tmp_path / "shard-map.yaml"
    map_path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    daemons: dict[str, ShardDaemon] = {}
    dsns: dict[str, str] = {}
    try:
        for sid, port in ports.items():
            name = f"x{uuid.uuid4().hex[:10]}"
            postgres.create_database(name)
            dsns[sid] = postgres.dsn_for(name)
            files = ca.issue(sid, server=True, client=True)
            daemons[sid] = start_shard(
                make_settings(
                    dsns[sid],
                    shard_id=sid,
                    listen=f"127.0.0.1:{port}",
                    shard_map=str(map_path),
                    dev_mode=False,
                    tls_cert=str(files.cert),
                    tls_key=str(files.key),
                    tls_ca=str(ca.ca_path),
                    authz_policy_file=str(policy_path),
                    relay_workers=1 if sid == "shard-0" else 0,
                    relay_call_timeout_s=2.0,
                )
            )
        src = next(f"team-a-{i}" for i in range(1000) if shard_map.shard_for(f"team-a-{i}").id == "shard-0")
        dst = next(f"team-b-{i}" for i in range(1000) if shard_map.shard_for(f"team-b-{i}").id == "shard-1")
        with psycopg.connect(dsns["shard-1"], autocommit=True) as conn:
            conn.execute("INSERT INTO accounts (id, currency) VALUES (%s, 'EUR')", (dst,))
        client = ca.issue("team-a")
        creds = channel_credentials(str(client.cert), str(client.key), str(ca.ca_path))
        with grpc.secure_channel(f"127.0.0.1:{ports['shard-0']}", creds) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            _deposit(stub, src)
            transfer = stub.Transfer(
                transfer_pb2.TransferRequest(
                    source_account_id=src, destination_account_id=dst, amount=money(20)
                ),
                metadata=key_metadata(),
                timeout=5,
            ).transfer
            done = stub.GetTransfer(
                transfer_pb2.GetTransferRequest(
                    transfer_id=transfer.transfer_id, source_account_id=src, wait_for_completion_ms=15_000
                ),
                timeout=20,
            ).transfer
        assert done.state == transfer_pb2.TRANSFER_STATE_COMPLETED
        with psycopg.connect(dsns["shard-1"], autocommit=True) as conn:
            row = conn.execute("SELECT balance FROM accounts WHERE id = %s", (dst,)).fetchone()
            scope = conn.execute("SELECT scope FROM idempotency_record").fetchone()
        assert row == (20,)
        assert scope is not None and str(scope[0]).endswith("|shard-0")  # the relay's own identity
    finally:
        for daemon in daemons.values():
            daemon.stop(0.2)
