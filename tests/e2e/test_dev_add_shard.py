"""`shard-router dev add-shard` on a running `dev up`, as a user runs them: the new shard joins the
map owning no slots, `shard-router reshard` moves a range of shard-0's to it, money moves through
the router on it, Ctrl-C stops its processes with the rest, and the next `dev up` starts it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import yaml

from shardrouter.client import SqliteOperationStore, TransferClient
from shardrouter.core.shardmap import ShardMap, load_shard_map
from shardrouter.localcluster.postgres import free_port
from tests.e2e.test_dev_cluster import _dev_up, _until_running, _wait_no_leftovers
from tests.helpers import pg_data_dir
from tests.processes import ROOT, wait_serving

#: A small range of shard-0's (it owns 0-8191 in the even map of two shards).
FIRST, LAST = 0, 255


def _shard_router(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardrouter.localcluster.command", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


def _account_in(shard_map: ShardMap, first: int, last: int) -> str:
    """An account id whose slot lies in first..last."""
    return next(a for i in range(1_000_000) if first <= shard_map.slot_of(a := f"acct-{i}") <= last)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    rest, _ = proc.communicate(timeout=60)
    return rest


def _balance(client: TransferClient, account: str) -> int:
    return int(client.get_balance(account, attempts=10).balance.amount_minor)


def test_add_a_shard_move_slots_to_it_stop_and_start_again(tmp_path: Path) -> None:
    data_dir = pg_data_dir().parent / "cluster"  # not under tmp_path: the PostgreSQL user must reach it
    map_path, databases_path = data_dir / "shard-map.yaml", data_dir / "databases.yaml"
    port = free_port()
    store = SqliteOperationStore(str(tmp_path / "ops.db"))
    proc = _dev_up(data_dir, port, "--no-demo")
    try:
        _until_running(proc, timeout_s=90)
        before = load_shard_map(map_path)
        account = _account_in(before, FIRST, LAST)
        with TransferClient(f"127.0.0.1:{port}", store=store, caller_id="e2e") as client:
            assert client.deposit(account, 100, "EUR").ok

        started = time.monotonic()
        added = _shard_router("dev", "add-shard", "--data-dir", str(data_dir))
        add_s = time.monotonic() - started
        assert added.returncode == 0, added.stdout + added.stderr
        assert "Added shard-2" in added.stdout and "reshard --slots 0-1023 --to shard-2" in added.stdout
        print(f"dev add-shard took {add_s:.1f} s")

        after = load_shard_map(map_path)
        assert [s.id for s in after.shards] == ["shard-0", "shard-1", "shard-2"]
        assert after.version == before.version + 1
        assert after.ranges == before.ranges, "the new shard owns no slots"
        new_shard = after.shard_by_id("shard-2")
        assert new_shard is not None
        dsns = yaml.safe_load(databases_path.read_text())
        assert set(dsns) == {"shard-0", "shard-1", "shard-2"}
        wait_serving(new_shard.address, timeout_s=5)

        moved = _shard_router(
            "reshard", "--slots", f"{FIRST}-{LAST}", "--to", "shard-2",
            "--map", str(map_path), "--databases", str(databases_path),
        )  # fmt: skip
        assert moved.returncode == 0, moved.stdout + moved.stderr
        status = _shard_router("reshard", "status", "--json", "--databases", str(databases_path))
        assert status.returncode == 0, status.stderr
        (move,) = json.loads(status.stdout)
        assert (move["phase"], move["source"], move["target"]) == ("done", "shard-0", "shard-2")
        assert load_shard_map(map_path).shard_for(account).id == "shard-2"

        # Through the router, which follows the map (a call it sends before it sees the new version
        # meets shard-0's fence, UNAVAILABLE, and the client's retry goes to shard-2).
        with TransferClient(f"127.0.0.1:{port}", store=store, caller_id="e2e") as client:
            assert client.deposit(account, 250, "EUR").ok
            assert _balance(client, account) == 350
        with psycopg.connect(dsns["shard-2"]) as conn:
            assert conn.execute("SELECT balance FROM accounts WHERE id = %s", (account,)).fetchall() == [
                (350,)
            ]
    finally:
        rest = _stop(proc)
    assert proc.returncode == 0, rest
    assert "Stopped." in rest
    assert _wait_no_leftovers(data_dir) == [], "every process of dev up, the added shard's too, must be gone"

    # The next `dev up` (same data directory, no --wipe) serves the added shard and the moved range.
    proc = _dev_up(data_dir, port, "--no-demo")
    try:
        lines = _until_running(proc, timeout_s=90)
        assert any(line.startswith("Starting 3 shard(s)") for line in lines), "".join(lines)
        again = load_shard_map(map_path)
        assert [s.id for s in again.shards] == ["shard-0", "shard-1", "shard-2"]
        assert again.version > after.version and again.shard_for(account).id == "shard-2"
        with TransferClient(f"127.0.0.1:{port}", store=store, caller_id="e2e") as client:
            assert _balance(client, account) == 350
    finally:
        rest = _stop(proc)
    assert proc.returncode == 0, rest
    assert _wait_no_leftovers(data_dir) == []
