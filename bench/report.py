"""The run's table (plain text for the terminal, Markdown for a file), the performance targets, and JSON.

CPU per operation is grouped by role: client (the load generator or pgbench), router, shard (every
shard-like daemon: shard-a, shard-b, the cache-off twin and the no-idempotency twin; idle ones only
add their background polls), pg (the postmaster and all its backends). Peak RSS is per process; for
pg the largest single backend (shared buffers count in each backend that touched them).

HTTP against gRPC through the router: http-deposit / router-deposit and http-replay / router-replay
(best cell against best cell: the target, >= 80% each), and the same per concurrency with the
router's CPU per operation on both paths.

Round trips and statements per call: the round-trips cells (bench/run.py, bench/wire.py), one table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.results import CellResult
from bench.run import RunResult

ROLES: dict[str, list[str]] = {
    "client": ["client"],
    "router": ["router"],
    "shard": [
        "shard-a",
        "shard-b",
        "shard-a-nocache",
        "shard-a-holder",
        "shard-a-nopipeline",
        "noidem",
        "capture",
        "shard-a-wire",
        "noidem-wire",
    ],
    "pg": ["postgres"],
}


@dataclass(frozen=True)
class Target:
    """One of the performance targets, evaluated on a run."""

    name: str
    figure: str
    required: str
    passed: bool | None  # None: not measured in this run


def best(result: RunResult, scenario: str) -> CellResult | None:
    """The cell of `scenario` with the highest throughput."""
    cells = [c for c in result.cells if c.scenario == scenario and c.ok > 0]
    return max(cells, key=lambda c: c.throughput) if cells else None


#: HTTP row -> the gRPC row through the router it is compared with (target: >= HTTP_TARGET of it).
HTTP_PAIRS = {"http-deposit": "router-deposit", "http-replay": "router-replay"}
HTTP_TARGET = 0.80
#: The thresholds of the performance issue.
SHARD_SHARE_TARGET = 0.18  # best shard-deposit / best pgbench-limit, at least
ROUTER_SHARE_TARGET = 0.14  # best router-deposit / best pgbench-limit, at least
INTERCEPTOR_TARGET = 0.20  # 1 - best shard-deposit / best noidem-deposit, at most
ROUND_TRIPS_TARGET = 3.0  # counted round trips per new-key Deposit, at most
REPLAY_MEMORY_TARGET = 2.0  # best replay-memory / best shard-deposit, at least
REPLAY_DB_TARGET = 3.0  # best replay-db / best shard-deposit, at least
HOT_ACCOUNT_TARGET = 0.8  # best hot-account / best shard-deposit (the same load over many accounts), at least
CROSS_SHARD_P50_TARGET_MS = 50.0  # cross-shard p50 until the credit landed, at most


#: The targets that are one best row's throughput over another's: (name, numerator row, denominator
#: row, at least this share, how the share is shown).
_RATIO_TARGETS: tuple[tuple[str, str, str, float, str], ...] = (
    ("shard directly vs the one-statement limit", "shard-deposit", "pgbench-limit", SHARD_SHARE_TARGET, "%"),
    ("through the router vs the limit", "router-deposit", "pgbench-limit", ROUTER_SHARE_TARGET, "%"),
    ("replay (memory) vs first apply", "replay-memory", "shard-deposit", REPLAY_MEMORY_TARGET, "x"),
    ("replay (database) vs first apply", "replay-db", "shard-deposit", REPLAY_DB_TARGET, "x"),
    *(
        (f"HTTP vs gRPC through the router: {http_row} / {grpc_row}", http_row, grpc_row, HTTP_TARGET, "%")
        for http_row, grpc_row in HTTP_PAIRS.items()
    ),
)


def targets(result: RunResult) -> list[Target]:
    """The performance targets (replay counted twice: from memory and from the database; HTTP against
    gRPC through the router twice: deposit and replay)."""
    return [
        *(_ratio_target(result, *spec) for spec in _RATIO_TARGETS),
        _hot_account_target(result),
        _interceptor_target(result),
        _round_trips_target(result),
        _cross_shard_target(result),
        _growth_target(result),
    ]


def _ratio_target(result: RunResult, name: str, num: str, den: str, least: float, shown: str) -> Target:
    """Best `num` over best `den`, at least `least`; `shown` "%" as a percentage, "x" as a factor."""
    required = f">= {least:.0%}" if shown == "%" else f">= {least:g}x"
    a, b = best(result, num), best(result, den)
    if a is None or b is None or b.throughput == 0:
        return Target(name, "not measured", required, None)
    value = a.throughput / b.throughput
    figure = f"{value:.0%}" if shown == "%" else f"{value:.2f}x"
    figure += f" ({a.throughput:.0f} @c{a.concurrency} / {b.throughput:.0f} @c{b.concurrency})"
    return Target(name, figure, required, value >= least)


def _hot_account_target(result: RunResult) -> Target:
    """Best hot-account over best shard-deposit, with the same ratio of the handler without
    idempotency beside it when measured: how much of the row lock's cost is ours."""
    target = _ratio_target(
        result,
        "one hot account vs the same load spread",
        "hot-account",
        "shard-deposit",
        HOT_ACCOUNT_TARGET,
        "x",
    )
    hot, spread = best(result, "noidem-hot-account"), best(result, "noidem-deposit")
    if target.passed is None or hot is None or spread is None or spread.throughput == 0:
        return target
    baseline = (
        f"; without idempotency {hot.throughput / spread.throughput:.2f}x"
        f" ({hot.throughput:.0f} / {spread.throughput:.0f})"
    )
    return replace(target, figure=target.figure + baseline)


def _interceptor_target(result: RunResult) -> Target:
    name = "interceptor overhead vs the same handler without idempotency"
    required = f"<= {INTERCEPTOR_TARGET:.0%}"
    a, b = best(result, "shard-deposit"), best(result, "noidem-deposit")
    if not (a and b and b.throughput):
        return Target(name, "not measured", required, None)
    overhead = 1 - a.throughput / b.throughput
    figure = f"{overhead:.0%} ({a.throughput:.0f} vs {b.throughput:.0f} ops/s at best)"
    return Target(name, figure, required, overhead <= INTERCEPTOR_TARGET)


def _growth_target(result: RunResult) -> Target:
    growth = sorted(result.growth, key=lambda g: g["size"])
    if len(growth) < 2 or not growth[0]["throughput"]:
        return Target("flat from an empty key table to 10M rows", "not measured", "within 10%", None)
    first, last = growth[0], growth[-1]
    change = last["throughput"] / first["throughput"] - 1
    p99_change = last["p99_ms"] / first["p99_ms"] - 1 if first["p99_ms"] else 0.0
    return Target(
        f"flat from {first['size']:,} to {last['size']:,} keys",
        f"throughput {change:+.0%}, p99 {p99_change:+.0%}",
        "within 10%",
        abs(change) <= 0.10,
    )


def round_trip_figures(result: RunResult, row: str) -> dict[str, Any] | None:
    """What a round-trips cell counted (run.py `_round_trip_cell`), if the run has it."""
    for cell in result.cells:
        if cell.scenario == row and "round_trips" in cell.extra:
            figures: dict[str, Any] = cell.extra["round_trips"]
            return figures
    return None


def _round_trips_target(result: RunResult) -> Target:
    name = "round trips per Deposit (counted on the wire, new keys, c=1)"
    required = f"<= {ROUND_TRIPS_TARGET:g}"
    figures = round_trip_figures(result, "round-trips/deposit")
    if figures is None or not figures["calls"]:
        return Target(name, "not measured", required, None)
    value = figures["round_trips_per_call"]
    stmts = figures.get("statements_per_call")
    figure = f"{value:.2f} ({figures['wire']['round_trips']} over {figures['calls']} calls"
    figure += f", {figures['wire_idle']['round_trips']} idle subtracted"
    figure += f"; {stmts:.2f} statements/call)" if stmts is not None else ")"
    return Target(name, figure, required, value <= ROUND_TRIPS_TARGET)


def _cross_shard_target(result: RunResult) -> Target:
    """p50 from sending the Transfer until its credit landed, at the lowest concurrency measured
    (unloaded; the best cell's p50 is shown beside it, which includes queueing)."""
    name = "cross-shard Transfer until its credit landed, p50 (lowest concurrency)"
    required = f"<= {CROSS_SHARD_P50_TARGET_MS:g} ms"
    cells = [c for c in result.cells if c.scenario == "cross-shard" and c.ok > 0]
    if not cells:
        return Target(name, "not measured", required, None)
    low = min(cells, key=lambda c: c.concurrency)
    top = max(cells, key=lambda c: c.throughput)
    p50 = low.latency["p50_ms"]
    figure = f"{p50:.0f} ms @c{low.concurrency}"
    if top is not low:
        figure += f" (best cell: {top.latency['p50_ms']:.0f} ms @c{top.concurrency})"
    return Target(name, figure, required, p50 <= CROSS_SHARD_P50_TARGET_MS)


def _status(passed: bool | None) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "MISS")


def _stand(result: RunResult, cell: CellResult) -> str:
    """Where a row stands against its target (on the best row of its scenario only)."""
    top = best(result, cell.scenario)
    if top is None or top is not cell:
        return ""
    for stand in (_stand_against_target, _stand_in_round_trips, _stand_beside_others):
        said = stand(result, cell)
        if said is not None:
            return said
    return "best"


def _stand_against_target(result: RunResult, cell: CellResult) -> str | None:
    """A best row that has a target of its own: how far it is."""
    limit = best(result, "pgbench-limit")
    first = best(result, "shard-deposit")
    if cell.scenario in ("shard-deposit", "router-deposit") and limit:
        share = cell.throughput / limit.throughput
        least = SHARD_SHARE_TARGET if cell.scenario == "shard-deposit" else ROUTER_SHARE_TARGET
        return f"best; {share:.0%} of limit (>={least:.0%}: {_status(share >= least)})"
    if cell.scenario in ("replay-memory", "replay-db") and first:
        times = cell.throughput / first.throughput
        target = REPLAY_MEMORY_TARGET if cell.scenario == "replay-memory" else REPLAY_DB_TARGET
        return f"best; {times:.2f}x first apply (>={target:g}x: {_status(times >= target)})"
    if cell.scenario == "noidem-deposit" and first:
        overhead = 1 - first.throughput / cell.throughput
        return (
            f"best; interceptor costs {overhead:.0%}"
            f" (<={INTERCEPTOR_TARGET:.0%}: {_status(overhead <= INTERCEPTOR_TARGET)})"
        )
    grpc = best(result, HTTP_PAIRS[cell.scenario]) if cell.scenario in HTTP_PAIRS else None
    if grpc:
        share = cell.throughput / grpc.throughput
        return (
            f"best; {share:.0%} of {HTTP_PAIRS[cell.scenario]}"
            f" (>={HTTP_TARGET:.0%}: {_status(share >= HTTP_TARGET)})"
        )
    return None


def _stand_in_round_trips(_result: RunResult, cell: CellResult) -> str | None:
    """A round-trips row: what it counted per call."""
    figures = cell.extra.get("round_trips")
    if not figures:
        return None
    stmts = figures.get("statements_per_call")
    return f"{figures['round_trips_per_call']:.2f} round trips" + (
        f", {stmts:.2f} statements per call" if stmts is not None else " per call"
    )


def _stand_beside_others(result: RunResult, cell: CellResult) -> str | None:
    """A best row without a target: beside the row it is read against, or what its ops are."""
    first = best(result, "shard-deposit")
    if cell.scenario == "shard-deposit-nopipeline" and first:
        return f"best; {cell.throughput / first.throughput:.2f}x the pipelined shard"
    if cell.scenario == "pgbench-deposit" and first:
        return f"best; shard reaches {first.throughput / cell.throughput:.0%} of it"
    router_first = best(result, "router-deposit")
    if cell.scenario == "router-replay" and router_first:
        return f"best; {cell.throughput / router_first.throughput:.2f}x router-deposit"
    if cell.scenario == "cross-shard":
        lag = cell.extra.get("credit_lag", {})
        return f"best; latency = until credit landed; lag after OK p50 {lag.get('p50_ms', 0):.0f} ms"
    return {"conflict": "best; ops = ABORTED answers", "http-conflict": "best; ops = 409 answers"}.get(
        cell.scenario
    )


HEADER = [
    "scenario",
    "conc",
    "ops/s",
    "p50 ms",
    "p99 ms",
    "p99.9 ms",
    "errors",
    "cpu us/op client",
    "router",
    "shard",
    "pg",
    "peak MB client",
    "router",
    "shard",
    "pg",
    "stands",
]


def rows(result: RunResult) -> list[list[str]]:
    """One row per cell."""
    out = []
    for cell in result.cells:
        cpu = [cell.cpu_us_per_op(ROLES[r]) for r in ROLES]
        rss = [max((cell.peak_rss_kb.get(n, 0) for n in ROLES[r]), default=0) / 1024 for r in ROLES]
        errors = ", ".join(f"{k}:{v}" for k, v in sorted(cell.errors.items())) or "0"
        out.append(
            [
                cell.scenario,
                str(cell.concurrency),
                f"{cell.throughput:.0f}",
                f"{cell.latency['p50_ms']:.2f}",
                f"{cell.latency['p99_ms']:.2f}",
                f"{cell.latency['p999_ms']:.2f}",
                errors,
                *(f"{v:.0f}" if v else "-" for v in cpu),
                *(f"{v:.0f}" if v else "-" for v in rss),
                _stand(result, cell),
            ]
        )
    return out


def growth_rows(result: RunResult) -> list[list[str]]:
    """One row per key-table size."""
    growth = sorted(result.growth, key=lambda g: g["size"])
    base = growth[0]["throughput"] if growth else 0
    return [
        [
            f"{g['rows']:,}",
            f"{g['table_mb']:.0f}",
            str(g["concurrency"]),
            f"{g['throughput']:.0f}",
            f"{g['p50_ms']:.2f}",
            f"{g['p99_ms']:.2f}",
            f"{g['throughput'] / base - 1:+.0%}" if base else "-",
            f"{g['retention_s']:.3f}",
            f"{g.get('retention_dropped_rows', 0):,} in {len(g.get('retention_dropped', []))}",
            f"{g['load_s']:.0f}",
        ]
        for g in growth
    ]


GROWTH_HEADER = [
    "key rows",
    "table MB",
    "conc",
    "ops/s",
    "p50 ms",
    "p99 ms",
    "vs empty",
    "retention s",
    "dropped rows in partitions",
    "load s",
]
TARGET_HEADER = ["target", "figure", "required", "status"]
ROUND_TRIP_HEADER = [
    "cell (c=1)",
    "calls",
    "round trips / call",
    "Sync",
    "Flush",
    "Query",
    "Parse",
    "Bind",
    "Execute",
    "idle round trips",
    "sent / call",
    "statements / call",
    "nested",
    "idle statements",
    "db ms / call",
    "plan ms",
    "ops/s",
]


def round_trip_rows(result: RunResult) -> list[list[str]]:
    """One row per round-trips cell: per successful call, background (idle interval) subtracted."""
    out = []
    for cell in result.cells:
        f = cell.extra.get("round_trips")
        if not f:
            continue
        has_stats = "statements_per_call" in f

        def stat(name: str, fmt: str, f: dict[str, Any] = f, has_stats: bool = has_stats) -> str:
            return fmt.format(f[name]) if has_stats else "-"

        out.append(
            [
                cell.scenario,
                str(f["calls"]),
                f"{f['round_trips_per_call']:.2f}",
                *(
                    f"{f[f'{n}_per_call']:.2f}"
                    for n in ("sync", "flush", "query", "parse", "bind", "execute")
                ),
                str(f["wire_idle"]["round_trips"]),
                f"{f['sent_statements_per_call']:.2f}",
                stat("statements_per_call", "{:.2f}"),
                stat("nested_statements_per_call", "{:.2f}"),
                stat("idle_statements", "{}"),
                stat("db_ms_per_call", "{:.3f}"),
                stat("plan_ms_per_call", "{:.3f}"),
                f"{cell.throughput:.0f}",
            ]
        )
    return out


ROUND_TRIP_TITLE = (
    "round trips (Sync+Flush+Query messages on the wire), statements sent (Execute+Query) and statements"
    " seen by pg_stat_statements (top level; nested: inside functions and triggers) per call, one call at"
    " a time, idle interval subtracted (pg_stat_statements counts a utility statement psycopg has"
    " prepared, e.g. BEGIN, only on its first execution):"
)
HTTP_HEADER = [
    "http row",
    "vs gRPC row",
    "conc",
    "ops/s ratio",
    "p50 ratio",
    "router us/op http",
    "grpc",
    "shard us/op http",
    "grpc",
]


def http_rows(result: RunResult) -> list[list[str]]:
    """Each HTTP row against its gRPC row through the router at the same concurrency."""
    out = []
    for http_row, grpc_row in HTTP_PAIRS.items():
        grpc_cells = {c.concurrency: c for c in result.cells if c.scenario == grpc_row}
        for cell in (c for c in result.cells if c.scenario == http_row):
            other = grpc_cells.get(cell.concurrency)
            if other is None or not other.throughput:
                continue
            p50 = other.latency["p50_ms"]
            cpu = [c.cpu_us_per_op(ROLES[role]) for role in ("router", "shard") for c in (cell, other)]
            out.append(
                [
                    http_row,
                    grpc_row,
                    str(cell.concurrency),
                    f"{cell.throughput / other.throughput:.2f}",
                    f"{cell.latency['p50_ms'] / p50:.2f}" if p50 else "-",
                    *(f"{v:.0f}" if v else "-" for v in cpu),
                ]
            )
    return out


def _text_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        # Numbers right-aligned; the first (name) and last (note) columns left-aligned.
        return "  ".join(
            v.rjust(w) if i and i < len(r) - 1 else v.ljust(w)
            for i, (v, w) in enumerate(zip(r, widths, strict=True))
        )

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in body)])


def _md_table(header: list[str], body: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(v.replace("|", "\\|") for v in r) + " |" for r in body]
    return "\n".join(out)


def _target_rows(result: RunResult) -> list[list[str]]:
    return [[t.name, t.figure, t.required, _status(t.passed)] for t in targets(result)]


def _machine_line(result: RunResult) -> str:
    m = result.machine
    settings = ", ".join(f"{k}={v}" for k, v in m.get("postgresql_settings", {}).items())
    return (
        f"machine: {m.get('nproc')} CPUs ({m.get('cpu')}), {m.get('memory_gib')} GiB; "
        f"PostgreSQL {m.get('postgresql')} ({settings}); "
        f"{result.options.get('duration_s')} s per cell after {result.options.get('warmup_s')} s warm-up"
    )


def text_report(result: RunResult) -> str:
    """The terminal table."""
    parts = [_machine_line(result), "", _text_table(HEADER, rows(result))]
    if result.growth:
        parts += [
            "",
            "growth (shard-deposit with a pre-loaded key table):",
            _text_table(GROWTH_HEADER, growth_rows(result)),
        ]
    http = http_rows(result)
    if http:
        parts += ["", "HTTP vs gRPC through the router (same concurrency):", _text_table(HTTP_HEADER, http)]
    trips = round_trip_rows(result)
    if trips:
        parts += ["", ROUND_TRIP_TITLE, _text_table(ROUND_TRIP_HEADER, trips)]
    parts += ["", "targets:", _text_table(TARGET_HEADER, _target_rows(result))]
    parts += [f"note: {n}" for n in result.notes]
    return "\n".join(parts)


def markdown_report(result: RunResult) -> str:
    """The same as Markdown, with the captured statements."""
    parts = [_machine_line(result), "", _md_table(HEADER, rows(result))]
    if result.growth:
        parts += [
            "",
            "Growth (shard-deposit with a pre-loaded key table):",
            "",
            _md_table(GROWTH_HEADER, growth_rows(result)),
        ]
    http = http_rows(result)
    if http:
        parts += ["", "HTTP vs gRPC through the router (same concurrency):", "", _md_table(HTTP_HEADER, http)]
    trips = round_trip_rows(result)
    if trips:
        parts += [
            "",
            ROUND_TRIP_TITLE[:1].upper() + ROUND_TRIP_TITLE[1:],
            "",
            _md_table(ROUND_TRIP_HEADER, trips),
        ]
    parts += ["", "Targets:", "", _md_table(TARGET_HEADER, _target_rows(result))]
    parts += [f"\nNote: {n}" for n in result.notes]
    for name, statements in result.captured.items():
        if name.endswith("script"):
            continue
        if name.endswith("top statements"):
            row = name.removesuffix(" top statements")
            parts += ["", f"{row}: the most called statements (pg_stat_statements, per call):", "", "```sql"]
            parts += [*statements, "```"]
            continue
        parts += ["", f"Statements of one {name}, as captured (log_statement=all):", "", "```sql"]
        parts += [s if s else "-- (empty query: the pool's checkout probe)" for s in statements]
        parts += ["```"]
    return "\n".join(parts) + "\n"


def write_reports(result: RunResult, *, json_path: Path | None, markdown_path: Path | None) -> None:
    """Write the requested files."""
    if json_path:
        data = result.as_dict() | {"targets": [t.__dict__ for t in targets(result)]}
        json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    if markdown_path:
        markdown_path.write_text(markdown_report(result))
