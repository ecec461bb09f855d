"""The moves of `shard-router check --local-cluster --move-every S`: a slot range moved from one shard
to another and back, each move by the installed `shard-router reshard` (a process of its own, as a
user runs it), and with `--kill-orchestrator-mid-move` that process SIGKILLed part-way and the move
resumed from its journal by a new one.

The kill lands at a named failpoint (`core/failpoints.py`): the orchestrator is started with one
phase's point armed, pauses right after journaling that phase, and only then is killed, so each kill
is at a known step (the steps taken in turn over the run), never after the move finished.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg

from shardrouter.core import failpoints
from shardrouter.core.moves import Phase
from shardrouter.core.shard_dsns import read_shard_dsns
from shardrouter.core.shardmap import load_shard_map
from shardrouter.localcluster.cluster import LocalCluster, installed_command
from shardrouter.reshard.move import COMMITTED, PUBLISHED, ShardDatabases, find_move, phase_failpoint

#: The steps an orchestrator is killed after, in turn: each side of the commit, the catch-up, the
#: fence and verification. Not during the copy: a resume after a crash there is a known open defect
#: of the move (a table can stay in state 'f'), which this schedule is not meant to hunt.
KILL_AFTER = ("fenced", "committed", "caught_up", "verified", "published", "copied")
#: The move's failpoint after each of those steps.
_FAILPOINT_AFTER = {
    "fenced": phase_failpoint(Phase.FENCED),
    "committed": COMMITTED,
    "caught_up": phase_failpoint(Phase.CAUGHT_UP),
    "verified": phase_failpoint(Phase.VERIFIED),
    "published": PUBLISHED,
    "copied": phase_failpoint(Phase.COPIED),
}
#: How long one orchestrator (a move, or its resume) may take before the schedule gives up (s).
MOVE_TIMEOUT_S = 300.0
#: How many times a move whose orchestrator stopped on an error is resumed before the schedule gives up.
MAX_RESUMES = 10
#: Seconds between two tries.
RETRY_PAUSE_S = 1.0
_MOVE_ID = re.compile(r"move (m\w+):")
T = TypeVar("T")
_PAUSED = re.compile(r"failpoint (\S+): paused \(pid (\d+)\)")


class MoveFailed(RuntimeError):
    """A move did not reach its end (the message says where, and which log to read)."""


@dataclass(frozen=True)
class MoveDone:
    """One move the schedule made."""

    move_id: str
    first: int
    last: int
    source: str
    target: str
    rows_moved: int
    map_version: int
    #: The step after which its first orchestrator was SIGKILLed, and that process's pid ("", 0: none).
    killed_after: str = ""
    killed_pid: int = 0
    #: How many times it was resumed after an orchestrator stopped on an error.
    resumes_after_errors: int = 0

    def describe(self) -> str:
        """One line for the run's report."""
        killed = (
            f"orchestrator (pid {self.killed_pid}) SIGKILLed after {self.killed_after}, resumed by a new one; "
            if self.killed_after
            else ""
        )
        if self.resumes_after_errors:
            killed += (
                f"resumed {self.resumes_after_errors} time(s) after the orchestrator stopped on an error; "
            )
        return (
            f"move {self.move_id} slots {self.first}-{self.last} {self.source} -> {self.target}: {killed}"
            f"done, {self.rows_moved} rows moved, shard map version {self.map_version}"
        )


class Moves:
    """A range of the first shard moved to the second and back, one move per `act`."""

    def __init__(self, cluster: LocalCluster, *, kill_orchestrator: bool) -> None:
        if len(cluster.shard_ids) < 2:
            raise ValueError("moves need two shards or more (--shards)")
        self._cluster = cluster
        self._kill = kill_orchestrator
        self._home, self._away = cluster.shard_ids[0], cluster.shard_ids[1]
        self._first, self._last = _half_of_first_range(cluster, self._home)

    def act(self, n: int) -> MoveDone:
        """The `n`-th move (from 0): away on even turns, home on odd ones; with orchestrator kills,
        its first process killed after the turn's step and the move resumed."""
        target = self._away if n % 2 == 0 else self._home
        log = self._cluster.data_dir / "logs" / f"check-move-{n}.log"
        args = ["--slots", f"{self._first}-{self._last}", "--to", target]
        killed_after = KILL_AFTER[n % len(KILL_AFTER)] if self._kill else ""
        move_id, killed_pid, code = self._start(args, log, killed_after)
        if killed_pid:
            code = self._run(["resume", move_id], log)
        else:  # not killed this turn: it stopped on an error before the step (resumed below)
            killed_after = ""
        resumes = 0
        # An orchestrator that stopped on an error (a shard's database killed under it) is resumed,
        # as its message tells a user to do.
        while code != 0 and resumes < MAX_RESUMES:
            resumes += 1
            time.sleep(RETRY_PAUSE_S)
            code = self._run(["resume", move_id], log)
        if code != 0:
            raise MoveFailed(
                f"move {move_id}: shard-router reshard exited {code} {resumes + 1} times; see {log}"
            )
        record = _retrying(
            lambda: find_move(ShardDatabases(read_shard_dsns(self._cluster.databases_path)), move_id)
        )
        if record.phase is not Phase.DONE:
            raise MoveFailed(f"move {move_id} is {record.phase.value}, not done; see {log}")
        rows = record.figures.get("rows_moved", {})
        return MoveDone(
            move_id=move_id,
            first=self._first,
            last=self._last,
            source=record.plan.source,
            target=record.plan.target,
            rows_moved=sum(rows.values()) if isinstance(rows, dict) else 0,
            map_version=load_shard_map(self._cluster.shard_map_path).version,
            killed_after=killed_after,
            killed_pid=killed_pid,
            resumes_after_errors=resumes,
        )

    def _start(self, args: list[str], log: Path, kill_after: str) -> tuple[str, int, int]:
        """Start the move, again while its orchestrator stops on an error before journaling it (a
        database starting up); with `kill_after`, SIGKILL it once paused after that step. (The
        move's id, the killed orchestrator's pid or 0, the exit code of an unkilled one.)"""
        for attempt in range(MAX_RESUMES + 1):
            if kill_after:
                pid, code = self._run_to_pause(args, _FAILPOINT_AFTER[kill_after], log)
            else:
                pid, code = 0, self._run(args, log)
            found = _MOVE_ID.findall(log.read_text(encoding="utf-8", errors="replace"))
            if found:
                return str(found[-1]), pid, code
            if attempt < MAX_RESUMES:
                time.sleep(RETRY_PAUSE_S)
        raise MoveFailed(f"no move was started ({MAX_RESUMES + 1} tries); see {log}")

    def _command(self, args: list[str]) -> list[str]:
        files = ["--map", str(self._cluster.shard_map_path), "--databases", str(self._cluster.databases_path)]
        return [*installed_command("shard-router"), "reshard", *args, *files]

    def _run(self, args: list[str], log: Path) -> int:
        """One orchestrator to its end, its output appended to `log`; its exit code."""
        with log.open("ab") as out:
            done = subprocess.run(
                self._command(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=MOVE_TIMEOUT_S,
                check=False,
                start_new_session=True,
            )
        return done.returncode

    def _run_to_pause(self, args: list[str], point: str, log: Path) -> tuple[int, int]:
        """Start an orchestrator with `point` armed, wait for its pause there, SIGKILL it: (its pid,
        0); or (0, its exit code) when it stopped on an error before reaching the point."""
        env = {**os.environ, failpoints.ENV: f"{point}=pause", "PYTHONUNBUFFERED": "1"}
        with log.open("ab") as out:
            proc = subprocess.Popen(
                self._command(args), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            deadline = time.monotonic() + MOVE_TIMEOUT_S
            while not _paused_at(log, point):
                if proc.poll() is not None:
                    if proc.returncode == 0:
                        raise MoveFailed(f"the orchestrator ended before {point}; see {log}")
                    return 0, proc.returncode
                if time.monotonic() > deadline:
                    raise MoveFailed(f"the orchestrator did not reach {point}; see {log}")
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            code = proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if code != -signal.SIGKILL:
            raise MoveFailed(f"the orchestrator paused at {point} ended with {code}, not by SIGKILL")
        return proc.pid, 0


def _paused_at(log: Path, point: str) -> bool:
    return any(m[1] == point for m in _PAUSED.finditer(log.read_text(encoding="utf-8", errors="replace")))


def _retrying(read: Callable[[], T]) -> T:
    """`read()`, again for a while if a shard's database cannot be reached (one restarting)."""
    for _ in range(MAX_RESUMES):
        try:
            return read()
        except psycopg.OperationalError:
            time.sleep(RETRY_PAUSE_S)
    return read()


def _half_of_first_range(cluster: LocalCluster, shard_id: str) -> tuple[int, int]:
    """The first half of the first slot range `shard_id` owns in the cluster's map."""
    shard_map = load_shard_map(cluster.shard_map_path)
    index = next(i for i, s in enumerate(shard_map.shards) if s.id == shard_id)
    first, last = next((a, b) for a, b, owner in shard_map.ranges if owner == index)
    return first, first + (last - first) // 2


__all__ = ["KILL_AFTER", "MoveDone", "MoveFailed", "Moves"]
