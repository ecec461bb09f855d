"""A whole shard-router system on one machine: a PostgreSQL per shard (optionally a primary plus a
synchronous standby, `standby`), one or more `shardd` processes per shard (`replicas`, all over the
shard's one database), and the router, each a separate process on loopback. Used by
`shard-router dev up` and the e2e tests.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardrouter.core.shardmap import even_shard_map, write_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, ReplicatedPostgres, free_port

log = logging.getLogger(__name__)


def default_data_dir() -> Path:
    """Where the local cluster keeps its databases unless told otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "shard-router" / "cluster"


@dataclass
class Daemon:
    """One started process of the cluster."""

    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """Its gRPC address."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Start it and wait for gRPC health SERVING."""
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log_path}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not become healthy; see {self.log_path}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not leave in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class LocalCluster:
    """PostgreSQL servers, shard daemons and a router, started and stopped together."""

    data_dir: Path
    shards: int = 2
    #: Shard daemons per shard, each a process of its own over the shard's database; the shard map
    #: lists them all and the router spreads calls over them.
    replicas: int = 1
    #: Run each shard's PostgreSQL as a primary plus a synchronous streaming standby: a commit is
    #: acknowledged only once the standby has it (see `ReplicatedPostgres`).
    standby: bool = False
    router_port: int = 50051
    #: Serve /metrics of every process on a free loopback port (see `metrics_urls`).
    metrics: bool = False
    #: OTLP/gRPC endpoint every process sends its spans to ("" = tracing off).
    otlp_endpoint: str = ""
    #: Process name -> its /metrics port, filled by `start` when `metrics` is on.
    metrics_ports: dict[str, int] = field(default_factory=dict)
    databases: list[LocalPostgres | ReplicatedPostgres] = field(default_factory=list)
    shard_daemons: list[Daemon] = field(default_factory=list)
    router: Daemon | None = None

    @property
    def shard_map_path(self) -> Path:
        """The shard map file the router and the relays read."""
        return self.data_dir / "shard-map.yaml"

    @property
    def databases_path(self) -> Path:
        """Shard id -> its database's DSN (YAML), for `shard-router reshard`."""
        return self.data_dir / "databases.yaml"

    def start(self) -> None:
        """Start everything; on any failure stop what was started."""
        if self.shards < 1 or self.replicas < 1:
            raise ValueError("a cluster needs at least one shard, and one daemon per shard")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        try:
            self._start_databases()
            names = {
                f"shard-{i}": [self.daemon_name(f"shard-{i}", r) for r in range(self.replicas)]
                for i in range(self.shards)
            }
            ports = {name: free_port() for names_of in names.values() for name in names_of}
            if self.metrics:
                self.metrics_ports = {name: free_port() for name in [*ports, "router"]}
            shard_map = even_shard_map(
                {sid: [f"127.0.0.1:{ports[name]}" for name in names_of] for sid, names_of in names.items()},
                version=1,
            )
            write_shard_map(self.shard_map_path, shard_map)
            self.databases_path.write_text(
                yaml.safe_dump(
                    {sid: db.dsn_for("shardd") for sid, db in zip(names, self.databases, strict=True)}
                )
            )
            for i, (shard_id, names_of) in enumerate(names.items()):
                for name in names_of:
                    self.shard_daemons.append(self._shardd(shard_id, name, ports[name], self.databases[i]))
            for daemon in self.shard_daemons:
                daemon.start()
            self.router = self._router()
            self.router.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the router, then the shards, then the databases (clean shutdowns)."""
        if self.router:
            self.router.stop()
        for daemon in self.shard_daemons:
            daemon.stop()
        for db in self.databases:
            db.stop("fast")

    def wipe(self) -> None:
        """Delete all data of the cluster."""
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _start_databases(self) -> None:
        for i in range(self.shards):
            where = self.data_dir / (f"pg-shard-{i}-replicated" if self.standby else f"pg-shard-{i}")
            db: LocalPostgres | ReplicatedPostgres = (
                ReplicatedPostgres(where) if self.standby else LocalPostgres(where)
            )
            self.databases.append(db)  # before start: a failed start is still stopped
            db.start()
            (db.primary if isinstance(db, ReplicatedPostgres) else db).create_database("shardd")

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Process name -> its Prometheus endpoint (empty unless `metrics` is on)."""
        return {name: f"http://127.0.0.1:{port}/metrics" for name, port in self.metrics_ports.items()}

    def _telemetry_env(self, service: str) -> dict[str, str]:
        env = {"OTEL_SERVICE_NAME": service}
        if self.otlp_endpoint:
            # Export quickly: a developer looks for the spans right after the call.
            env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint, "OTEL_BSP_SCHEDULE_DELAY": "500"}
        return env

    def _metrics_port(self, name: str) -> str:
        return str(self.metrics_ports.get(name, 0))  # 0: no /metrics

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def daemon_name(self, shard_id: str, replica: int) -> str:
        """The name of a shard's daemon: the shard's id, with a letter per replica when there are
        several (shard-0a, shard-0b)."""
        return shard_id if self.replicas == 1 else f"{shard_id}{chr(ord('a') + replica)}"

    def daemons_of(self, shard_id: str) -> list[Daemon]:
        """The daemons serving one shard."""
        return [d for d in self.shard_daemons if d.env["SHARDD_SHARD_ID"] == shard_id]

    def _shardd(self, shard_id: str, name: str, port: int, db: LocalPostgres | ReplicatedPostgres) -> Daemon:
        env = {
            **self._env(),
            "SHARDD_SHARD_ID": shard_id,
            "SHARDD_DSN": db.dsn_for("shardd"),
            "SHARDD_LISTEN": f"127.0.0.1:{port}",
            "SHARDD_SHARD_MAP": str(self.shard_map_path),
            "SHARDD_DEV_MODE": "true",
            "SHARDD_METRICS_PORT": self._metrics_port(name),
            **self._telemetry_env(f"shardd-{name}"),
        }
        return Daemon(
            name,
            [*installed_command("shardd"), "serve"],
            env,
            port,
            self.data_dir / "logs" / f"{name}.log",
        )

    def _router(self) -> Daemon:
        env = {
            **self._env(),
            "ROUTER_LISTEN": f"127.0.0.1:{self.router_port}",
            "ROUTER_SHARD_MAP": str(self.shard_map_path),
            "ROUTER_DEV_MODE": "true",
            "ROUTER_METRICS_PORT": self._metrics_port("router"),
            **self._telemetry_env("router"),
        }
        return Daemon(
            "router",
            [*installed_command("router"), "serve"],
            env,
            self.router_port,
            self.data_dir / "logs" / "router.log",
        )


def installed_command(name: str) -> list[str]:
    """The installed console script `name` beside this interpreter (the virtualenv's `bin/`), else
    the one on PATH: the daemons start as a user starts them, never from a source path."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"the {name!r} command is not installed (pip install the shard-router package)")
    return [found]


__all__ = [
    "Daemon",
    "LocalCluster",
    "default_data_dir",
    "installed_command",
]
