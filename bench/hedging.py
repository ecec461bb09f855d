"""`python -m bench.hedging`: one daemon of a two-daemon shard stalled under load, with the router's
hedged forwarding off and on, side by side in one run (bench/README.md).

One durable PostgreSQL (the harness's settings), one shard (database `shard_a`, every slot) served by
two `shardd serve` processes, and two routers in front of both: one plain, one hedging after
`--hedge-after-ms` (`ROUTER_HEDGE_AFTER_MS`, budget `ROUTER_HEDGE_BUDGET_PERCENT`). The Node.js load
generator sends keyed Deposits through a router at `--concurrency` callers for `--duration` s; in a
stalled cell the second daemon is stopped with SIGSTOP for `--stall` s in the middle of the measured
window (a long GC pause, a CPU-starved node), then continued. Three cells:

  no stall        hedging off: the reference
  stall, off      what callers see today
  stall, on       the same stall with hedging

Per cell: ops/s, p50/p99/p99.9 and the slowest call, and the hedges the router sent and won per call
(from its `router_hedges_total`). The target: with hedging, p99.9 and the slowest call at most 2x the
reference's p99.9, and the extra attempts within the budget. A call the stalled daemon had already
claimed cannot be hedged past (its key's lock lives in that daemon's database session): its hedge
waits for the daemon to go on, so the slowest call is bounded below by the stall itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import LoadSpec, ensure_installed, run_load
from bench.results import CellResult
from bench.services import BenchSystem, bench_system
from shardrouter.localcluster.cluster import Daemon
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.hedging import HEDGE_BURST

#: The three cells: (name, router, stall).
CELLS = (("no stall, hedging off", "router-plain", False), ("stall, hedging off", "router-plain", True))
HEDGED_CELL = ("stall, hedging on", "router-hedged", True)
#: With hedging, p99.9 and the slowest call at most this many times the reference's p99.9.
TARGET_FACTOR = 2.0


@dataclass
class HedgingOptions:
    """What one run measures."""

    duration_s: float = 10.0
    warmup_s: float = 1.0
    concurrency: int = 16
    stall_s: float = 2.0
    hedge_after_ms: int = 80
    hedge_budget_percent: float = 10.0
    #: The daemons' SHARDD_STALLED_CLAIM_MS (0: a hedge waits for a stalled claim to go on).
    stalled_claim_ms: int = 100
    accounts: int = 1000
    #: Keep the work folder (the daemons' and routers' logs under logs/) for a look at the tail.
    keep: bool = False


@dataclass
class HedgingCell:
    """One cell: the load generator's figures and the router's hedges over it."""

    name: str
    load: CellResult
    hedges_sent: float
    hedges_won: float
    #: Every call the router answered over the cell, its warm-up included (the hedges' denominator).
    calls: float

    def row(self) -> dict[str, Any]:
        """The cell's figures for the table and the JSON."""
        latency = self.load.latency
        calls = max(self.calls, 1.0)
        return {
            "cell": self.name,
            "ops_s": round(self.load.throughput, 1),
            "p50_ms": latency["p50_ms"],
            "p99_ms": latency["p99_ms"],
            "p999_ms": latency["p999_ms"],
            "max_ms": latency["max_ms"],
            "errors": self.load.errors,
            "hedges_per_call": round(self.hedges_sent / calls, 4),
            "hedges_won_per_call": round(self.hedges_won / calls, 4),
        }


@dataclass
class HedgingResult:
    """A run's cells and verdict."""

    options: HedgingOptions
    cells: list[HedgingCell] = field(default_factory=list)

    def verdict(self) -> tuple[bool, str]:
        """Whether hedging kept the stalled cell's tail within TARGET_FACTOR of the reference."""
        by_name = {c.name: c for c in self.cells}
        reference, hedged = by_name[CELLS[0][0]].load.latency, by_name[HEDGED_CELL[0]]
        bound = TARGET_FACTOR * reference["p999_ms"]
        tail = max(hedged.load.latency["p999_ms"], hedged.load.latency["max_ms"])
        budget = self.options.hedge_budget_percent / 100
        extra = hedged.hedges_sent / max(hedged.calls, 1.0)
        # The bucket starts full: its burst comes on top of the share.
        passed = tail <= bound and extra <= budget + HEDGE_BURST / max(hedged.calls, 1.0)
        return passed, (
            f"with hedging, p99.9 {hedged.load.latency['p999_ms']:.0f} ms and slowest"
            f" {hedged.load.latency['max_ms']:.0f} ms against {TARGET_FACTOR:g}x the reference's p99.9"
            f" ({bound:.0f} ms); extra attempts {extra:.1%} of calls (budget {budget:.0%} + a burst of"
            f" {HEDGE_BURST:g}):"
            f" {'pass' if passed else 'miss'}"
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        passed, verdict = self.verdict()
        return {
            "options": self.options.__dict__,
            "cells": [c.row() for c in self.cells],
            "passed": passed,
            "verdict": verdict,
        }


def _write_map(system: BenchSystem, addresses: list[str]) -> Path:
    """A shard map giving every slot to shard-a, served at `addresses`."""
    path = system.workdir / "hedging-map.json"
    path.write_text(
        json.dumps(
            {"version": 1, "shards": [{"id": "shard-a", "addresses": addresses, "slot_ranges": [[0, 16383]]}]}
        )
    )
    return path


def _start_router(
    system: BenchSystem, name: str, shard_map: Path, hedge: dict[str, str]
) -> tuple[Daemon, int]:
    """A router in front of the shard (no HTTP front), with its metrics on a port of its own."""
    metrics = free_port()
    return system.start_router(
        name, shard_map=shard_map, http=False, metrics_port=metrics, extra=hedge
    ), metrics


def _router_counts(metrics_port: int) -> tuple[float, float, float]:
    """router_hedges_total (sent, won) and router_requests_total (every call, warm-up included)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    totals = {"sent": 0.0, "won": 0.0, "calls": 0.0}
    for line in lines:
        if line.startswith("router_hedges_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            totals[result] = totals.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("router_requests_total{"):
            totals["calls"] += float(line.rsplit(" ", 1)[1])
    return totals["sent"], totals["won"], totals["calls"]


def _stall_in_the_middle(pid: int, options: HedgingOptions) -> threading.Thread:
    """SIGSTOP `pid` halfway through the measured window for `stall_s`, then SIGCONT."""

    def stall() -> None:
        time.sleep(options.warmup_s + max(0.0, (options.duration_s - options.stall_s) / 2))
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(options.stall_s)
        finally:
            os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=stall, name="stall", daemon=True)
    thread.start()
    return thread


def run_hedging(options: HedgingOptions, say: Any = print) -> HedgingResult:
    """The whole run; every process and the temp dir are gone when it returns or raises."""
    node = ensure_installed()
    result = HedgingResult(options)
    with bench_system(options.accounts, {}, keep=options.keep) as system:
        say("bench.hedging: starting PostgreSQL, two daemons of one shard and two routers ...")
        system.start_postgres()
        system.plan_shards()
        ports = [free_port(), free_port()]
        shard_map = _write_map(system, [f"127.0.0.1:{p}" for p in ports])
        daemons = []
        for name, port in zip(("shard-a", "shard-a2"), ports, strict=True):
            system._ports[name] = port
            daemons.append(
                system.start_shard(
                    name,
                    shard_id="shard-a",
                    database="shard_a",
                    extra={
                        "SHARDD_SHARD_MAP": str(shard_map),
                        "SHARDD_STALLED_CLAIM_MS": str(options.stalled_claim_ms),
                    },
                )
            )
        system.seed_accounts("shard_a", system.accounts_a)
        routers = {
            "router-plain": _start_router(system, "router-plain", shard_map, {}),
            "router-hedged": _start_router(
                system,
                "router-hedged",
                shard_map,
                {
                    "ROUTER_HEDGE_AFTER_MS": str(options.hedge_after_ms),
                    "ROUTER_HEDGE_BUDGET_PERCENT": str(options.hedge_budget_percent),
                },
            ),
        }
        for name, router, stalled in (*CELLS, HEDGED_CELL):
            daemon, metrics = routers[router]
            before = _router_counts(metrics)
            stall = None
            if stalled:
                assert daemons[1].proc is not None
                stall = _stall_in_the_middle(daemons[1].proc.pid, options)
            load = run_load(
                node,
                LoadSpec(daemon.address, accounts=system.accounts_file("a")),
                scenario=name,
                concurrency=options.concurrency,
                duration_s=options.duration_s,
                warmup_s=options.warmup_s,
                tracked=system.tracked(),
            )
            if stall is not None:
                stall.join()
            after = _router_counts(metrics)
            sent, won, calls = (a - b for a, b in zip(after, before, strict=True))
            cell = HedgingCell(name, load, sent, won, calls)
            result.cells.append(cell)
            row = cell.row()
            say(
                f"  {name:22s} {row['ops_s']:8.1f} ops/s p50 {row['p50_ms']:.1f} p99 {row['p99_ms']:.1f}"
                f" p99.9 {row['p999_ms']:.1f} max {row['max_ms']:.1f} ms; hedges {cell.hedges_sent:.0f} sent,"
                f" {cell.hedges_won:.0f} won"
            )
            for slow in load.extra.get("slowest", [])[:3]:
                say(
                    f"    slow: {slow['ms']:.0f} ms from {slow['at_ms']} ms into the window, {slow['status']},"
                    f" key {slow['key']} account {slow['account']}"
                )
    return result


def markdown_table(result: HedgingResult) -> str:
    """The cells as a Markdown table, with the verdict."""
    options = result.options
    lines = [
        f"One shard of two daemons; keyed Deposits through the router, {options.concurrency} callers,"
        f" {options.duration_s:g} s per cell after {options.warmup_s:g} s; stall: the second daemon"
        f" SIGSTOPped for {options.stall_s:g} s mid-cell; hedging after {options.hedge_after_ms} ms,"
        f" budget {options.hedge_budget_percent:g} %; SHARDD_STALLED_CLAIM_MS={options.stalled_claim_ms}.",
        "",
        "| cell | ops/s | p50 ms | p99 ms | p99.9 ms | slowest ms | errors | hedges / call (won) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in result.cells:
        row = cell.row()
        lines.append(
            f"| {row['cell']} | {row['ops_s']:,.0f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |"
            f" {row['p999_ms']:.1f} | {row['max_ms']:.0f} | {sum(row['errors'].values())} |"
            f" {row['hedges_per_call']:.3f} ({row['hedges_won_per_call']:.3f}) |"
        )
    lines += ["", f"Target: {result.verdict()[1]}"]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[HedgingOptions, Path | None]:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.hedging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per cell (default 10)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per cell (default 1)")
    parser.add_argument("--concurrency", type=int, default=16, help="callers (default 16)")
    parser.add_argument("--stall", type=float, default=2.0, help="seconds the daemon is stopped (default 2)")
    parser.add_argument(
        "--hedge-after-ms", type=int, default=80, help="the hedging router's delay, near the p99 (default 80)"
    )
    parser.add_argument("--hedge-budget-percent", type=float, default=10.0, help="its budget (default 10)")
    parser.add_argument(
        "--stalled-claim-ms",
        type=int,
        default=100,
        help="the daemons' SHARDD_STALLED_CLAIM_MS (default 100; 0: a hedge waits for a stalled claim)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (processes' logs under logs/) afterwards"
    )
    args = parser.parse_args(argv)
    if args.stall >= args.duration:
        parser.error("--stall must be shorter than --duration")
    return HedgingOptions(
        duration_s=args.duration,
        warmup_s=args.warmup,
        concurrency=args.concurrency,
        stall_s=args.stall,
        hedge_after_ms=args.hedge_after_ms,
        hedge_budget_percent=args.hedge_budget_percent,
        stalled_claim_ms=args.stalled_claim_ms,
        keep=args.keep,
    ), args.json


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    options, json_path = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    result = run_hedging(options, say=lambda line: print(line, flush=True))
    print(f"\n{markdown_table(result)}\n\n({time.monotonic() - started:.0f} s)")
    if json_path:
        json_path.write_text(json.dumps(result.as_dict(), indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
