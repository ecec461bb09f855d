"""`shard-router dev up`: the local cluster as a new user runs it, with its demo, and a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardrouter.devcluster.postgres import free_port
from tests.processes import ROOT


def _leftovers(data_dir: Path) -> list[str]:
    """Processes whose command line mentions the cluster's data directory (postgres, shardd, router)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = (
                (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
            environ = (Path("/proc") / pid / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(data_dir) in cmdline or str(data_dir) in environ:
            found.append(f"{pid}: {cmdline[:120]}")
    return found


def _wait_no_leftovers(data_dir: Path, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _leftovers(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _dev_up(data_dir: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardrouter.cli",
            "dev",
            "up",
            "--shards",
            "2",
            "--data-dir",
            str(data_dir),
            "--port",
            str(port),
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_dev_up_runs_the_demo_and_stops_cleanly(tmp_path):
    data_dir = tmp_path / "cluster"
    proc = _dev_up(data_dir, free_port(), "--exit-after-demo")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    assert "identical bytes: True, trailer idempotency-replayed: 'true'" in out
    assert "applied 1," in out and "ABORTED" in out
    assert "after the relay: TRANSFER_STATE_COMPLETED" in out
    assert "Stopped." in out
    assert _wait_no_leftovers(data_dir) == []
    assert (data_dir / "shard-map.yaml").exists() and (data_dir / "pg-shard-0" / "PG_VERSION").exists()


def test_dev_up_stops_everything_on_sigterm_and_keeps_data(tmp_path):
    data_dir = tmp_path / "cluster"
    port = free_port()
    proc = _dev_up(data_dir, port, "--no-demo")
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Cluster running" in line or not line:
            break
    assert any("Cluster running" in line for line in lines), "".join(lines)
    balance = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardrouter.cli",
            "--target",
            f"127.0.0.1:{port}",
            "--store",
            str(tmp_path / "ops.db"),
            "deposit",
            "--account",
            "zoe",
            "--amount",
            "3.00",
            "--currency",
            "EUR",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert balance.returncode == 0, balance.stdout + balance.stderr
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "Stopped." in rest
    assert _wait_no_leftovers(data_dir) == []
    assert (data_dir / "pg-shard-0" / "PG_VERSION").exists(), "data must stay unless --wipe"
