"""The authorization policy in a real `shardd` process: a policy file swapped as a ConfigMap swaps it
takes effect within seconds, a broken one is refused (its metric on /metrics, a WARNING in the log)
and the last good one stays; denials are logged with caller, method and account, never the body.

Dev mode (no TLS) so the `x-caller-id` entry is the caller; `test_authorization.py` has the mTLS cases.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from shardrouter.core.keys import new_key
from shardrouter.localcluster.postgres import free_port
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, money
from tests.metrics import scrape_text
from tests.processes import ServiceProcess, shardd_process


def _policy(name: str, accounts: list[str]) -> str:
    return json.dumps(
        {
            "name": name,
            "allow_policies": [
                {
                    "name": "svc",
                    "source": {"principals": ["svc"]},
                    "request": {"paths": ["/shardrouter.v1.TransferService/*"], "accounts": accounts},
                }
            ],
        }
    )


def _publish(folder: Path, version: str, text: str) -> None:
    """Write the policy as a Kubernetes ConfigMap volume updates: a new folder, the `..data` link swapped."""
    (folder / version).mkdir()
    (folder / version / "policy.json").write_text(text)
    (folder / "..data_tmp").symlink_to(version)
    os.replace(folder / "..data_tmp", folder / "..data")
    if not (folder / "policy.json").is_symlink():
        (folder / "policy.json").symlink_to(Path("..data") / "policy.json")


@pytest.fixture
def daemon(database: str, tmp_path: Path) -> Iterator[tuple[ServiceProcess, Path, int]]:
    folder = tmp_path / "authz"
    folder.mkdir()
    _publish(folder, "v1", _policy("first", ["a-*"]))
    metrics_port = free_port()
    process = shardd_process(
        tmp_path,
        shard_id="shard-0",
        dsn=database,
        extra_env={
            "SHARDD_AUTHZ_POLICY_FILE": str(folder / "policy.json"),
            "SHARDD_AUTHZ_POLICY_RELOAD_S": "0.2",
            "SHARDD_METRICS_PORT": str(metrics_port),
            "SHARDD_LOG_FORMAT": "text",
        },
    )
    process.start()
    try:
        yield process, folder, metrics_port
    finally:
        process.terminate()


def _deposit(address: str, account: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
                transfer_pb2.DepositRequest(account_id=account, amount=money(5), reference="body-secret-77"),
                metadata=key_metadata(new_key(), "svc"),
                timeout=5,
            )
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _within(seconds: float, check: Callable[[], bool]) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, "not within the bound"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_swapped_policy_takes_effect_and_a_broken_one_is_refused(daemon) -> None:  # type: ignore[no-untyped-def]
    process, folder, metrics_port = daemon
    assert _deposit(process.address, "a-1") == grpc.StatusCode.OK
    assert _deposit(process.address, "b-1") == grpc.StatusCode.PERMISSION_DENIED

    _publish(folder, "v2", _policy("second", ["a-*", "b-*"]))
    took = _within(5, lambda: _deposit(process.address, "b-1") == grpc.StatusCode.OK)
    assert took < 5
    assert 'shardd_authz_policy_info{hash="' in scrape_text(metrics_port)
    assert 'name="second"' in scrape_text(metrics_port)

    _publish(
        folder,
        "v3",
        '{"name": "third", "allow_policies": [{"name": "svc", "source": {"principals": "svc"}}]}',
    )
    _within(5, lambda: 'shardd_authz_policy_reloads_total{result="refused"} 1.0' in scrape_text(metrics_port))
    assert _deposit(process.address, "b-2") == grpc.StatusCode.OK  # the last good policy stays
    assert _deposit(process.address, "c-1") == grpc.StatusCode.PERMISSION_DENIED

    log = process.log_text()
    assert "authorization policy reload refused, keeping policy 'second'" in log
    assert "allow_policies[0].source.principals: expected a list, got str" in log
    assert "caller svc may not call /shardrouter.v1.TransferService/Deposit on account c-1" in log
    assert "body-secret-77" not in log
