"""`python -m bench.peer`: the peer users pick instead, beside our shard, in one run (bench/README.md).

One fresh durable PostgreSQL (the harness's settings), one `redis-server` of the run's own (loopback,
free port, no persistence, its files in the run's temp dir), and two servers on it: our shard daemon
(`shardd serve`, database `shard_a`) and the Powertools peer (`bench/peer_server.py`: the same
Deposit, guarded by `@idempotent_function` on Redis, payload validation OFF, database `peer`). The
same Node.js load generator drives both, cell after cell, alternating sides:

  new keys    Deposits with a fresh key each, at each concurrency (default 8 and 32)
  replays     the same number of distinct completed keys resent (created first, per side)
  kill run    bench/killrun.py: SIGKILL + restart under duplicate-laden load, counted from the database

CPU per new key is every process's CPU over the c=8 cell (or the lowest concurrency) divided by its
operations: the server, PostgreSQL (postmaster and backends) and, for the peer, Redis. Each side
answers that cell as fast as it can, and PostgreSQL's fixed costs (commits, wake-ups, its background
processes) are spread over however many calls that is, so a slower side also looks costlier per call.
One more cell per side at one rate for both (`--same-rate`, by default 70 % of the slower side's new
keys/s at the lowest concurrency, the load generator pacing the calls) compares the CPU per new key
without that.

Skipped with one line (exit 0) when `redis-server` or the `bench-peer` extra is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bench.killrun import KillPlan, KillRunResult, kill_run
from bench.loadgen import LoadSpec, ensure_installed, run_load
from bench.procstat import Tracked
from bench.results import CellResult
from bench.services import BenchSystem, bench_system, wait_until
from shardrouter.localcluster.cluster import Daemon
from shardrouter.localcluster.postgres import free_port

#: The same-rate cells' rate by default, as a share of the slower side's new keys/s: below both
#: sides' capacity, so each serves all of it.
SAME_RATE_SHARE = 0.7
#: The two sides: (name in the tables, daemon name, database).
SIDES = (("Powertools + Redis", "peer", "peer"), ("our shard", "shard-a", "shard_a"))
PEER_NOTE = (
    "Powertools 3.37 RedisCachePersistenceLayer, payload validation OFF (its completion write drops the"
    " validation hash, so every replay would fail validation), local cache off, in-progress expiry ="
    " the call's deadline"
)


def missing_requirement() -> str | None:
    """Why the peer cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server not found on PATH (Debian: apt-get install redis-server)"
    for module in ("aws_lambda_powertools", "boto3", "redis"):
        if importlib.util.find_spec(module) is None:
            return f"{module} not installed (pip install -e '.[bench-peer]')"
    return None


class RedisServer:
    """A `redis-server` on a free loopback port, no RDB/AOF, its working dir inside `workdir`."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait for PONG."""
        command = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        command += ["--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "yes"]
        with (self.dir / "redis.log").open("ab") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        if not wait_until(self.ping, 15, 0.05):
            raise TimeoutError(f"redis-server did not answer; see {self.dir / 'redis.log'}")

    def ping(self) -> bool:
        """PONG from the server (the plain protocol: no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class PeerOptions:
    """What `python -m bench.peer` was asked to do."""

    duration_s: float = 5.0
    warmup_s: float = 1.0
    concurrencies: tuple[int, ...] = (8, 32)
    accounts: int = 1000
    replay_keys: int = 2000
    kill: KillPlan = field(default_factory=KillPlan)
    #: New keys/s of the same-rate cells (0: 70 % of the slower side's at the lowest concurrency).
    same_rate: float = 0.0


@dataclass
class PeerResult:
    """The cells of both sides, the kill runs, and what the report says about the run."""

    cells: list[CellResult] = field(default_factory=list)
    kill_runs: list[KillRunResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: New keys/s offered to each side in the same-rate cells (0: none ran).
    same_rate: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return {
            "cells": [c.as_dict() for c in self.cells],
            "kill_runs": [k.as_dict() for k in self.kill_runs],
            "rows": summary_rows(self),
            "same_rate": self.same_rate,
            "notes": self.notes,
        }


def start_peer(system: BenchSystem, redis: RedisServer) -> Daemon:
    """The Powertools peer on database `peer` (migrated by the shard's own code at start)."""
    assert system.pg is not None
    system.pg.create_database("peer")
    port = free_port()
    env = system._env(
        {
            "SHARDD_DSN": system.dsn("peer"),
            "SHARDD_LISTEN": f"127.0.0.1:{port}",
            "SHARDD_SHARD_MAP": "",
            "PEER_REDIS_PORT": str(redis.port),
        }
    )
    daemon = Daemon("peer", [sys.executable, "-m", "bench.peer_server"], env, port, system._log("peer"))
    return system._start(daemon)


def _cells(
    system: BenchSystem, redis: RedisServer, options: PeerOptions, node: str, result: PeerResult, say: Any
) -> None:
    """New keys at every concurrency, then replays, alternating the sides within each concurrency."""

    def cell(scenario: str, daemon: str, keys: str, concurrency: int, rate: float = 0.0) -> None:
        spec = LoadSpec(
            system.daemons[daemon].address, keys=keys, accounts=system.accounts_file("a"), rate=rate
        )
        tracked = [*system.tracked(), Tracked("redis", redis.proc.pid if redis.proc else 0)]
        found = run_load(
            node,
            spec,
            scenario=scenario,
            concurrency=concurrency,
            duration_s=options.duration_s,
            warmup_s=options.warmup_s,
            tracked=tracked,
        )
        result.cells.append(found)
        say(
            f"  {scenario:14s} c={concurrency:<3d} {found.throughput:8.1f} ops/s p99 {found.latency['p99_ms']:.2f} ms"
        )

    for concurrency in options.concurrencies:
        for _, daemon, _ in SIDES:
            cell(f"{daemon}-new", daemon, "new", concurrency)
    low = min(options.concurrencies)
    rate = options.same_rate or round(
        SAME_RATE_SHARE * min(_throughput(result, f"{daemon}-new", low) for _, daemon, _ in SIDES)
    )
    if rate > 0:
        result.same_rate = rate
        for _, daemon, _ in SIDES:
            cell(f"{daemon}-new-same-rate", daemon, "new", low, rate=rate)
        result.notes.append(
            f"same rate: {rate:,.0f} new keys/s offered to each side, {low} callers (the load generator paces the calls)"
        )
    lists = {}
    for _, daemon, _ in SIDES:
        path = system.workdir / f"{daemon}-replay-keys.jsonl"
        spec = LoadSpec(
            system.daemons[daemon].address,
            accounts=system.accounts_file("a"),
            record=path,
            max_ops=options.replay_keys,
        )
        made = run_load(node, spec, scenario="setup", concurrency=32, duration_s=300, warmup_s=0, tracked=[])
        if made.ok == 0:
            raise RuntimeError(f"no completed key could be made on {daemon} for the replays")
        lists[daemon] = f"list:{path}"
    for concurrency in options.concurrencies:
        for _, daemon, _ in SIDES:
            cell(f"{daemon}-replay", daemon, lists[daemon], concurrency)
    result.notes.append(f"replays cycle through {options.replay_keys} distinct completed keys per side")


def run_peer(options: PeerOptions, say: Any = print) -> PeerResult:
    """The whole run; every process and the temp dir are gone when it returns or raises."""
    node = ensure_installed()
    result = PeerResult(notes=[PEER_NOTE])
    with bench_system(options.accounts, {}) as system:
        say("bench.peer: starting PostgreSQL, redis-server, the shard daemon and the Powertools peer ...")
        system.start_postgres()
        system.plan_shards()
        redis = RedisServer(system.workdir)
        try:
            redis.start()
            system.start_shard("shard-a", shard_id="shard-a", database="shard_a")
            start_peer(system, redis)
            for _, _, database in SIDES:
                system.seed_accounts(database, system.accounts_a)
            _cells(system, redis, options, node, result, say)
            for label, daemon, database in SIDES:
                say(f"bench.peer: kill run on {label}: {options.kill.kills} SIGKILLs ...")
                found = kill_run(
                    label, system.daemons[daemon], system.dsn(database), system.accounts_a, options.kill
                )
                result.kill_runs.append(found)
                say(
                    f"  {label}: {found.applied_twice} applied twice, {found.lost} lost, {found.unresolved} unresolved"
                )
        finally:
            for started in list(system.daemons.values()):
                started.stop(timeout_s=10)  # before Redis: the peer must not outlive its store
            redis.stop()
    return result


def _cell(result: PeerResult, scenario: str, concurrency: int) -> CellResult | None:
    return next((c for c in result.cells if c.scenario == scenario and c.concurrency == concurrency), None)


def _per_op_us(cell: CellResult | None, name: str) -> float:
    if cell is None or cell.ok <= 0 or name not in cell.cpu_s:
        return 0.0
    return cell.cpu_s[name] / cell.ok * 1e6


def summary_rows(result: PeerResult) -> list[dict[str, Any]]:
    """One row per side: new keys and replays ok/s per concurrency, p99 and CPU per new key at the
    lowest concurrency, and the kill run's counts."""
    concurrencies = sorted({c.concurrency for c in result.cells})
    low = concurrencies[0] if concurrencies else 0
    rows = []
    for label, daemon, _ in SIDES:
        first = _cell(result, f"{daemon}-new", low)
        paced = _cell(result, f"{daemon}-new-same-rate", low)
        cpu, cpu_paced = _cpu_per_op(first, daemon), _cpu_per_op(paced, daemon)
        kill = next((k for k in result.kill_runs if k.side == label), None)
        rows.append(
            {
                "side": label,
                "new_ok_s": {c: _throughput(result, f"{daemon}-new", c) for c in concurrencies},
                "replay_ok_s": {c: _throughput(result, f"{daemon}-replay", c) for c in concurrencies},
                "p99_ms_low": first.latency["p99_ms"] if first else 0.0,
                "errors_new": sum(
                    sum(c.errors.values()) for c in result.cells if c.scenario == f"{daemon}-new"
                ),
                "low_concurrency": low,
                "cpu_us_per_new_key": cpu,
                "same_rate_ok_s": paced.throughput if paced else 0.0,
                "cpu_us_per_new_key_same_rate": cpu_paced,
                "kill_run": kill.as_dict() if kill else None,
            }
        )
    return rows


def _cpu_per_op(cell: CellResult | None, daemon: str) -> dict[str, float]:
    """CPU µs per operation of a side's processes: its server, PostgreSQL, and the peer's Redis."""
    cpu = {"server": _per_op_us(cell, daemon), "postgres": _per_op_us(cell, "postgres")}
    if daemon == "peer":
        cpu["redis"] = _per_op_us(cell, "redis")
    return cpu


def _throughput(result: PeerResult, scenario: str, concurrency: int) -> float:
    cell = _cell(result, scenario, concurrency)
    return cell.throughput if cell else 0.0


def markdown_table(result: PeerResult) -> str:
    """The side-by-side table (and the kill runs' details under it)."""
    rows = summary_rows(result)
    if not rows:
        return ""
    concurrencies = list(rows[0]["new_ok_s"])
    cs = " / ".join(f"c={c}" for c in concurrencies)
    low = rows[0]["low_concurrency"]
    lines = [
        f"| side | new keys ok/s ({cs}) | p99 ms (c={low}) | CPU per new key µs (c={low}): server + PostgreSQL"
        f" (+ Redis) | the same at one rate: ok/s, CPU µs | replays ok/s ({cs}) | kill run: applied twice / lost |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        cpu = row["cpu_us_per_new_key"]
        parts = " + ".join(f"{v:,.0f}" for v in cpu.values())
        paced = row["cpu_us_per_new_key_same_rate"]
        same_rate = (
            f"{row['same_rate_ok_s']:,.0f}: {' + '.join(f'{v:,.0f}' for v in paced.values())} = {sum(paced.values()):,.0f}"
            if row["same_rate_ok_s"]
            else "-"
        )
        kill = row["kill_run"]
        killed = (
            f"{kill['applied_twice']} / {kill['lost']} ({kill['kills']} kills, {kill['operations']:,} ops,"
            f" {kill['duplicates_sent']:,} duplicates)"
            if kill
            else "-"
        )
        lines.append(
            f"| {row['side']} | {' / '.join(f'{v:,.0f}' for v in row['new_ok_s'].values())}"
            f" | {row['p99_ms_low']:.1f} | {parts} = {sum(cpu.values()):,.0f} | {same_rate}"
            f" | {' / '.join(f'{v:,.0f}' for v in row['replay_ok_s'].values())} | {killed} |"
        )
    lines += ["", "Kill runs (counted from each side's database after the run):", ""]
    lines += [
        f"- {k.side}: {k.kills} SIGKILLs in {k.seconds} s, {k.operations:,} operations ({k.duplicates_sent:,}"
        f" duplicate sends, {k.calls:,} calls with retries; answers {k.answers}); {k.acknowledged:,} answered OK,"
        f" {k.unresolved} never; in flight at each kill: {k.in_flight_at_kills}; keys with more than one ledger row: {k.applied_twice} ({k.extra_rows} extra rows);"
        f" OK but no ledger row: {k.lost}; balances minus acknowledged amounts: {k.balance_off:+,}"
        for k in result.kill_runs
    ]
    lines += ["", *(f"Note: {n}" for n in result.notes)]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per cell (default 1)")
    parser.add_argument("--concurrency", default="8,32", help="comma-separated (default 8,32)")
    parser.add_argument("--accounts", type=int, default=1000, help="accounts the load picks from")
    parser.add_argument("--replay-keys", type=int, default=2000, help="completed keys per side to resend")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs per kill run (default 5)")
    parser.add_argument("--kill-duplicates", type=float, default=0.25, help="share of duplicate sends")
    parser.add_argument("--kill-seconds", type=float, default=20.0, help="length of a kill run (default 20)")
    parser.add_argument("--kill-ops", type=int, default=50_000, help="most operations per kill run")
    parser.add_argument("--kill-callers", type=int, default=8, help="callers in a kill run (default 8)")
    parser.add_argument(
        "--same-rate",
        type=float,
        default=0.0,
        help="new keys/s of the same-rate cells (default 0: 70%% of the slower side's; -1: none)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    return parser.parse_args(argv)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM takes the way out Ctrl-C takes: the context managers stop every process.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: one clear line and exit 0 when the peer cannot run here."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    missing = missing_requirement()
    if missing:
        print(f"bench.peer: skipped: {missing}")
        return 0
    kill = KillPlan(
        kills=args.kills,
        duplicates=args.kill_duplicates,
        seconds=args.kill_seconds,
        max_ops=args.kill_ops,
        callers=args.kill_callers,
    )
    options = PeerOptions(
        duration_s=args.duration,
        warmup_s=args.warmup,
        concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
        accounts=args.accounts,
        replay_keys=args.replay_keys,
        kill=kill,
        same_rate=args.same_rate,
    )
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run_peer(options, say=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("bench.peer: interrupted; every process was stopped and the temp dir removed", file=sys.stderr)
        return 130
    table = markdown_table(result)
    print(f"\n{table}\n\n({time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(result.as_dict(), indent=2, default=str))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
