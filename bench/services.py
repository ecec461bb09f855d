"""The system under test: one fresh durable PostgreSQL in a temp dir, the shard daemons, the router and
the no-idempotency twin, each a separate process on 127.0.0.1, all stopped and deleted at the end.

One PostgreSQL server holds every database (`pgb` for pgbench, `shard_a`, `shard_b`, `noidem`), so
every figure of a run shares the same disk, WAL settings and CPU, and the ratios between rows hold.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import yaml

from bench.procstat import Tracked
from bench.wire import WireProxy
from shardrouter.core.shardmap import ShardMap, even_shard_map, shard_map_document
from shardrouter.localcluster.cluster import Daemon
from shardrouter.localcluster.postgres import LocalPostgres, free_port

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CURRENCY = "EUR"
#: Seed balance of every account: transfers never run out of funds, deposits never reach the limit.
SEED_BALANCE = 10**12

#: Durable, as the targets require (fsync and synchronous_commit on), sized for this 2-core / 24 GiB box.
#: max_connections leaves room for pgbench's 128 clients beside the daemons' pools; a large
#: max_wal_size keeps the bulk loads of the growth cells from forcing checkpoints mid-cell.
PG_SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_connections": "400",
    "shared_buffers": "512MB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "15min",
    "log_min_duration_statement": "-1",
}

#: Statement statistics for the round-trips rows (calls, execution and planning time per statement),
#: on for every row of a run since one server serves them all; `--statement-stats off` leaves them
#: out (bench/README.md gives what they cost). track=all so statements run inside functions and
#: triggers are seen too (the `toplevel` column keeps them apart from what the client sent).
STATEMENT_STATS_SETTINGS = {
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_utility": "on",
    "pg_stat_statements.track_planning": "on",
}
#: The login of the daemons whose statements the round-trips rows count: a superuser like `postgres`
#: (so it behaves the same), but its own `userid` in pg_stat_statements, apart from every other
#: daemon on the same database.
WIRE_ROLE = "bench_wire"

#: Admission is raised above the largest concurrency: the cells measure capacity, not shedding
#: (override with --shard-env to bench the shipped defaults). Everything else is shardd's default.
SHARD_ENV_DEFAULTS = {
    "SHARDD_WORKERS": "192",
    "SHARDD_MAX_IN_FLIGHT": "160",
    "SHARDD_MAX_WAITING": "16",
    "SHARDD_METRICS_PORT": "0",
    "SHARDD_DEV_MODE": "true",
    "SHARDD_SHUTDOWN_GRACE_S": "1",
    "GRPC_VERBOSITY": "ERROR",
}


@dataclass
class BenchSystem:
    """Everything a run starts; `close` stops it all and deletes the temp dir."""

    workdir: Path
    accounts: int
    shard_env: dict[str, str] = field(default_factory=dict)
    pg: LocalPostgres | None = None
    shard_map: ShardMap | None = None
    daemons: dict[str, Daemon] = field(default_factory=dict)
    accounts_a: list[str] = field(default_factory=list)
    accounts_b: list[str] = field(default_factory=list)
    hot_account: str = ""
    #: The router's HTTP/JSON front (ROUTER_HTTP_LISTEN), once the router is started.
    router_http_port: int = 0
    #: pg_stat_statements preloaded (and created in shard_a and noidem).
    statement_stats: bool = True
    #: Counting proxies in front of PostgreSQL (bench/wire.py), closed after the daemons.
    proxies: dict[str, WireProxy] = field(default_factory=dict)

    # --- PostgreSQL -------------------------------------------------------------------------------

    def start_postgres(self) -> None:
        """initdb + durable settings + start; create the databases."""
        self.pg = LocalPostgres(self.workdir / "pg")
        self.pg.init()
        settings = PG_SETTINGS | (STATEMENT_STATS_SETTINGS if self.statement_stats else {})
        with (self.pg.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n# bench\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
        self.pg.start()
        for name in ("pgb", "shard_a", "shard_b", "noidem"):
            self.pg.create_database(name)
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {WIRE_ROLE} LOGIN SUPERUSER")
        if self.statement_stats:
            for name in ("shard_a", "noidem"):
                with psycopg.connect(self.dsn(name), autocommit=True) as conn:
                    conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    def dsn(self, database: str) -> str:
        """DSN of one of the run's databases."""
        assert self.pg is not None
        return self.pg.dsn_for(database)

    def wire_dsn(self, database: str, name: str) -> str:
        """DSN of `database` through a new counting proxy `name` (bench/wire.py), as WIRE_ROLE and
        without TLS (the proxy parses the plain protocol)."""
        assert self.pg is not None
        proxy = WireProxy("127.0.0.1", self.pg.port, name)
        self.proxies[name] = proxy  # registered first: closed whatever happens next
        proxy.start()
        return f"postgresql://{WIRE_ROLE}@127.0.0.1:{proxy.port}/{database}?sslmode=disable"

    def postmaster_pid(self) -> int:
        """PID of the postmaster (first line of postmaster.pid)."""
        assert self.pg is not None
        return int((self.pg.data_dir / "postmaster.pid").read_text().split()[0])

    def server_version(self) -> str:
        """`SHOW server_version`."""
        with psycopg.connect(self.dsn("postgres")) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"

    def settings_in_force(self) -> dict[str, str]:
        """The durability-relevant settings as the server reports them."""
        names = [
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "wal_sync_method",
            "shared_buffers",
            "shared_preload_libraries",
        ]
        with psycopg.connect(self.dsn("postgres")) as conn:
            return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]

    # --- shard map and accounts --------------------------------------------------------------------

    def plan_shards(self) -> None:
        """Fix the ports and the shard map, and pick account ids each shard owns.

        Account ids are numeric strings (valid ids, and pgbench can make them from `random()`).
        """
        ports = {"shard-a": free_port(), "shard-b": free_port()}
        self.shard_map = even_shard_map({sid: f"127.0.0.1:{p}" for sid, p in ports.items()})
        (self.workdir / "shard-map.yaml").write_text(
            yaml.safe_dump(shard_map_document(self.shard_map), sort_keys=False)
        )
        owned: dict[str, list[str]] = {"shard-a": [], "shard-b": []}
        i = 0
        while min(len(v) for v in owned.values()) <= self.accounts and i < 100 * self.accounts + 1000:
            i += 1
            owned[self.shard_map.shard_for(str(i)).id].append(str(i))
        self.accounts_a, self.accounts_b = (
            owned["shard-a"][: self.accounts],
            owned["shard-b"][: self.accounts],
        )
        self.hot_account = owned["shard-a"][self.accounts]  # outside the random set: only the conflict cell
        self._ports = ports
        for name, ids in (("accounts_a", self.accounts_a), ("accounts_b", self.accounts_b)):
            (self.workdir / f"{name}.json").write_text(json.dumps(ids))

    def accounts_file(self, which: str) -> Path:
        """The JSON list of account ids the load generator picks from ("a" or "b")."""
        return self.workdir / f"accounts_{which}.json"

    def seed_accounts(self, database: str, ids: list[str]) -> None:
        """Open the accounts with a large balance, in one statement (the schema must exist)."""
        with psycopg.connect(self.dsn(database), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO accounts (id, currency, balance) SELECT unnest(%s::text[]), %s, %s"
                " ON CONFLICT (id) DO NOTHING",
                (ids, CURRENCY, SEED_BALANCE),
            )
            conn.execute("VACUUM ANALYZE accounts")

    # --- processes ---------------------------------------------------------------------------------

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{path}" if path else str(ROOT)}
        return {**env, **SHARD_ENV_DEFAULTS, **self.shard_env, **extra}

    def start_shard(
        self,
        name: str,
        *,
        shard_id: str,
        database: str,
        extra: dict[str, str] | None = None,
        dsn: str | None = None,
    ) -> Daemon:
        """A `shardd serve` process; `name` is the bench's handle (two may serve one shard id).

        `dsn` replaces the database's own (e.g. `wire_dsn`: through a counting proxy)."""
        port = self._ports[name] if name in self._ports else free_port()
        env = self._env(
            {
                "SHARDD_SHARD_ID": shard_id,
                "SHARDD_DSN": dsn or self.dsn(database),
                "SHARDD_LISTEN": f"127.0.0.1:{port}",
                "SHARDD_SHARD_MAP": str(self.workdir / "shard-map.yaml"),
                **(extra or {}),
            }
        )
        return self._start(
            Daemon(
                name, [sys.executable, "-m", "shardrouter.shardd.cli", "serve"], env, port, self._log(name)
            )
        )

    def start_router(
        self,
        name: str = "router",
        *,
        shard_map: Path | None = None,
        http: bool = True,
        metrics_port: int = 0,
        extra: dict[str, str] | None = None,
    ) -> Daemon:
        """A `router serve` process in dev mode in front of both shards (or of `shard_map`'s), with
        its HTTP/JSON front on a free loopback port (`router_http_address`) beside gRPC unless not
        `http`, and its metrics on `metrics_port` (0: none)."""
        port = free_port()
        http_port = free_port() if http else 0
        env = self._env(
            {
                "ROUTER_LISTEN": f"127.0.0.1:{port}",
                "ROUTER_HTTP_LISTEN": f"127.0.0.1:{http_port}" if http else "",
                "ROUTER_SHARD_MAP": str(shard_map or self.workdir / "shard-map.yaml"),
                "ROUTER_DEV_MODE": "true",
                "ROUTER_METRICS_PORT": str(metrics_port),
                "ROUTER_SHUTDOWN_GRACE_S": "1",
                **(extra or {}),
            }
        )
        daemon = self._start(
            Daemon(
                name,
                [sys.executable, "-m", "shardrouter.router.cli", "serve"],
                env,
                port,
                self._log(name),
            )
        )
        if http:
            self.router_http_port = http_port
            if not wait_until(lambda: _http_healthy(self.router_http_address), 30, 0.1):
                raise TimeoutError(f"the router's HTTP front did not answer; see {daemon.log_path}")
        return daemon

    @property
    def router_http_address(self) -> str:
        """host:port of the router's HTTP/JSON front."""
        return f"127.0.0.1:{self.router_http_port}"

    def start_noidem(
        self, name: str = "noidem", *, dsn: str | None = None, extra: dict[str, str] | None = None
    ) -> Daemon:
        """The real TransferServicer without the idempotency interceptor (bench/noidem_server.py),
        on database `noidem` (or `dsn`, e.g. through a counting proxy)."""
        port = free_port()
        env = self._env(
            {
                "SHARDD_DSN": dsn or self.dsn("noidem"),
                "SHARDD_LISTEN": f"127.0.0.1:{port}",
                "SHARDD_SHARD_MAP": "",
                **(extra or {}),
            }
        )
        return self._start(
            Daemon(name, [sys.executable, "-m", "bench.noidem_server"], env, port, self._log(name))
        )

    def _log(self, name: str) -> Path:
        (self.workdir / "logs").mkdir(exist_ok=True)
        return self.workdir / "logs" / f"{name}.log"

    def _start(self, daemon: Daemon) -> Daemon:
        self.daemons[daemon.name] = daemon  # registered first: a failed start is still stopped
        daemon.start(timeout_s=60)
        return daemon

    def tracked(self) -> list[Tracked]:
        """Every process whose CPU and memory the cells report."""
        out = [
            Tracked(name, d.proc.pid) for name, d in self.daemons.items() if d.proc and d.proc.poll() is None
        ]
        if self.pg is not None:
            out.append(Tracked("postgres", self.postmaster_pid(), tree=True))
        return out

    def close_proxies(self) -> None:
        """Stop the counting proxies (after the daemons that connect through them)."""
        for name, proxy in list(self.proxies.items()):
            try:
                proxy.close()
            except Exception:
                log.exception("stopping the proxy %s failed", name)
        self.proxies.clear()

    def close(self) -> None:
        """Stop every process and proxy, then the database, then delete the temp dir."""
        for daemon in reversed(list(self.daemons.values())):
            try:
                daemon.stop(timeout_s=10)
            except Exception:  # keep stopping the rest: nothing may be left running
                log.exception("stopping %s failed", daemon.name)
        self.close_proxies()
        if self.pg is not None:
            try:
                self.pg.destroy()
            except Exception:
                log.exception("stopping PostgreSQL failed")
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextmanager
def bench_system(
    accounts: int, shard_env: dict[str, str], keep: bool = False, statement_stats: bool = True
) -> Iterator[BenchSystem]:
    """A BenchSystem in a fresh temp dir, closed whatever happens (also on Ctrl-C)."""
    # Not under /tmp/pytest-*: the unprivileged server user must be able to traverse to its data.
    workdir = Path(tempfile.mkdtemp(prefix="shard-router-bench-"))
    system = BenchSystem(workdir, accounts, shard_env, statement_stats=statement_stats)
    try:
        yield system
    finally:
        if keep:
            log.warning("keeping %s (--keep)", workdir)
            for daemon in system.daemons.values():
                daemon.stop()
            system.close_proxies()
            if system.pg is not None:
                system.pg.stop()
        else:
            system.close()


def _http_healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_until(predicate: object, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll a zero-argument callable until it returns truthy or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return True
        time.sleep(interval_s)
    return False
