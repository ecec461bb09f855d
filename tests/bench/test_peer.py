"""The peer beside the shard (`python -m bench.peer`): a tiny run produces both sides' rows and kill
runs, and the kill run's counters come from the database.

Not a performance test. The run needs Debian's `redis-server`, the `bench-peer` extra and node; it is
skipped with the reason when one is missing. The counting test needs only PostgreSQL.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from bench.killrun import KillRunResult, balance_sum, count_from_database
from bench.peer import missing_requirement
from shardrouter.core.keys import new_key

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_prints_both_sides_with_kill_runs(tmp_path: Path) -> None:
    missing = missing_requirement() or (
        "node and npm (the load generator)"
        if shutil.which("node") is None or shutil.which("npm") is None
        else None
    )
    if missing:
        pytest.skip(f"the peer cannot run here: {missing}")
    out = tmp_path / "peer.json"
    command = [sys.executable, "-m", "bench.peer", "--duration", "0.6", "--warmup", "0.2"]
    command += ["--concurrency", "2,4", "--accounts", "30", "--replay-keys", "60", "--kills", "1"]
    command += ["--kill-seconds", "3", "--kill-callers", "3", "--kill-ops", "2000", "--json", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| Powertools + Redis |" in result.stdout and "| our shard |" in result.stdout
    assert "payload validation OFF" in result.stdout
    report = json.loads(out.read_text())
    rows = {row["side"]: row for row in report["rows"]}
    assert set(rows) == {"Powertools + Redis", "our shard"}
    for side, row in rows.items():
        assert all(v > 0 for v in row["new_ok_s"].values()) and len(row["new_ok_s"]) == 2, row
        assert all(v > 0 for v in row["replay_ok_s"].values()) and row["p99_ms_low"] > 0, row
        assert row["cpu_us_per_new_key"]["server"] > 0 and row["cpu_us_per_new_key"]["postgres"] > 0, row
        # The same-rate cell: paced by the load generator, never above the rate offered to both sides.
        assert 0 < row["same_rate_ok_s"] <= 1.2 * report["same_rate"], (row, report["same_rate"])
        assert row["cpu_us_per_new_key_same_rate"]["postgres"] > 0, row
        kill = row["kill_run"]
        assert kill["kills"] == 1 and kill["operations"] > 0 and kill["duplicates_sent"] > 0, (side, kill)
        assert kill["acknowledged"] + kill["unresolved"] == kill["operations"], kill
        assert len(kill["in_flight_at_kills"]) == 1, kill
    # Redis's CPU is counted (a 0.6 s cell may round its 10 ms ticks to nothing).
    assert "redis" in rows["Powertools + Redis"]["cpu_us_per_new_key"]
    assert "redis" not in rows["our shard"]["cpu_us_per_new_key"]
    # Ours must hold under the kill: nothing applied twice, nothing acknowledged and lost.
    shard = rows["our shard"]["kill_run"]
    assert (shard["applied_twice"], shard["lost"], shard["balance_off"]) == (0, 0, 0), shard


def test_kill_run_counts_come_from_the_ledger_and_balances(database: str) -> None:
    """Three operations: one applied once, one applied twice (a second ledger row and credit written
    here, as a double apply would), one acknowledged but never written: the counters say exactly that."""
    accounts = ["901", "902"]
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO accounts (id, currency, balance) SELECT unnest(%s::text[]), 'EUR', 1000", (accounts,)
        )
    before = balance_sum(database, accounts)
    once, twice, lost = (str(new_key()) for _ in range(3))
    ops = {once: ("901", 10), twice: ("902", 7), lost: ("901", 5)}
    with psycopg.connect(database, autocommit=True) as conn:
        for key, times in ((once, 1), (twice, 2)):
            account, amount = ops[key]
            for _ in range(times):
                conn.execute(
                    "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, idempotency_key, reference)"
                    " VALUES (%s, %s, %s, 'deposit', %s, 'test')",
                    (uuid.uuid4(), account, amount, key),
                )
                conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, account))
    result = KillRunResult(side="test")
    count_from_database(database, ops, {once, twice, lost}, (accounts, before), result)
    assert (result.applied_twice, result.extra_rows, result.lost) == (1, 1, 1)
    # +7 written twice, 5 acknowledged but never credited.
    assert result.balance_off == 7 - 5
