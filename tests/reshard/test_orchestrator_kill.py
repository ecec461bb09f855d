"""The orchestrator (`shard-router reshard`, a real process) SIGKILLed at every step of a move under
a load with duplicates, then the move resumed or aborted by a new process: every key applied
once, every retry a verbatim replay, money conserved, nothing left behind.

The process is started with the step's failpoint armed (`SHARD_ROUTER_FAILPOINTS`, see
`shardrouter/core/failpoints.py`): it stops right after journaling the step and says so, and only
then is it killed, so the kill lands exactly there, never a step later.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardrouter.core.shardmap import load_shard_map, parse_shard_map, write_shard_map
from shardrouter.reshard.move import COMMITTED, PUBLISHED, find_move, phase_failpoint
from shardrouter.reshard.plan import Phase
from tests.processes import run_to_failpoint
from tests.reshard.cluster import (
    FIRST,
    LAST,
    Load,
    Pair,
    accounts,
    assert_no_leftovers,
    assert_replays_match,
    check_ledger,
    seed,
)

#: The failpoint of each step: the process stops right after it journaled the phase (committed: the
#: commit point, recorded in the old owner's database, not yet handed over nor published; published:
#: handed over and the map file replaced, not yet cleaned up).
KILL_POINTS = {
    **{phase.value: phase_failpoint(phase) for phase in Phase if phase.rank < Phase.COMMITTED.rank},
    "committed": COMMITTED,
    "published": PUBLISHED,
}
BEFORE_COMMIT = [k for k in KILL_POINTS if k not in ("committed", "published")]


def _reshard(pair: Pair, databases: Path, *args: str) -> list[str]:
    command = [sys.executable, "-m", "shardrouter.localcluster.command", "reshard", *args]
    return [*command, "--map", str(pair.map_path), "--databases", str(databases)]


def _kill_at(pair: Pair, databases: Path, point: str) -> str:
    """Start a move and SIGKILL its process once it is paused at the failpoint of step `point`; the
    move's id."""
    version = load_shard_map(pair.map_path).version
    killed = run_to_failpoint(
        _reshard(pair, databases, "--slots", f"{FIRST}-{LAST}", "--to", "shard-1"), KILL_POINTS[point]
    )
    found = re.search(r"move (m\w+):", killed.output)
    assert found, killed.output
    move_id = found[1]
    # Killed exactly at the step: the journal shows it, not the next one; the map file is written
    # only after the commit (and the hand-over).
    assert find_move(pair.databases, move_id).phase is (
        Phase.COMMITTED if point == "published" else Phase(point)
    )
    assert load_shard_map(pair.map_path).version == version + (point == "published")
    return move_id


def _finish(pair: Pair, databases: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _reshard(pair, databases, *args), capture_output=True, text=True, timeout=120, check=False
    )


#: The kills the default suite runs: each side of the commit, the copy, the fence and verification,
#: resumed or aborted. The whole sweep (every point, both ways where both are allowed) runs with
#: --run-slow.
DEFAULT_KILLS = {
    ("prepared", "resume"),
    ("fenced", "resume"),
    ("committed", "resume"),
    ("published", "resume"),
    ("copied", "abort"),
    ("verified", "abort"),
}


def _kill_cases() -> list[object]:
    cases = [(p, "resume") for p in KILL_POINTS] + [(p, "abort") for p in BEFORE_COMMIT]
    return [case if case in DEFAULT_KILLS else pytest.param(*case, marks=pytest.mark.slow) for case in cases]


@pytest.mark.parametrize(("point", "then"), _kill_cases())
def test_an_orchestrator_killed_at_any_step_resumes_or_aborts_cleanly(
    pair: Pair, tmp_path: Path, point: str, then: str
) -> None:
    databases = tmp_path / "databases.yaml"
    databases.write_text(yaml.safe_dump(pair.dsns), encoding="utf-8")
    moving, staying = accounts(pair, 6)
    everyone = moving + staying
    seed(pair, everyone)
    version = load_shard_map(pair.map_path).version
    load = Load(pair.call, everyone, threads=2)
    load.start()
    try:
        time.sleep(0.3)
        move_id = _kill_at(pair, databases, point)
        time.sleep(0.3)  # the load meets whatever the killed move left: fences, a subscription
        finished = _finish(pair, databases, then, move_id)
        assert finished.returncode == 0, finished.stdout + finished.stderr
        time.sleep(0.3)
    finally:
        load.stop()

    record = find_move(pair.databases, move_id)
    owner = "shard-1" if then == "resume" else "shard-0"
    assert record.phase is (Phase.DONE if then == "resume" else Phase.ABORTED)
    assert load_shard_map(pair.map_path).version == version + (then == "resume")
    assert all(pair.owner(a) == owner for a in moving)
    assert load.mismatches == []
    assert load.ok_count() > 5, f"the load barely ran: {load.ok_count()} successful calls"
    assert_replays_match(load, pair)
    check_ledger(pair, len(everyone), load.deposited())
    assert_no_leftovers(pair)


def test_an_abort_after_the_commit_is_refused_and_resume_finishes(pair: Pair, tmp_path: Path) -> None:
    databases = tmp_path / "databases.yaml"
    databases.write_text(yaml.safe_dump(pair.dsns), encoding="utf-8")
    moving, _ = accounts(pair, 3)
    seed(pair, moving)
    move_id = _kill_at(pair, databases, "committed")
    refused = _finish(pair, databases, "abort", move_id)
    assert refused.returncode == 2
    assert "resume it instead" in refused.stderr
    resumed = _finish(pair, databases, "resume", move_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert find_move(pair.databases, move_id).phase is Phase.DONE
    assert all(pair.owner(a) == "shard-1" for a in moving)
    assert_no_leftovers(pair)


def test_the_committed_map_is_rebuilt_from_the_journal_after_a_kill_at_the_commit(
    pair: Pair, tmp_path: Path
) -> None:
    databases = tmp_path / "databases.yaml"
    databases.write_text(yaml.safe_dump(pair.dsns), encoding="utf-8")
    moving, staying = accounts(pair, 3)
    seed(pair, moving + staying)
    before = load_shard_map(pair.map_path)
    move_id = _kill_at(pair, databases, "committed")
    # The process that committed is gone, and the map file was never written: the commit lives in
    # the old owner's database (its journal and its ownership fact).
    assert load_shard_map(pair.map_path) == before
    shown = _finish(pair, databases, "show-map", move_id)
    assert shown.returncode == 0, shown.stderr
    committed = parse_shard_map(yaml.safe_load(shown.stdout), source="show-map")
    assert committed.version == before.version + 1
    assert all(pair.owner(a, committed) == "shard-1" for a in moving)
    assert all(pair.owner(a, committed) == pair.owner(a, before) for a in staying)
    # Without a move: the map every process should follow, the published one with the databases'
    # facts applied, is the same map.
    current = _finish(pair, databases, "show-map")
    assert current.returncode == 0, current.stderr
    assert parse_shard_map(yaml.safe_load(current.stdout), source="show-map") == committed
    # Published by hand (as an operator would from show-map), then resumed: the move finishes and
    # publishing again changes nothing.
    write_shard_map(pair.map_path, committed)
    resumed = _finish(pair, databases, "resume", move_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert load_shard_map(pair.map_path) == committed
    assert find_move(pair.databases, move_id).phase is Phase.DONE
    assert all(pair.owner(a) == "shard-1" for a in moving)
    check_ledger(pair, len(moving + staying), 0)
    assert_no_leftovers(pair)
