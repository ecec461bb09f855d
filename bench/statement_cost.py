"""What PostgreSQL executes for one guarded call, statement by statement, in counts machine load cannot
change: calls, rows, plans, WAL bytes and buffer hits per call (and the time, which load does change).

    .venv/bin/python -m bench.statement_cost [--calls 300] [--warmup 50] [--json FILE]

One throw-away PostgreSQL (the embedded wheel) with pg_stat_statements preloaded (`track=all`, so the
statements run inside functions and triggers are seen too, marked "nested"), one migrated shard
database, and one shard daemon served in this process that logs in as a role of its own, so only its
statements are counted. Its replay cache is off (a replay reads the database) and its relay too. Six
cells, one call at a time after a warm-up: with the claim sent first, Deposits with new UUIDv7 keys,
replays of those keys, Deposits with new opaque keys (dated by receipt: the advisory-lock path),
replays of those; with the claim sent ahead of the handler (a second daemon, on the same database),
new UUIDv7 keys and their replays. After each
cell an idle interval as long as the cell is measured and subtracted (the partition keeper, pool
checks). The WAL insert position gives the WAL of the whole server per call (commit records and
background included) beside the statements' own.

A nested statement's cost is also inside its parent's (a trigger's inside the INSERT that fired it),
so the totals add up top-level statements only. pg_stat_statements counts a utility statement psycopg
has prepared (`BEGIN`, `COMMIT` after five uses) only once: those rows are missing, not free.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import psycopg

from shardrouter.core.keys import new_key
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.server import ShardDaemon, prepare_database, start_shard
from shardrouter.shardd.settings import ShardSettings
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

#: pg_stat_statements on every statement, nested ones included, with planning counted apart.
STATEMENT_SETTINGS = {
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_utility": "on",
    "pg_stat_statements.track_planning": "on",
    "pg_stat_statements.max": "5000",
}
#: The shard daemon's login: its statements apart from this program's in pg_stat_statements.
SHARD_ROLE = "cost_shard"
DATABASE = "cost"
ACCOUNTS = [f"acct-{i}" for i in range(64)]
#: What each statement row holds, per call of the cell (pg_stat_statements columns).
COUNTERS = (
    "calls",
    "plans",
    "rows",
    "wal_bytes",
    "wal_records",
    "shared_blks_hit",
    "shared_blks_read",
    "shared_blks_dirtied",
    "total_exec_time",
    "total_plan_time",
)

Snapshot = dict[tuple[int, bool], dict[str, Any]]
_TRANSACTION_CONTROL = frozenset({"BEGIN", "COMMIT", "ROLLBACK"})


@dataclass
class Cell:
    """One cell's per-call figures: every statement seen, and the server's WAL."""

    name: str
    calls: int
    statements: list[dict[str, Any]]
    server_wal_bytes: float

    def totals(self) -> dict[str, float]:
        """Per call, top-level statements (nested ones are inside them) and nested counted apart."""
        top = [s for s in self.statements if s["toplevel"]]
        nested = [s for s in self.statements if not s["toplevel"]]
        control = [s for s in top if s["query"].strip().upper() in _TRANSACTION_CONTROL]
        return {
            # BEGIN and COMMIT are seen only until psycopg prepares them (see above): apart.
            "statements_top": sum(s["calls"] for s in top if s not in control),
            "transaction_control_seen": sum(s["calls"] for s in control),
            "statements_nested": sum(s["calls"] for s in nested),
            "plans": sum(s["plans"] for s in self.statements),
            "wal_bytes": sum(s["wal_bytes"] for s in top),
            "server_wal_bytes": self.server_wal_bytes,
            "shared_blks_hit": sum(s["shared_blks_hit"] for s in top),
            "shared_blks_dirtied": sum(s["shared_blks_dirtied"] for s in top),
            "db_ms": sum(s["total_exec_time"] + s["total_plan_time"] for s in top),
        }


def snapshot(conn: psycopg.Connection[Any]) -> tuple[Snapshot, int]:
    """pg_stat_statements of the shard's role in the measured database, and the server's WAL bytes."""
    rows = conn.execute(
        f"SELECT s.queryid, s.toplevel, s.query, {', '.join('s.' + c for c in COUNTERS)}"
        " FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid"
        " JOIN pg_database d ON d.oid = s.dbid WHERE r.rolname = %s AND d.datname = %s",
        (SHARD_ROLE, DATABASE),
    ).fetchall()
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint").fetchone()
    assert wal is not None
    found: Snapshot = {}
    for queryid, toplevel, query, *values in rows:
        found[(int(queryid), bool(toplevel))] = {
            "query": str(query),
            **dict(zip(COUNTERS, map(float, values), strict=True)),
        }
    return found, int(wal[0])


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """Per statement, what happened between two snapshots (statements not called left out)."""
    out: Snapshot = {}
    for key, now in after.items():
        was = before.get(key, {})
        change = {c: now[c] - was.get(c, 0.0) for c in COUNTERS}
        if change["calls"] > 0:
            out[key] = {"query": now["query"], **change}
    return out


def minus(load: Snapshot, idle: Snapshot) -> Snapshot:
    """The load's counts less the idle interval's (statements the daemon runs by itself)."""
    out: Snapshot = {}
    for key, figures in load.items():
        rest = {c: figures[c] - idle.get(key, {}).get(c, 0.0) for c in COUNTERS}
        if rest["calls"] > 0:
            out[key] = {"query": figures["query"], **rest}
    return out


def preload_statement_stats(pg: LocalPostgres) -> None:
    """Write STATEMENT_SETTINGS into a server's configuration (they take effect at its next start)."""
    with (pg.data_dir / "postgresql.conf").open("a") as conf:
        conf.write("\n# statement cost\n" + "".join(f"{k} = {v}\n" for k, v in STATEMENT_SETTINGS.items()))


def create_measured_database(pg: LocalPostgres) -> str:
    """The measured database, migrated, with the shard's login and pg_stat_statements; its DSN as
    that login."""
    pg.create_database(DATABASE)
    with psycopg.connect(pg.dsn_for(DATABASE), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {SHARD_ROLE} LOGIN SUPERUSER")
        conn.execute("CREATE EXTENSION pg_stat_statements")
    prepare_database(pg.dsn_for(DATABASE), retention=timedelta(days=30))
    return f"postgresql://{SHARD_ROLE}@127.0.0.1:{pg.port}/{DATABASE}"


@contextmanager
def cost_server(workdir: Path) -> Iterator[LocalPostgres]:
    """A PostgreSQL with pg_stat_statements preloaded, deleted afterwards."""
    pg = LocalPostgres(workdir / "pg")
    pg.init()
    preload_statement_stats(pg)
    pg.start()
    try:
        yield pg
    finally:
        pg.destroy()


def start_cost_shard(dsn: str, claim_placement: str = "first") -> ShardDaemon:
    """A shard served in this process: no replay cache (replays read the database), no relay, its
    claims placed as asked (`first`: on their own; `ahead`: with the handler's statements)."""
    settings = ShardSettings(
        dsn=dsn,
        listen="127.0.0.1:0",
        metrics_port=0,
        dev_mode=True,
        relay_workers=0,
        replay_cache_entries=0,
        shutdown_grace_s=1.0,
        claim_placement=claim_placement,
    )
    return start_shard(settings)


@contextmanager
def cost_shards(pg: LocalPostgres, dsn: str) -> Iterator[dict[str, Callable[[str, int], None]]]:
    """A Deposit sender through a shard of each claim placement (`first`, `ahead`)."""
    shards = [start_cost_shard(dsn, placement) for placement in ("first", "ahead")]
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{shards[0].port}") as first,
            grpc.insecure_channel(f"127.0.0.1:{shards[1].port}") as ahead,
        ):
            yield {
                "first": depositor(transfer_pb2_grpc.TransferServiceStub(first)),
                "ahead": depositor(transfer_pb2_grpc.TransferServiceStub(ahead)),
            }
    finally:
        for shard in shards:
            shard.stop(0.5)


def depositor(stub: transfer_pb2_grpc.TransferServiceStub) -> Callable[[str, int], None]:
    """Send one Deposit under `key` (to the account `i` picks); raises on any non-OK answer."""

    def send(key: str, i: int) -> None:
        request = transfer_pb2.DepositRequest(
            account_id=ACCOUNTS[i % len(ACCOUNTS)],
            amount=transfer_pb2.Money(amount_minor=1 + i % 7, currency="EUR"),
        )
        stub.Deposit(request, metadata=(("idempotency-key", key),), timeout=10)

    return send


def measure(
    conn: psycopg.Connection[Any], name: str, keys: list[str], send: Callable[[str, int], None]
) -> Cell:
    """One call at a time for each key, then an idle interval as long, subtracted."""
    time.sleep(0.2)
    before, wal_before = snapshot(conn)
    started = time.monotonic()
    for i, key in enumerate(keys):
        send(key, i)
    wall_s = time.monotonic() - started
    during, wal_during = snapshot(conn)
    time.sleep(wall_s)
    idle_end, wal_idle = snapshot(conn)
    load = minus(delta(before, during), delta(during, idle_end))
    # The idle interval's WAL (checkpoints, autovacuum) out of the load's.
    server_wal = (wal_during - wal_before) - (wal_idle - wal_during)
    n = len(keys)
    statements = [
        {"query": v["query"], "toplevel": k[1], **{c: v[c] / n for c in COUNTERS}}
        for k, v in sorted(load.items(), key=lambda kv: (not kv[0][1], -kv[1]["calls"], kv[1]["query"]))
    ]
    return Cell(name, n, statements, server_wal / n)


def run(calls: int, warmup: int, what_if: str = "") -> list[Cell]:
    """The four cells, on a server of their own; `what_if`: SQL run after the migrations (to price a
    schema change before writing its migration)."""
    workdir = Path(tempfile.mkdtemp(prefix="statement-cost-"))
    try:
        with cost_server(workdir) as pg:
            dsn = create_measured_database(pg)
            if what_if:
                with psycopg.connect(pg.dsn_for(DATABASE), autocommit=True) as conn:
                    conn.execute(what_if.encode())
            with (
                cost_shards(pg, dsn) as senders,
                psycopg.connect(pg.dsn_for(DATABASE), autocommit=True) as conn,
            ):
                return run_cells(conn, senders, calls, warmup)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_cells(
    conn: psycopg.Connection[Any], senders: dict[str, Callable[[str, int], None]], calls: int, warmup: int
) -> list[Cell]:
    """Warm every path up, then measure each cell: new keys and their replays, the claim sent
    first (UUIDv7 and opaque keys), then sent ahead of the handler (UUIDv7 keys: the shipped
    placement for new keys; a replay there is a duplicate that started its handler)."""
    first, ahead = senders["first"], senders["ahead"]
    uuid_keys = [str(new_key()) for _ in range(calls)]
    opaque_keys = [f"order-{new_key().hex}" for _ in range(calls)]
    ahead_keys = [str(new_key()) for _ in range(calls)]
    for i in range(warmup):  # every statement prepared (psycopg prepares after five uses)
        for key in (str(new_key()), f"warm-{new_key().hex}"):
            first(key, i)
            first(key, i)
        key = str(new_key())
        ahead(key, i)
        ahead(key, i)
    return [
        measure(conn, "new key (UUIDv7)", uuid_keys, first),
        measure(conn, "replay (UUIDv7)", uuid_keys, first),
        measure(conn, "new key (opaque)", opaque_keys, first),
        measure(conn, "replay (opaque)", opaque_keys, first),
        measure(conn, "new key (UUIDv7, claim ahead)", ahead_keys, ahead),
        measure(conn, "replay (UUIDv7, claim ahead)", ahead_keys, ahead),
    ]


def report(cells: list[Cell]) -> str:
    """The per-call table of each cell, statement by statement, then its totals."""
    lines = []
    for cell in cells:
        t = cell.totals()
        lines += [
            f"== {cell.name}: {cell.calls} calls, per call: {t['statements_top']:.2f} statements sent"
            " (BEGIN/COMMIT apart)"
            f" + {t['statements_nested']:.2f} nested, {t['plans']:.2f} plans, WAL {t['wal_bytes']:.0f} B"
            f" (server {t['server_wal_bytes']:.0f} B), {t['shared_blks_hit']:.1f} buffer hits,"
            f" {t['shared_blks_dirtied']:.2f} dirtied, {t['db_ms']:.3f} ms (load-dependent)",
            f"   {'calls':>5} {'plans':>5} {'rows':>5} {'WAL B':>6} {'hits':>6} {'ms':>6}  statement",
        ]
        for s in cell.statements:
            where = "" if s["toplevel"] else "  (nested) "
            text = " ".join(s["query"].split())
            lines.append(
                f"   {s['calls']:5.2f} {s['plans']:5.2f} {s['rows']:5.2f} {s['wal_bytes']:6.0f}"
                f" {s['shared_blks_hit']:6.1f} {s['total_exec_time'] + s['total_plan_time']:6.3f}"
                f"  {where}{text[:110]}"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the cells and print (and optionally write as JSON) the figures."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.statement_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--calls", type=int, default=300, help="calls per cell (default 300)")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up keys of each kind (default 50)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--what-if", type=Path, help="a SQL file run after the migrations (an experiment)")
    args = parser.parse_args(argv)
    cells = run(args.calls, args.warmup, args.what_if.read_text() if args.what_if else "")
    print(report(cells))
    if args.json:
        args.json.write_text(
            json.dumps(
                [{"name": c.name, "totals": c.totals(), "statements": c.statements} for c in cells], indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
