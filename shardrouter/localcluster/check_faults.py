"""`shard-router check --local-cluster`: the checker against a local cluster of its own, with faults
on a schedule while the workload runs: a shard daemon (each in turn) or the router SIGKILLed and
started again, a shard's PostgreSQL SIGKILLed (postmaster and backends) and started again, a shard's
primary SIGKILLed and its synchronous standby promoted (a failover; the cluster then runs each shard
as primary plus standby), and a slot range moved to another shard and back (`check_moves.py`), its
orchestrator SIGKILLed part-way and the move resumed. The cluster is started in a temporary
directory and deleted after. Every fault is listed with when it began and ended before the proofs run; the verdict
comes from the history and the databases alone.

It lives here, not in `shardrouter.check`, because it starts and kills the local cluster's processes;
the checker below it only drives a router and reads databases.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from shardrouter.check import cli as check_cli
from shardrouter.localcluster.check_moves import Moves
from shardrouter.localcluster.cluster import Daemon, LocalCluster
from shardrouter.localcluster.postgres import LocalPostgres, ReplicatedPostgres, free_port

#: How long a killed process stays down before it is started again (s).
DOWN_S = 0.5
#: How many times a killed process is started before its schedule gives up (1 s apart).
START_ATTEMPTS = 10


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--local-cluster", action="store_true")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--kill-shard-daemon-every", type=float, default=0.0, metavar="S")
    p.add_argument("--kill-router-every", type=float, default=0.0, metavar="S")
    p.add_argument("--kill-postgres-every", type=float, default=0.0, metavar="S")
    p.add_argument("--failover-every", type=float, default=0.0, metavar="S")
    p.add_argument("--move-every", type=float, default=0.0, metavar="S")
    p.add_argument("--kill-orchestrator-mid-move", action="store_true")
    return p


@dataclass(frozen=True)
class FaultEvent:
    """One fault done: when it began and ended (wall clock), its kind, what it did."""

    began: float
    at: float
    kind: str
    what: str


class FaultLog:
    """Every fault of the run, in order, and every schedule that could not go on (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[FaultEvent] = []
        self.failures: list[str] = []

    def record(self, kind: str, what: str, *, began: float) -> None:
        """A fault that began at `began` (`time.time()`) is done."""
        with self._lock:
            self.events.append(FaultEvent(began, time.time(), kind, what))

    def failed(self, what: str) -> None:
        """A schedule stopped on an error."""
        with self._lock:
            self.failures.append(what)

    def summary(self) -> str:
        """The report: a count per kind, then one line per fault with when it began and ended (UTC)."""
        counts = Counter(e.kind for e in self.events)
        head = f"faults: {len(self.events)}" + (
            " (" + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ")" if counts else ""
        )
        lines = [head]
        lines += [
            f"  {_clock(e.began)}-{_clock(e.at)} {e.kind}: {e.what}"
            for e in self.events
        ]
        lines += [f"  FAILED: {f}" for f in self.failures]
        return "\n".join(lines)


class Schedule:
    """Calls `act(n)` (n = 0, 1, ...) every `every_s` seconds on a thread of its own, until `stop`
    or until `act` says there is nothing left to do (False). A fault under way when `stop` is
    called finishes first (a killed process is started again, a move reaches its end). An error
    ends the schedule and is logged as a failure."""

    def __init__(self, name: str, every_s: float, act: Callable[[int], bool], log: FaultLog) -> None:
        self._name, self._every_s, self._act, self._log = name, every_s, act, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"check-{name}", daemon=True)

    def start(self) -> None:
        """Begin the schedule (nothing if no interval)."""
        if self._every_s > 0:
            self._thread.start()

    def stop(self) -> None:
        """End the schedule, once its fault under way is done."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for n in itertools.count():
            if self._stop.wait(self._every_s):
                return
            try:
                if not self._act(n):
                    return
            except (RuntimeError, TimeoutError, ValueError, OSError, psycopg.Error) as exc:
                # The run's proofs still show what it cost; the report says the schedule stopped.
                self._log.failed(f"{self._name}: {exc}")
                return


def kill_processes(targets: list[Daemon], kind: str, log: FaultLog) -> Callable[[int], bool]:
    """SIGKILL `targets` in turn, each started again `DOWN_S` later."""

    def act(n: int) -> bool:
        began = time.time()
        if not targets:
            return False
        daemon = targets[n % len(targets)]
        if daemon.proc is None:
            return False
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        pid = daemon.proc.pid
        time.sleep(DOWN_S)
        _start_again(daemon)
        new_pid = daemon.proc.pid if daemon.proc else 0
        log.record(kind, f"SIGKILL {daemon.name} (pid {pid}), started again (pid {new_pid})", began=began)
        return True

    return act


def _start_again(daemon: Daemon) -> None:
    """Start a killed process again, retrying while it exits at once (a shard daemon whose
    database is down at that moment, under `--kill-postgres-every`, refuses to start)."""
    for attempt in range(START_ATTEMPTS):
        try:
            daemon.start()
            return
        except (RuntimeError, TimeoutError) as exc:
            if attempt == START_ATTEMPTS - 1:
                raise RuntimeError(f"{daemon.name} did not start again: {exc}") from None
            time.sleep(1.0)


def _writable(db: LocalPostgres | ReplicatedPostgres) -> LocalPostgres:
    """The server of a shard that accepts writes now."""
    return db.current_primary if isinstance(db, ReplicatedPostgres) else db


def kill_postgres(cluster: LocalCluster, log: FaultLog) -> Callable[[int], bool]:
    """SIGKILL each shard's PostgreSQL in turn (the writable server, its backends with it), started
    again `DOWN_S` later on the same port, where it recovers from its WAL."""

    def act(n: int) -> bool:
        began = time.time()
        shard = cluster.shard_ids[n % len(cluster.shard_ids)]
        with cluster.holding(shard) as db:
            server = _writable(db)
            pid = server.kill()
            time.sleep(DOWN_S)
            server.start()
            new_pid = server.postmaster_pid()
        log.record(
            "PostgreSQL SIGKILL",
            f"{shard}'s PostgreSQL on port {server.port} (postmaster pid {pid}) and its backends,"
            f" started again (postmaster pid {new_pid})",
            began=began,
        )
        return True

    return act


def fail_over(cluster: LocalCluster, log: FaultLog) -> Callable[[int], bool]:
    """Each shard once, in turn: SIGKILL its primary (postmaster and backends), promote its
    synchronous standby. Once promoted a shard has no standby left, so it is not failed over again."""
    done: set[str] = set()

    def act(_: int) -> bool:
        began = time.time()
        shard = next((s for s in cluster.shard_ids if s not in done), None)
        if shard is None:
            return False
        with cluster.holding(shard) as db:
            if not isinstance(db, ReplicatedPostgres):
                raise RuntimeError(f"{shard} has no standby to fail over to")
            pid = db.primary.postmaster_pid()
            db.kill_primary()
            db.promote()
            with psycopg.connect(db.standby.dsn, autocommit=True, connect_timeout=5) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        done.add(shard)
        log.record(
            "failover",
            f"{shard}'s primary on port {db.primary.port} (postmaster pid {pid}) SIGKILLed, its standby on"
            f" port {db.standby.port} promoted (in recovery: {'yes' if row and row[0] else 'no'})",
            began=began,
        )
        return True

    return act


def moves(cluster: LocalCluster, log: FaultLog, *, kill_orchestrator: bool) -> Callable[[int], bool]:
    """A slot range moved away and back, one move per turn (`check_moves.Moves`)."""
    mover = Moves(cluster, kill_orchestrator=kill_orchestrator)

    def act(n: int) -> bool:
        began = time.time()
        done = mover.act(n)
        kind = "move with its orchestrator SIGKILLed" if done.killed_after else "move"
        log.record(kind, done.describe(), began=began)
        return True

    return act


def _clock(moment: float) -> str:
    """A wall-clock moment as the report prints it: UTC, to the millisecond."""
    return datetime.fromtimestamp(moment, UTC).strftime("%H:%M:%S.%f")[:-3]


def _usage(ours: argparse.Namespace) -> str:
    """Why these flags cannot run together ("" if they can)."""
    if ours.shards < 1:
        return "--shards must be 1 or more"
    if ours.move_every > 0 and ours.shards < 2:
        return "--move-every needs --shards 2 or more"
    if ours.move_every > 0 and ours.failover_every > 0:
        # A move's logical replication slot lives on the primary and is not kept on the standby:
        # a failover mid-move loses it, which this schedule does not set out to show.
        return "--move-every and --failover-every cannot run together (a failover drops a move's replication slot)"
    return ""


def _schedules(cluster: LocalCluster, ours: argparse.Namespace, log: FaultLog) -> list[Schedule]:
    daemons = list(cluster.shard_daemons)
    router = [cluster.router] if cluster.router else []
    schedules = [
        Schedule(
            "shard daemon kills",
            ours.kill_shard_daemon_every,
            kill_processes(daemons, "shard daemon SIGKILL", log),
            log,
        ),
        Schedule("router kills", ours.kill_router_every, kill_processes(router, "router SIGKILL", log), log),
        Schedule("PostgreSQL kills", ours.kill_postgres_every, kill_postgres(cluster, log), log),
        Schedule("failovers", ours.failover_every, fail_over(cluster, log), log),
    ]
    if ours.move_every > 0:
        act = moves(cluster, log, kill_orchestrator=ours.kill_orchestrator_mid_move)
        schedules.append(Schedule("moves", ours.move_every, act, log))
    return schedules


def main(argv: Sequence[str]) -> int:
    """Start a cluster, run the check with the faults asked for, report them; the check's exit code."""
    ours, rest = _parser().parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        return check_cli.main(["--help"])
    if ours.kill_orchestrator_mid_move and ours.move_every <= 0:
        ours.move_every = check_cli.DEFAULT_MOVE_EVERY_S
    wrong = _usage(ours)
    if wrong:
        print(f"shard-router check: {wrong}", file=sys.stderr)
        return 2
    data_dir = Path(tempfile.mkdtemp(prefix="shard-router-check-")) / "cluster"
    cluster = LocalCluster(
        data_dir=data_dir,
        shards=ours.shards,
        router_port=free_port(),
        http_port=0,
        standby=ours.failover_every > 0,
    )
    print(f"starting a local cluster of {ours.shards} shards in {data_dir} ...", flush=True)
    log = FaultLog()
    schedules: list[Schedule] = []
    try:
        cluster.start()
        schedules = _schedules(cluster, ours, log)
        for s in schedules:
            s.start()
        target = ["--target", f"127.0.0.1:{cluster.router_port}", "--databases", str(cluster.databases_path)]
        history = [] if "--history" in rest else ["--history", str(Path.cwd() / "check-local.jsonl")]
        code = check_cli.main([*target, *history, *rest], before_proof=lambda: _stop(schedules, log))
    finally:
        _stop(schedules, log)
        cluster.stop()
        _keep_logs(data_dir, log)
        with contextlib.suppress(OSError):
            cluster.wipe()
        shutil.rmtree(data_dir.parent, ignore_errors=True)
    return code


def _keep_logs(data_dir: Path, log: FaultLog) -> None:
    """When a schedule failed, copy the cluster's logs here before the cluster is deleted."""
    if not log.failures or not (data_dir / "logs").is_dir():
        return
    kept = Path.cwd() / datetime.now(UTC).strftime("check-local-logs-%Y%m%dT%H%M%SZ")
    shutil.copytree(data_dir / "logs", kept, dirs_exist_ok=True)
    print(f"a fault schedule failed: the cluster's logs are kept in {kept}", flush=True)


def _stop(schedules: list[Schedule], log: FaultLog) -> str:
    """Stop every schedule (each fault under way finishes); the faults done, as the report's lines."""
    for s in schedules:
        s.stop()
    return log.summary()


__all__ = ["FaultEvent", "FaultLog", "Schedule", "fail_over", "kill_postgres", "kill_processes", "main", "moves"]
