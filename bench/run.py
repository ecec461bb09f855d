"""One benchmark run: start the system, run every selected scenario at every concurrency, then growth.

Scenarios (rows of the table; `python -m bench --list` prints this):

  pgbench-deposit   pgbench sending exactly the statements one Deposit sends today (captured)
  pgbench-transfer  the same for a same-shard Transfer
  pgbench-limit     one Deposit's writes folded into one CTE statement: the limit
  shard-deposit     Deposit with new keys, straight to the shard daemon
  shard-deposit-nopipeline  the same to a daemon with SHARDD_DB_PIPELINE=false (12 round trips, less CPU)
  hot-account       shard-deposit's load with every Deposit on one account (a merchant's, a fee account)
  shard-transfer    same-shard Transfer with new keys, straight to the shard daemon
  noidem-deposit    the same Deposit handler without the idempotency interceptor (bench/noidem_server.py)
  noidem-hot-account  hot-account's load on that handler: what one account's row lock costs without us
  router-deposit    Deposit with new keys through the router
  http-deposit      the same over HTTP/JSON: POST /v1/deposits to the router's HTTP front
  replay-memory     resending distinct completed keys; the shard answers from its in-memory cache
  replay-db         the same against a second daemon on the same database with the cache off
  router-replay     resending distinct completed keys (created through the HTTP front) via the router, gRPC
  http-replay       the same keys and request bodies resent over HTTP through the router
  conflict          one key held in flight; every call resends it: ABORTED answers per second
  http-conflict     one key held in flight, resent over HTTP through the router: 409 answers per second
  cross-shard       Transfer through the router to another shard's account, until the credit lands
  round-trips       one call at a time (c=1, --round-trip-calls calls) through a counting proxy in front
                    of PostgreSQL: round trips (Sync/Flush/Query messages) and statements
                    (pg_stat_statements) per new-key Deposit, per replay from the database, and per
                    Deposit of the no-idempotency twin

Growth: shard-deposit at one concurrency with the key table bulk-loaded to each size, and the time of a
retention run at that size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import psycopg

from bench import pgbench
from bench.loadgen import LoadSpec, ensure_installed, run_load
from bench.results import CellResult
from bench.services import CURRENCY, WIRE_ROLE, BenchSystem, bench_system
from shardrouter.core.callers import CALLER_METADATA
from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

log = logging.getLogger(__name__)

SCENARIOS = (
    "pgbench-deposit",
    "pgbench-transfer",
    "pgbench-limit",
    "shard-deposit",
    "shard-deposit-nopipeline",
    "hot-account",
    "shard-transfer",
    "noidem-deposit",
    "noidem-hot-account",
    "router-deposit",
    "http-deposit",
    "replay-memory",
    "replay-db",
    "router-replay",
    "http-replay",
    "conflict",
    "http-conflict",
    "cross-shard",
    "round-trips",
)
#: Rows that need the router (and so shard-b beside shard-a).
ROUTER_ROWS = frozenset(
    {"router-deposit", "http-deposit", "router-replay", "http-replay", "http-conflict", "cross-shard"}
)
DEPOSIT_SCOPE = "/shardrouter.v1.TransferService/Deposit|bench"
DEPOSIT_METHOD = "/shardrouter.v1.TransferService/Deposit"
RETENTION = timedelta(days=30)
#: Bulk-loaded keys are spread over this many days before now: inside partitions that exist, and
#: inside the retention window, like the keys of a busy month.
GROWTH_SPAN_DAYS = 20
GROWTH_CHUNK = 1_000_000
#: The round-trips cells: (row, daemon, database, what the load sends).
ROUND_TRIP_CELLS = (
    ("round-trips/deposit", "shard-a-wire", "shard_a", "new-key Deposits"),
    ("round-trips/replay-db", "shard-a-wire", "shard_a", "replays of those keys (cache off: database)"),
    ("round-trips/noidem-deposit", "noidem-wire", "noidem", "Deposits without idempotency"),
)
#: Calls before each round-trips cell that are not counted: connections made, statements prepared
#: (psycopg prepares a statement on its 5th use), caches warm.
ROUND_TRIP_WARMUP_CALLS = 25


@dataclass
class RunOptions:
    """What `python -m bench` was asked to do."""

    duration_s: float = 5.0
    warmup_s: float = 1.0
    concurrencies: tuple[int, ...] = (1, 8, 32, 128)
    scenarios: tuple[str, ...] = SCENARIOS
    growth: tuple[int, ...] = (0, 1_000_000)
    growth_concurrency: int = 0  # 0: the best concurrency of shard-deposit (else 32)
    accounts: int = 1000
    replay_keys: int = 5000
    shard_env: dict[str, str] = field(default_factory=dict)
    keep: bool = False
    #: Calls counted in each round-trips cell (one at a time).
    round_trip_calls: int = 300
    #: pg_stat_statements preloaded (statements per call in the round-trips rows).
    statement_stats: bool = True


@dataclass
class RunResult:
    """Everything a run measured, plus what the report says about the machine."""

    cells: list[CellResult] = field(default_factory=list)
    growth: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    captured: dict[str, list[str]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return {
            "machine": self.machine,
            "options": self.options,
            "cells": [c.as_dict() for c in self.cells],
            "growth": self.growth,
            "captured_statements": self.captured,
            "notes": self.notes,
        }


def run(options: RunOptions, progress: Callable[[str], None] = print) -> RunResult:
    """The whole run; every process and the temp dir are gone when it returns or raises."""
    node = ensure_installed()
    result = RunResult(options={k: v for k, v in options.__dict__.items()})
    wanted = set(options.scenarios)
    with bench_system(
        options.accounts, options.shard_env, keep=options.keep, statement_stats=options.statement_stats
    ) as system:
        progress("bench: starting PostgreSQL (durable: fsync on, synchronous_commit on) ...")
        system.start_postgres()
        system.plan_shards()
        result.machine = _machine(system)
        cells = _Cells(system, options, node, result, progress)
        if wanted & {"pgbench-deposit", "pgbench-transfer", "pgbench-limit"}:
            cells.pgbench_rows(wanted)
        progress("bench: starting the shard daemons, the router and the baseline ...")
        cells.start_services(wanted, bool(options.growth))
        for scenario in [s for s in SCENARIOS if s in wanted and not s.startswith("pgbench")]:
            if scenario == "round-trips":
                cells.round_trip_rows()
            else:
                cells.grpc_rows(scenario)
        if options.growth:
            cells.growth_rows()
    return result


def _machine(system: BenchSystem) -> dict[str, Any]:
    import os
    import platform

    mem_kb = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        0,
    )
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgresql": system.server_version(),
        "postgresql_settings": system.settings_in_force(),
        "pgbench": pgbench.pgbench_binary(),
    }


#: Scenarios that are new-key Deposits on the accounts of shard a, sent to this process.
_DEPOSIT_TARGETS = {
    "shard-deposit": "shard-a",
    "shard-deposit-nopipeline": "shard-a-nopipeline",
    "noidem-deposit": "noidem",
    "router-deposit": "router",
}


class _Cells:
    """The scenario runners; they share the system, the options and the result being filled."""

    def __init__(
        self,
        system: BenchSystem,
        options: RunOptions,
        node: str,
        result: RunResult,
        progress: Callable[[str], None],
    ) -> None:
        self.system, self.options, self.node, self.result, self.progress = (
            system,
            options,
            node,
            result,
            progress,
        )

    # --- helpers -----------------------------------------------------------------------------------

    def _record(self, cell: CellResult) -> CellResult:
        self.result.cells.append(cell)
        lat = cell.latency
        errors = f" errors={cell.errors}" if cell.errors else ""
        self.progress(
            f"  {cell.scenario:17s} c={cell.concurrency:<4d} {cell.throughput:9.1f} ops/s"
            f"  p50 {lat['p50_ms']:7.2f}  p99 {lat['p99_ms']:7.2f}  p99.9 {lat['p999_ms']:7.2f} ms{errors}"
        )
        return cell

    def _load(self, scenario: str, spec: LoadSpec, concurrency: int) -> CellResult:
        return self._record(
            run_load(
                self.node,
                spec,
                scenario=scenario,
                concurrency=concurrency,
                duration_s=self.options.duration_s,
                warmup_s=self.options.warmup_s,
                tracked=self.system.tracked(),
            )
        )

    def _address(self, name: str) -> str:
        return self.system.daemons[name].address

    # --- pgbench -------------------------------------------------------------------------------------

    def pgbench_rows(self, wanted: set[str]) -> None:
        """Capture one Deposit and one Transfer on a throw-away daemon, then the pgbench cells."""
        system = self.system
        self.progress(
            "bench: capturing the statements of one Deposit and one Transfer (log_statement=all) ..."
        )
        capture_daemon = system.start_shard(
            "capture",
            shard_id="shard-0",
            database="pgb",
            extra={"SHARDD_SHARD_MAP": "", "SHARDD_RELAY_WORKERS": "0"},
        )
        try:
            captured = pgbench.capture(system, capture_daemon.address, "pgb")
        finally:
            capture_daemon.stop()
            del system.daemons["capture"]
        by_name = {c.name: c for c in captured}
        self.result.captured = {c.name: [s.sql for s in c.statements] for c in captured}
        system.seed_accounts("pgb", [str(i) for i in range(1, self.options.accounts + 1)])
        pgbench.install_helpers(system, "pgb")
        scripts = {
            "pgbench-deposit": pgbench.script_from_capture(by_name["deposit"]),
            "pgbench-transfer": pgbench.script_from_capture(by_name["transfer"]),
            "pgbench-limit": pgbench.limit_script(by_name["deposit"]),
        }
        for scenario, text in scripts.items():
            if scenario not in wanted:
                continue
            path = system.workdir / f"{scenario}.sql"
            path.write_text(text)
            self.result.captured[f"{scenario} script"] = text.splitlines()
            for c in self.options.concurrencies:
                self._record(
                    pgbench.run_pgbench(
                        system,
                        scenario=scenario,
                        script=path,
                        database="pgb",
                        concurrency=c,
                        duration_s=self.options.duration_s,
                        warmup_s=self.options.warmup_s,
                        naccounts=self.options.accounts,
                        tracked=system.tracked(),
                    )
                )

    # --- services ------------------------------------------------------------------------------------

    def start_services(self, wanted: set[str], growth: bool) -> None:
        """The processes the selected scenarios need, with their accounts opened."""
        system = self.system
        grpc_rows = {s for s in wanted if not s.startswith("pgbench")}
        if not grpc_rows and not growth:
            return
        system.start_shard("shard-a", shard_id="shard-a", database="shard_a")
        system.seed_accounts("shard_a", [*system.accounts_a, system.hot_account])
        if grpc_rows & ROUTER_ROWS:
            system.start_shard("shard-b", shard_id="shard-b", database="shard_b")
            system.seed_accounts("shard_b", system.accounts_b)
            system.start_router()
        if grpc_rows & {"noidem-deposit", "noidem-hot-account"}:
            system.start_noidem()
            system.seed_accounts("noidem", [*system.accounts_a, system.hot_account])
        if grpc_rows & {"conflict", "http-conflict"}:
            # Holds the in-flight attempt: its handler may wait for the locked row far longer than
            # the shipped 2 s, so the key stays in flight for the whole scenario without gaps.
            system.start_shard(
                "shard-a-holder",
                shard_id="shard-a",
                database="shard_a",
                extra={"SHARDD_HANDLER_LOCK_TIMEOUT_MS": "600000", "SHARDD_RELAY_WORKERS": "0"},
            )
        if "shard-deposit-nopipeline" in grpc_rows:
            system.start_shard(
                "shard-a-nopipeline",
                shard_id="shard-a",
                database="shard_a",
                extra={"SHARDD_DB_PIPELINE": "false", "SHARDD_RELAY_WORKERS": "0"},
            )
        if "replay-db" in grpc_rows:
            system.start_shard(
                "shard-a-nocache",
                shard_id="shard-a",
                database="shard_a",
                extra={"SHARDD_REPLAY_CACHE_ENTRIES": "0", "SHARDD_RELAY_WORKERS": "0"},
            )
        if "round-trips" in grpc_rows:
            # Through counting proxies, as their own login (their statements apart from the other
            # daemons' in pg_stat_statements). Replay cache off: replays read the database (a first
            # apply never finds a key in the cache, so the Deposit path is the same as shard-a's).
            system.start_shard(
                "shard-a-wire",
                shard_id="shard-a",
                database="shard_a",
                dsn=system.wire_dsn("shard_a", "shard-a-wire"),
                extra={"SHARDD_REPLAY_CACHE_ENTRIES": "0", "SHARDD_RELAY_WORKERS": "0"},
            )
            system.start_noidem("noidem-wire", dsn=system.wire_dsn("noidem", "noidem-wire"))
            system.seed_accounts("noidem", system.accounts_a)

    # --- gRPC and HTTP rows --------------------------------------------------------------------------

    def grpc_rows(self, scenario: str) -> None:
        """Every concurrency of one load-generator scenario (gRPC, or HTTP for the http-* rows)."""
        if scenario in ("conflict", "http-conflict"):
            self._conflict_rows(scenario)
            return
        spec = self._load_spec(scenario)
        for c in self.options.concurrencies:
            self._load(scenario, spec, c)

    def _load_spec(self, scenario: str) -> LoadSpec:
        """What the load generator sends for a scenario (all but the conflict rows)."""
        system = self.system
        accounts = system.accounts_file("a")
        if scenario in _DEPOSIT_TARGETS:
            return LoadSpec(self._address(_DEPOSIT_TARGETS[scenario]), accounts=accounts)
        if scenario == "hot-account":  # shard-a's Deposits, every one on the same account
            return LoadSpec(self._address("shard-a"), accounts=self._hot_accounts())
        if scenario == "noidem-hot-account":
            return LoadSpec(self._address("noidem"), accounts=self._hot_accounts())
        if scenario == "shard-transfer":
            return LoadSpec(self._address("shard-a"), method="transfer", accounts=accounts, amount=1)
        if scenario == "http-deposit":
            return LoadSpec(system.router_http_address, accounts=accounts, protocol="http")
        if scenario == "router-replay":
            return LoadSpec(self._address("router"), keys=f"list:{self._router_replay_list()}")
        if scenario == "http-replay":
            return LoadSpec(
                system.router_http_address, keys=f"list:{self._router_replay_list()}", protocol="http"
            )
        if scenario in ("replay-memory", "replay-db"):
            target = "shard-a" if scenario == "replay-memory" else "shard-a-nocache"
            return LoadSpec(self._address(target), keys=f"list:{self._replay_list()}")
        if scenario == "cross-shard":
            return LoadSpec(
                self._address("router"),
                method="transfer_e2e",
                accounts=accounts,
                dst_accounts=system.accounts_file("b"),
                amount=1,
            )
        raise ValueError(f"unknown scenario {scenario}")

    def _hot_accounts(self) -> Path:
        """An accounts file holding only the hot account."""
        hot = self.system.workdir / "hot.json"
        hot.write_text(json.dumps([self.system.hot_account]))
        return hot

    def _conflict_rows(self, scenario: str) -> None:
        """Every concurrency of a conflict row: calls on one key that is held in flight meanwhile."""
        system = self.system
        with self._key_in_flight() as key:
            hot = self._hot_accounts()
            if scenario == "conflict":
                spec = LoadSpec(
                    self._address("shard-a"),
                    keys=f"fixed:{key}",
                    accounts=hot,
                    amount=1,
                    expect="ABORTED",
                )
            else:  # through the router's HTTP front, which answers the shard's ABORTED as 409
                spec = LoadSpec(
                    system.router_http_address,
                    keys=f"fixed:{key}",
                    accounts=hot,
                    amount=1,
                    expect="409",
                    protocol="http",
                )
            for c in self.options.concurrencies:
                self._load(scenario, spec, c)

    # --- round trips and statements per call -------------------------------------------------------

    def round_trip_rows(self) -> None:
        """Each ROUND_TRIP_CELLS cell: warm-up calls, then the counted calls one at a time, then an
        idle interval as long as the counted calls (its counts are the background, subtracted)."""
        system = self.system
        calls = self.options.round_trip_calls
        keys = system.workdir / "round-trip-keys.jsonl"
        warm_keys = system.workdir / "round-trip-warmup-keys.jsonl"
        accounts = system.accounts_file("a")
        for row, daemon, database, what in ROUND_TRIP_CELLS:
            address = self._address(daemon)
            if row == "round-trips/deposit":
                warm = LoadSpec(address, accounts=accounts, max_ops=ROUND_TRIP_WARMUP_CALLS, record=warm_keys)
                spec = LoadSpec(address, accounts=accounts, max_ops=calls, record=keys)
            elif row == "round-trips/replay-db":
                # The keys the deposit cell completed; the warm-up replays the warm-up's own keys.
                warm = LoadSpec(address, keys=f"list:{warm_keys}", max_ops=ROUND_TRIP_WARMUP_CALLS)
                spec = LoadSpec(address, keys=f"list:{keys}", max_ops=calls)
            else:
                warm = LoadSpec(address, accounts=accounts, max_ops=ROUND_TRIP_WARMUP_CALLS)
                spec = LoadSpec(address, accounts=accounts, max_ops=calls)
            self._round_trip_cell(row, daemon, database, warm, spec, what)

    def _round_trip_cell(
        self, row: str, daemon: str, database: str, warm: LoadSpec, spec: LoadSpec, what: str
    ) -> None:
        system = self.system
        proxy = system.proxies[daemon]
        stats = _StatementStats(system, database) if system.statement_stats else None

        def one_run(load: LoadSpec, scenario: str, tracked: list[Any]) -> CellResult:
            # Bounded by the number of calls; the duration is only a backstop.
            return run_load(
                self.node, load, scenario=scenario, concurrency=1, duration_s=600, warmup_s=0, tracked=tracked
            )

        one_run(warm, f"{row} warm-up", [])
        time.sleep(0.2)  # the warm-up's last statements have reached pg_stat_statements
        before = stats.snapshot() if stats else {}
        proxy.counter.reset()
        started = time.monotonic()
        cell = one_run(spec, row, system.tracked())
        wall_s = time.monotonic() - started
        wire = proxy.counter.snapshot()
        during = stats.snapshot() if stats else {}
        # The same length of time with no load: what the daemon sends by itself (pool checks,
        # partition keeper), subtracted below.
        proxy.counter.reset()
        time.sleep(wall_s)
        idle_wire = proxy.counter.snapshot()
        idle_end = stats.snapshot() if stats else {}
        ok = max(cell.ok, 1)
        figures: dict[str, Any] = {
            "sends": what,
            "daemon": daemon,
            "database": database,
            "calls": cell.ok,
            "wall_s": round(wall_s, 3),
            "wire": wire,
            "wire_idle": idle_wire,
            "round_trips_per_call": (wire["round_trips"] - idle_wire["round_trips"]) / ok,
            "round_trips_per_call_raw": wire["round_trips"] / ok,
        }
        for name in ("sync", "flush", "query", "parse", "bind", "execute"):
            figures[f"{name}_per_call"] = (wire[name] - idle_wire[name]) / ok
        # Statements the client sent: one per Execute, one per simple Query (the pool's empty
        # checkout probe included), whether or not pg_stat_statements sees them.
        figures["sent_statements_per_call"] = figures["execute_per_call"] + figures["query_per_call"]
        if stats:
            load, idle = _delta(before, during), _delta(during, idle_end)
            top = sum(v["calls"] for k, v in load.items() if k[1])
            nested = sum(v["calls"] for k, v in load.items() if not k[1])
            idle_top = sum(v["calls"] for k, v in idle.items() if k[1])
            figures |= {
                "statements_per_call": (top - idle_top) / ok,
                "statements_per_call_raw": top / ok,
                "nested_statements_per_call": nested / ok,
                "db_ms_per_call": sum(v["exec_ms"] + v["plan_ms"] for v in load.values()) / ok,
                "plan_ms_per_call": sum(v["plan_ms"] for v in load.values()) / ok,
                "idle_statements": idle_top,
            }
            ranked = sorted(load.items(), key=lambda kv: (-kv[1]["calls"], kv[1]["query"]))
            self.result.captured[f"{row} top statements"] = [
                f"/* {v['calls'] / ok:.2f} per call{'' if k[1] else ', nested'} */ {_one_line(v['query'], 160)}"
                for k, v in ranked[:10]
            ]
        cell.extra["round_trips"] = figures
        self._record(cell)
        stmts = f", {figures['statements_per_call']:.2f} statements" if stats else ""
        self.progress(
            f"  {row}: {figures['round_trips_per_call']:.2f} round trips{stmts} per call"
            f" ({cell.ok} calls; idle interval: {idle_wire['round_trips']} round trips)"
        )

    def _replay_list(self) -> Path:
        """Pre-create distinct completed keys once (Deposits through the real API), recording them."""
        path = self.system.workdir / "replay-keys.jsonl"
        if path.exists():
            return path
        n = self.options.replay_keys
        self.progress(f"bench: pre-creating {n} completed keys for the replay rows ...")
        spec = LoadSpec(
            self._address("shard-a"), accounts=self.system.accounts_file("a"), record=path, max_ops=n
        )
        cell = run_load(
            self.node, spec, scenario="replay-setup", concurrency=32, duration_s=300, warmup_s=0, tracked=[]
        )
        if cell.ok == 0:
            raise RuntimeError("no key could be pre-created for the replay rows")
        self.result.notes.append(f"replay rows cycle through {cell.ok} distinct completed Deposit keys")
        return path

    def _router_replay_list(self) -> Path:
        """Distinct completed keys for router-replay and http-replay, created once through the HTTP
        front (POST /v1/deposits, caller "bench"), recorded with the exact body each was sent with.

        The front maps that body to the same DepositRequest the gRPC load sends (account, amount,
        reference "bench"), so one key is one record whichever way it is resent: http-replay sends
        the recorded body byte for byte, router-replay the same fields as a gRPC message. Apart
        from the replay-memory keys (created on shard-a directly) so each pair of rows cycles
        through its own keys; both lists together stay within shard-a's replay cache (10,000
        entries by default) as long as --replay-keys is at most 5,000.
        """
        path = self.system.workdir / "router-replay-keys.jsonl"
        if path.exists():
            return path
        n = self.options.replay_keys
        self.progress(
            f"bench: pre-creating {n} completed keys through the HTTP front for the router replay rows ..."
        )
        spec = LoadSpec(
            self.system.router_http_address,
            accounts=self.system.accounts_file("a"),
            record=path,
            max_ops=n,
            protocol="http",
        )
        cell = run_load(
            self.node,
            spec,
            scenario="router-replay-setup",
            concurrency=32,
            duration_s=300,
            warmup_s=0,
            tracked=[],
        )
        if cell.ok == 0:
            raise RuntimeError("no key could be pre-created through the HTTP front for the replay rows")
        self.result.notes.append(
            f"router-replay and http-replay cycle through {cell.ok} distinct completed Deposit keys"
            " created through the HTTP front"
        )
        return path

    @contextlib.contextmanager
    def _key_in_flight(self) -> Iterator[str]:
        """A Deposit whose key stays in flight: its account row is locked by a transaction held here.

        The attempt is sent to a second daemon of the same shard (same database) whose handlers may
        wait for a row lock for minutes; the hammered daemon has no local flight for the key, so every
        resend takes the database path: claim read, advisory lock refused, re-read, ABORTED.
        """
        system = self.system
        key = str(new_key())
        stop = threading.Event()
        lock = psycopg.connect(system.dsn("shard_a"))
        lock.execute("SELECT 1 FROM accounts WHERE id = %s FOR UPDATE", (system.hot_account,))
        failures: list[str] = []

        def hold() -> None:
            request = transfer_pb2.DepositRequest(
                account_id=system.hot_account, amount=transfer_pb2.Money(amount_minor=1, currency=CURRENCY)
            )
            metadata: tuple[tuple[str, str | bytes], ...] = (
                (KEY_METADATA, key),
                (CALLER_METADATA, "bench"),
            )
            with grpc.insecure_channel(self._address("shard-a-holder")) as channel:
                stub = transfer_pb2_grpc.TransferServiceStub(channel)
                deadline = time.monotonic() + 3600  # bounded even if nobody sets `stop`
                while not stop.is_set() and time.monotonic() < deadline:
                    try:
                        stub.Deposit(request, metadata=metadata, timeout=600)
                        return  # the lock was released: the attempt applied
                    except grpc.RpcError as error:
                        failures.append(str(error.code()))
                        stop.wait(0.05)

        holder = threading.Thread(target=hold, name="bench-key-holder", daemon=True)
        holder.start()
        time.sleep(1.0)  # the attempt has claimed the key and waits for the row
        try:
            yield key
        finally:
            stop.set()
            lock.rollback()  # the waiting attempt now completes (and the key with it)
            lock.close()
            holder.join(35)
            if failures:
                self.result.notes.append(
                    f"conflict: the holding attempt was interrupted {len(failures)} times"
                )

    # --- growth --------------------------------------------------------------------------------------

    def growth_rows(self) -> None:
        """shard-deposit at each key-table size, and a retention run at that size."""
        from shardrouter.shardd.retention import run_retention
        from shardrouter.shardd.server import MONTHS_AHEAD

        system = self.system
        concurrency = self.options.growth_concurrency or self._best_concurrency("shard-deposit") or 32
        spec = LoadSpec(self._address("shard-a"), accounts=system.accounts_file("a"))
        response = transfer_pb2.DepositResponse(
            entry_id=str(new_key()), balance=transfer_pb2.Money(amount_minor=123456, currency=CURRENCY)
        ).SerializeToString()
        with psycopg.connect(system.dsn("shard_a"), autocommit=True) as conn:
            conn.execute("TRUNCATE idempotency_record")
            loaded = 0
            for size in sorted(self.options.growth):
                self.progress(f"bench: growth: loading the key table to {size:,} rows ...")
                started = time.monotonic()
                while loaded < size:
                    upto = min(size, loaded + GROWTH_CHUNK)
                    conn.execute(
                        _BULK_INSERT,
                        {
                            "scope": DEPOSIT_SCOPE,
                            "method": DEPOSIT_METHOD,
                            "response": response,
                            "lo": loaded + 1,
                            "hi": upto,
                            "total": max(self.options.growth),
                            "span": f"{GROWTH_SPAN_DAYS} days",
                        },
                    )
                    loaded = upto
                load_s = time.monotonic() - started
                # Steady state before measuring: statistics, visibility map and a clean checkpoint,
                # so the cell does not pay for the bulk load's dirty pages.
                conn.execute("VACUUM ANALYZE idempotency_record")
                conn.execute("CHECKPOINT")
                rows = conn.execute("SELECT count(*) FROM idempotency_record").fetchone()
                cell = self._load(f"growth-{_size_label(size)}", spec, concurrency)
                # A retention run at this size must have work: a month past the window holding a
                # tenth as many keys again, which the run detaches and drops (the hot table stays).
                expired_rows = self._load_expired_month(conn, max(1, size // 10), response)
                retention_started = time.monotonic()
                retention = run_retention(
                    system.dsn("shard_a"), retention=RETENTION, months_ahead=MONTHS_AHEAD
                )
                retention_s = time.monotonic() - retention_started
                table_bytes = conn.execute(
                    "SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits"
                    " WHERE inhparent = 'idempotency_record'::regclass"
                ).fetchone()
                self.result.growth.append(
                    {
                        "size": size,
                        "rows": int(rows[0]) if rows else 0,
                        "table_mb": round(int(table_bytes[0] or 0) / 1024 / 1024, 1) if table_bytes else 0,
                        "load_s": round(load_s, 1),
                        "concurrency": concurrency,
                        "throughput": cell.throughput,
                        "p99_ms": cell.latency["p99_ms"],
                        "p50_ms": cell.latency["p50_ms"],
                        "retention_s": retention_s,
                        "retention_dropped": list(retention.dropped),
                        "retention_dropped_rows": expired_rows,
                    }
                )
                self.progress(f"  retention run at {size:,} rows: {retention_s:.3f} s")

    @staticmethod
    def _load_expired_month(conn: psycopg.Connection[Any], rows: int, response: bytes) -> int:
        """Fill the month before the retention window's oldest with `rows` completed keys."""
        from datetime import UTC, datetime

        from shardrouter.shardd.partitions import Month, create_partition

        now = datetime.now(UTC)
        kept = Month.of(now - RETENTION)
        expired = Month.of(kept.start() - timedelta(days=1))
        create_partition(conn, expired)
        conn.execute(
            _EXPIRED_INSERT,
            {
                "scope": DEPOSIT_SCOPE,
                "method": DEPOSIT_METHOD,
                "response": response,
                "n": rows,
                "newest": now - expired.end() + timedelta(hours=1),
                "width": expired.end() - expired.start() - timedelta(hours=2),
            },
        )
        return rows

    def _best_concurrency(self, scenario: str) -> int | None:
        cells = [c for c in self.result.cells if c.scenario == scenario]
        return max(cells, key=lambda c: c.throughput).concurrency if cells else None


#: Completed Deposit records with key times ascending over the span before now (so the key index grows
#: at its right edge as with live keys), in the live keys' scope: the index the claims search is the
#: one that grows.
#: Keys spread over one month that lies wholly past the retention window (see _load_expired_month).
_EXPIRED_INSERT = """
INSERT INTO idempotency_record
    (scope, key, key_time, method, request_hash, state, status_code, status_message, response, trailers,
     created_at, completed_at)
SELECT %(scope)s, k, uuid_extract_timestamp(k), %(method)s, sha256(int8send(-g)), 'completed', 0, '',
       %(response)s, '[]'::jsonb, uuid_extract_timestamp(k), uuid_extract_timestamp(k)
FROM (SELECT g, uuidv7(-(%(newest)s::interval + %(width)s::interval * (g::float8 / %(n)s))) AS k
      FROM generate_series(1::bigint, %(n)s::bigint) AS g) AS s
"""

_BULK_INSERT = """
INSERT INTO idempotency_record
    (scope, key, key_time, method, request_hash, state, status_code, status_message, response, trailers,
     created_at, completed_at)
SELECT %(scope)s, k, uuid_extract_timestamp(k), %(method)s, sha256(int8send(g)), 'completed', 0, '',
       %(response)s, '[]'::jsonb, uuid_extract_timestamp(k), uuid_extract_timestamp(k)
FROM (SELECT g, uuidv7(-(%(span)s::interval * ((%(total)s - g)::float8 / %(total)s) + interval '1 second')) AS k
      FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g) AS s
"""


class _StatementStats:
    """pg_stat_statements of WIRE_ROLE in one database: calls, execution and planning time by
    (queryid, toplevel)."""

    def __init__(self, system: BenchSystem, database: str) -> None:
        self.system, self.database = system, database

    def snapshot(self) -> dict[tuple[int, bool], dict[str, Any]]:
        with psycopg.connect(self.system.dsn(self.database), autocommit=True) as conn:
            found = conn.execute(
                "SELECT s.queryid, s.toplevel, s.calls, s.total_exec_time, s.total_plan_time, s.query"
                " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
                " JOIN pg_roles r ON r.oid = s.userid WHERE d.datname = %s AND r.rolname = %s",
                (self.database, WIRE_ROLE),
            ).fetchall()
        return {
            (int(q), bool(t)): {"calls": int(c), "exec_ms": float(e), "plan_ms": float(p), "query": str(text)}
            for q, t, c, e, p, text in found
        }


def _delta(
    before: dict[tuple[int, bool], dict[str, Any]], after: dict[tuple[int, bool], dict[str, Any]]
) -> dict[tuple[int, bool], dict[str, Any]]:
    """Per statement, what happened between two snapshots (statements with no new calls left out)."""
    out = {}
    for key, now in after.items():
        was = before.get(key, {"calls": 0, "exec_ms": 0.0, "plan_ms": 0.0})
        calls = now["calls"] - was["calls"]
        if calls > 0:
            out[key] = {
                "calls": calls,
                "exec_ms": now["exec_ms"] - was["exec_ms"],
                "plan_ms": now["plan_ms"] - was["plan_ms"],
                "query": now["query"],
            }
    return out


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _size_label(size: int) -> str:
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if size >= scale and size % (scale // 10) == 0:
            return f"{size / scale:g}{unit}"
    return str(size)
