"""`shard-router check --local-cluster` with faults on a schedule: the installed command starts a
local cluster of its own, does each fault while the workload runs (SIGKILLs of its shard daemons and
router, of a shard's PostgreSQL, a failover to a shard's standby, a slot range moved away and back,
its orchestrator SIGKILLed mid-move and the move resumed), and every proof still holds.

Each test asserts the fault really happened, from the run's report (a new postmaster pid, a promoted
standby out of recovery, a move done and the map's version risen), and that the workload ran across
it (answers acknowledged after the fault, from the history).
"""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shardrouter.check.history import read_history
from shardrouter.localcluster.check_moves import KILL_AFTER
from shardrouter.localcluster.cluster import installed_command

_FAULT_LINE = re.compile(r"^  (\d\d:\d\d:\d\d\.\d{3})-(\d\d:\d\d:\d\d\.\d{3}) ([^:]+): (.*)$", re.MULTILINE)


def _check(history: Path, *flags: str, operations: int = 400, concurrency: int = 6) -> str:
    """Run the check on a local cluster of its own with `flags`; its output, once it passed."""
    done = subprocess.run(
        [
            *installed_command("shard-router"),
            "check",
            "--local-cluster",
            *flags,
            "--operations",
            str(operations),
            "--concurrency",
            str(concurrency),
            "--history",
            str(history),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "FAILED" not in done.stdout, out
    assert re.search(r"answers: \d+ acknowledged, \d+ refused, 0 pending", done.stdout), out
    assert "verdict: PASS, every proof holds" in done.stdout, out
    return done.stdout


def _faults(out: str, kind: str) -> list[tuple[float, float, str]]:
    """The report's faults of `kind`: (began, ended, what), in order; times on today's UTC date."""
    today = datetime.now(UTC).date()

    def moment(clock: str) -> float:
        t = datetime.strptime(clock, "%H:%M:%S.%f").time()
        return datetime.combine(today, t, tzinfo=UTC).timestamp()

    return [
        (moment(began), moment(ended), what)
        for began, ended, k, what in _FAULT_LINE.findall(out)
        if k == kind
    ]


def _acknowledged_after(history: Path, moment: float) -> int:
    """Answers OK the workload got after `moment` (wall clock)."""
    attempts = read_history(history).attempts.values()
    return sum(1 for per_key in attempts for a in per_key if a.code == "OK" and a.ended_at > moment)


def test_a_run_under_kills_of_shard_daemons_and_the_router_passes(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    out = _check(history, "--kill-shard-daemon-every", "0.5", "--kill-router-every", "0.8", operations=200)
    kills = _faults(out, "shard daemon SIGKILL") + _faults(out, "router SIGKILL")
    assert len(kills) >= 2, out
    assert all(re.fullmatch(r"SIGKILL \S+ \(pid \d+\), started again \(pid \d+\)", w) for _, _, w in kills), out
    assert re.search(rf"^faults: {len(kills)} \(", out, re.MULTILINE), out
    assert history.stat().st_size > 0


# PostgreSQL killed under the shard's own load is in tests/faults (test_shard_database_faults);
# the checker's run over it is the slow variant.
@pytest.mark.slow
def test_a_run_under_kills_of_a_shards_postgresql_passes(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    out = _check(history, "--kill-postgres-every", "0.5", operations=500, concurrency=3)
    kills = _faults(out, "PostgreSQL SIGKILL")
    assert kills, out
    for _, _, what in kills:
        pids = re.search(
            r"postmaster pid (\d+)\) and its backends, started again \(postmaster pid (\d+)\)", what
        )
        assert pids is not None and pids[1] != pids[2], what
    # The workload ran across the first kill: its answers came from the restarted server too.
    assert _acknowledged_after(history, kills[0][1]) > 0, out


# A failover under load is in tests/faults (test_database_failover); the checker's run over one
# is the slow variant.
@pytest.mark.slow
def test_a_run_across_a_failover_to_each_shards_standby_passes(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    out = _check(history, "--failover-every", "0.5", operations=500, concurrency=3)
    failovers = _faults(out, "failover")
    assert failovers, out
    assert all("standby on port" in w and "promoted (in recovery: no)" in w for _, _, w in failovers), out
    assert _acknowledged_after(history, failovers[0][1]) > 0, out


def _moves(out: str, kind: str) -> list[re.Match[str]]:
    pattern = re.compile(
        r"move (m\w+) slots (\d+)-(\d+) (\S+) -> (\S+): (.*)done, (\d+) rows moved, shard map version (\d+)"
    )
    found = [pattern.fullmatch(what) for _, _, what in _faults(out, kind)]
    assert all(m is not None for m in found), out
    return [m for m in found if m is not None]


# The next test moves the range too, with its orchestrator killed at each move: this plain variant
# runs with --run-slow.
@pytest.mark.slow
def test_a_run_while_a_range_moves_away_and_back_passes(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    out = _check(history, "--move-every", "0.2", operations=600, concurrency=3)
    moves = _moves(out, "move")
    assert moves, out
    # The map's version rose with each move (it starts at 1), and a second move took the range back.
    assert [int(m[8]) for m in moves] == list(range(2, 2 + len(moves))), out
    assert moves[0][4] == "shard-0" and moves[0][5] == "shard-1", out
    if len(moves) > 1:
        assert moves[1][4] == "shard-1" and moves[1][5] == "shard-0", out
    assert sum(int(m[7]) for m in moves) > 0, out  # the range held rows of the workload
    assert _acknowledged_after(history, _faults(out, "move")[0][1]) > 0, out


def test_a_run_while_a_moves_orchestrator_is_killed_and_resumed_passes(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    out = _check(
        history, "--kill-orchestrator-mid-move", "--move-every", "0.2", operations=600, concurrency=3
    )
    kind = "move with its orchestrator SIGKILLed"
    moves = _moves(out, kind)
    assert moves, out
    steps = [re.search(r"SIGKILLed after (\w+), resumed by a new one; ", m[6]) for m in moves]
    assert all(s is not None for s in steps), out
    # Each move's orchestrator is killed after the next step in turn (as many moves as the run had).
    assert [s[1] for s in steps if s is not None] == list(KILL_AFTER[: len(moves)]), out
    assert [int(m[8]) for m in moves] == list(range(2, 2 + len(moves))), out
    # The workload ran while the first move was under way (a resumed move may outlast it).
    assert _acknowledged_after(history, _faults(out, kind)[0][0]) > 0, out


def test_moves_and_failovers_together_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *installed_command("shard-router"),
            "check",
            "--local-cluster",
            "--move-every",
            "1",
            "--failover-every",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot run together" in done.stderr
