"""A caller that dies is finished by `shard-router resume` with the same key: applied exactly once."""

from __future__ import annotations

import signal
from pathlib import Path

from shardrouter.client import OperationState, SqliteOperationStore
from shardrouter.shardd.server import ShardDaemon
from shardrouter.v1 import transfer_pb2_grpc
from tests.client.cli_helpers import balance_of, cli, crash_helper, ledger_count
from tests.helpers import deposit


def _setup(stub: transfer_pb2_grpc.TransferServiceStub) -> None:
    deposit(stub, "alice", 10_000)
    deposit(stub, "bob", 1)


def _op_line(stdout: str) -> tuple[str, str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("op "))
    _, op_id, key = line.split()
    return op_id, key


def test_killed_before_sending_then_resumed_applies_once(
    shard: ShardDaemon, stub: transfer_pb2_grpc.TransferServiceStub, database: str, tmp_path: Path
) -> None:
    _setup(stub)
    target, store = f"127.0.0.1:{shard.port}", tmp_path / "ops.db"
    crashed = crash_helper(tmp_path, "before-send", store, target, "alice", "bob", "2500")
    assert crashed.code == -signal.SIGKILL, crashed.output
    op_id, key = _op_line(crashed.stdout)
    assert ledger_count(database, key) == 0  # never sent
    with SqliteOperationStore(store) as s:
        op = s.get(op_id)
        assert op is not None and op.state is OperationState.PENDING and op.attempts == ()

    resumed = cli(tmp_path, "--target", target, "--json", "resume", store=store)
    assert resumed.code == 0, resumed.output
    [result] = resumed.json()["results"]
    assert result["operation"]["idempotency_key"] == key
    assert result["result"]["code"] == "OK" and result["result"]["replayed"] is False
    assert ledger_count(database, key) == 2
    assert balance_of(database, "alice") == 7_500

    again = cli(tmp_path, "--target", target, "resume", store=store)
    assert again.code == 0 and again.stdout.strip() == "no pending operations"
    assert ledger_count(database, key) == 2 and balance_of(database, "alice") == 7_500


def test_killed_after_the_shard_applied_it_then_resumed_replays(
    shard: ShardDaemon, stub: transfer_pb2_grpc.TransferServiceStub, database: str, tmp_path: Path
) -> None:
    _setup(stub)
    target, store = f"127.0.0.1:{shard.port}", tmp_path / "ops.db"
    crashed = crash_helper(tmp_path, "after-apply", store, target, "alice", "bob", "2500")
    assert crashed.code == -signal.SIGKILL, crashed.output
    assert "answered" in crashed.stdout
    op_id, key = _op_line(crashed.stdout)
    assert ledger_count(database, key) == 2  # the shard applied it...
    with SqliteOperationStore(store) as s:
        op = s.get(op_id)
        assert op is not None and op.state is OperationState.PENDING and op.attempts == ()  # ...unrecorded

    resumed = cli(tmp_path, "--target", target, "resume", store=store)
    assert resumed.code == 0, resumed.output
    # The line names the operation and key the crashed run printed, beside the server's transfer id.
    assert resumed.stdout.strip().endswith(
        f"COMPLETED: 25.00 EUR alice -> bob (replayed); operation {op_id} (key {key})"
    ), resumed.stdout
    assert ledger_count(database, key) == 2
    assert balance_of(database, "alice") == 7_500 and balance_of(database, "bob") == 2_501
    with SqliteOperationStore(store) as s:
        op = s.get(op_id)
        assert op is not None and op.state is OperationState.SUCCEEDED
        assert [(a.code, a.replayed) for a in op.attempts] == [("OK", True)]
