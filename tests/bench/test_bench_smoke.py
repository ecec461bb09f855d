"""Smoke test of the benchmark harness (bench/): a tiny run end to end, figures non-zero.

Not a performance test: it only proves that `python -m bench` starts its PostgreSQL and daemons,
drives pgbench and the Node.js load generator, prints the table and writes the JSON, in well
under a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_temp() -> Iterator[Path]:
    """The bench's TMPDIR, of this test alone (another bench may run meanwhile, on another worker or
    beside the tests): readable by the PostgreSQL server's user, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="the load generator needs node and npm",
)


def test_tiny_run_prints_a_table_with_non_zero_figures(tmp_path: Path, bench_temp: Path) -> None:
    out = tmp_path / "bench.json"
    temp_root = bench_temp
    before = set(temp_root.glob("shard-router-bench-*"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--duration",
            "1",
            "--warmup",
            "0.3",
            "--concurrency",
            "1,4",
            "--scenarios",
            "pgbench-limit,shard-deposit,round-trips",
            "--growth",
            "0,3000",
            "--accounts",
            "50",
            "--round-trip-calls",
            "20",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(bench_temp)},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout
    assert "shard-deposit" in table and "pgbench-limit" in table and "targets:" in table
    all_cells = json.loads(out.read_text())["cells"]
    cells = [c for c in all_cells if not c["scenario"].startswith(("growth-", "round-trips/"))]
    assert {(c["scenario"], c["concurrency"]) for c in cells} == {
        ("pgbench-limit", 1),
        ("pgbench-limit", 4),
        ("shard-deposit", 1),
        ("shard-deposit", 4),
    }
    for cell in cells:
        assert cell["ok"] > 0 and cell["throughput"] > 0, cell
        assert cell["latency"]["p50_ms"] > 0 and cell["latency"]["p99_ms"] > 0, cell
    # CPU is read from /proc in 10 ms ticks: a 1 s pgbench cell can round to nothing (and pgbench may
    # have exited before its last reading), so only the longer-lived processes' figures are required.
    shard_cells = [c for c in cells if c["scenario"] == "shard-deposit"]
    for cell in shard_cells:
        assert cell["cpu_s"]["postgres"] > 0 and cell["cpu_s"]["client"] > 0, cell
        assert cell["cpu_s"]["shard-a"] > 0 and cell["peak_rss_kb"]["shard-a"] > 0, cell
    # A retention run at each size has a month past the window to drop, so it measures real work.
    growth = json.loads(out.read_text())["growth"]
    assert [g["size"] for g in growth] == [0, 3000] and growth[1]["rows"] >= 3000
    for row in growth:
        assert row["retention_dropped_rows"] > 0 and len(row["retention_dropped"]) == 1, row
        assert row["throughput"] > 0, row
    _check_round_trips(all_cells, table)
    # Nothing left behind: the harness removes its temp dirs.
    assert set(temp_root.glob("shard-router-bench-*")) <= before


def _check_round_trips(cells: list[dict], table: str) -> None:
    """The round-trips cells counted something per call. No exact values: the protocol is changing
    (a Deposit is a few round trips; a replay from the database at least one)."""
    counted = {c["scenario"]: c for c in cells if c["scenario"].startswith("round-trips/")}
    assert set(counted) == {"round-trips/deposit", "round-trips/replay-db", "round-trips/noidem-deposit"}
    for name, cell in counted.items():
        figures = cell["extra"]["round_trips"]
        assert cell["concurrency"] == 1 and cell["ok"] == figures["calls"] == 20 and not cell["errors"], cell
        assert figures["round_trips_per_call"] > 0 and figures["wire"]["round_trips"] > 0, (name, figures)
        assert figures["statements_per_call"] > 0 and figures["sent_statements_per_call"] > 0, (name, figures)
        assert figures["db_ms_per_call"] > 0, (name, figures)
    # Replays were answered from the database (the daemon's replay cache is off): they cost statements.
    # Raw count: the idle interval subtracted from the other figure holds the daemon's own polls (the
    # ownership poll each second), which can land on either side of it and shift it by a poll.
    assert counted["round-trips/replay-db"]["extra"]["round_trips"]["statements_per_call_raw"] >= 1
    assert "round trips per Deposit" in table and "round trips (Sync+Flush+Query" in table


HTTP_ROWS = ("router-deposit", "http-deposit", "router-replay", "http-replay", "http-conflict")


# The gRPC rows' run above is the default smoke test of the harness; the HTTP rows' with --run-slow.
@pytest.mark.slow
def test_tiny_run_of_the_http_rows_beside_the_grpc_rows(tmp_path: Path, bench_temp: Path) -> None:
    """The router's HTTP front measured beside gRPC through the router: new keys, replays of keys
    created through the front, and 409s for a key held in flight; the ratios are printed."""
    out = tmp_path / "bench.json"
    temp_root = bench_temp
    before = set(temp_root.glob("shard-router-bench-*"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--duration",
            "1",
            "--warmup",
            "0.3",
            "--concurrency",
            "4",
            "--scenarios",
            ",".join(HTTP_ROWS),
            "--growth",
            "none",
            "--accounts",
            "50",
            "--replay-keys",
            "100",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(bench_temp)},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout
    assert "HTTP vs gRPC through the router" in table
    assert "http-deposit / router-deposit" in table and "http-replay / router-replay" in table
    cells = {c["scenario"]: c for c in json.loads(out.read_text())["cells"]}
    assert set(cells) == set(HTTP_ROWS)
    for cell in cells.values():
        assert cell["ok"] > 0 and cell["throughput"] > 0, cell
        assert cell["latency"]["p50_ms"] > 0 and cell["latency"]["p99_ms"] > 0, cell
        assert not cell["errors"], cell
        # CPU per operation of the router and the shard, as for every row through the router.
        assert cell["cpu_s"]["router"] > 0 and cell["cpu_s"]["shard-a"] > 0, cell
        assert cell["cpu_s"]["client"] > 0, cell
    for name in ("http-deposit", "http-replay", "http-conflict"):
        assert cells[name]["extra"]["protocol"] == "http", cells[name]
    # First applies over HTTP are 201s; every http-replay answer is a replay of a key created
    # through the front (Idempotent-Replayed: true); the conflict row counts only 409s.
    assert cells["http-deposit"]["extra"]["replayed"] == 0
    assert cells["http-replay"]["extra"]["replayed"] == cells["http-replay"]["ok"]
    conflict = cells["http-conflict"]["extra"]
    assert conflict["conflicts"] == cells["http-conflict"]["ok"] and conflict["ok"] == 0, conflict
    assert set(temp_root.glob("shard-router-bench-*")) <= before
