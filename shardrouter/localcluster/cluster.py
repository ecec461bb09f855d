"""A whole shard-router system on one machine: a PostgreSQL per shard (optionally a primary plus a
synchronous standby, `standby`), one or more `shardd` processes per shard (`replicas`, all over the
shard's one database), and the router, each a separate process on loopback. Used by
`shard-router dev up` and the e2e tests.

The shard map file in the data directory is the cluster's record of its shards: a new data
directory gets an even map of `shards` shards, a later start serves the shards of the map it finds
(with the slot ranges moves gave them, at new ports), and `add_shard` adds one to a running cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardrouter.core.shardmap import (
    Shard,
    ShardMap,
    even_shard_map,
    load_shard_map,
    parse_shard_map,
    shard_map_document,
    update_shard_map,
    write_shard_map,
)
from shardrouter.localcluster.datadir import default_data_dir
from shardrouter.localcluster.postgres import LocalPostgres, ReplicatedPostgres, free_port

log = logging.getLogger(__name__)

_NUMBERED_SHARD = re.compile(r"shard-(\d+)")
_SHARD_DATABASE_DIR = re.compile(r"pg-shard-(\d+)(-replicated)?")
#: How long `shardd migrate` may take on a new, empty database.
_MIGRATE_TIMEOUT_S = 120.0


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
                    raise RuntimeError(
                        f"{self.name} exited ({self.proc.returncode}); see {self.log_path}, which ends:\n"
                        + self._log_tail()
                    )
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1:
                        self.check_owns_port()
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not become healthy; see {self.log_path}")

    def _log_tail(self, lines: int = 12) -> str:
        """The last lines of its log: what a process that exited at once said (its directory may be
        gone by the time someone reads the path)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(its log could not be read: {exc})"

    def check_owns_port(self) -> None:
        """RuntimeError unless the process that answers on its port is the one started here (or one
        of its children): a health check answered by a stranger on a busy port proves nothing, and
        the cluster must never send a call to a process it did not start."""
        assert self.proc is not None
        owner = serves_port(self.proc.pid, self.port)
        if self.proc.poll() is not None or owner is False:
            raise RuntimeError(
                f"{self.name}: port {self.port} on 127.0.0.1 answers, but not from the process this "
                f"cluster started (another program listens there); see {self.log_path}"
            )

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


@dataclass(frozen=True)
class FixedPort:
    """A port the cluster is told to use (not drawn free), with the flag that changes it."""

    port: int
    role: str
    flag: str


class PortInUseError(RuntimeError):
    """Ports the cluster needs are taken; nothing was started. The message is one line naming each
    port, what it is for and the flag that changes it."""

    def __init__(self, ports: Sequence[FixedPort]) -> None:
        self.ports = tuple(ports)
        named = "; ".join(
            f"port {p.port} ({p.role}) is in use on 127.0.0.1: give another {p.flag}" for p in ports
        )
        super().__init__(f"{named} (another `shard-router dev up` may be running)")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` on `host` now: nothing listens there, with or without
    SO_REUSEPORT. SO_REUSEADDR as the servers set it, so connections of a stopped server still in
    TIME_WAIT do not count as in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def serves_port(pid: int, port: int) -> bool | None:
    """Whether a socket listening on TCP `port` belongs to process `pid` or one of its descendants
    (a shard daemon's serving processes); None where this system cannot tell (no Linux /proc)."""
    listening = _listening_inodes(port)
    if listening is None:
        return None
    return any(_socket_inodes(p) & listening for p in _process_tree(pid))


def _listening_inodes(port: int) -> set[int] | None:
    """The inodes of the sockets in LISTEN state on `port` (any address), from /proc/net."""
    inodes: set[int] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            # local_address is HEX_ADDRESS:HEX_PORT; state 0A is LISTEN.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes if readable else None


def _process_tree(pid: int) -> set[int]:
    """`pid` and every process descending from it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses, so split after the last ')'.
        parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    tree = {pid}
    grew = True
    while grew:
        found = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= found
        grew = bool(found)
    return tree


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open (empty if it cannot be read)."""
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


@dataclass(frozen=True)
class AddedShard:
    """A shard `LocalCluster.add_shard` started and put in the map, owning no slots yet."""

    shard_id: str
    addresses: tuple[str, ...]
    dsn: str
    #: The version of the shard map that names it.
    map_version: int
    #: How long adding it took, from the request to its daemons serving.
    seconds: float


@dataclass
class LocalCluster:
    """PostgreSQL servers, shard daemons and a router, started and stopped together.

    Its other ports (shard daemons, PostgreSQL, /metrics) are drawn free when it starts; the router's
    two are fixed, so `start` first checks they are free (`ports_in_use`) and starts nothing if not.
    """

    data_dir: Path
    shards: int = 2
    #: Shard daemons per shard, each a process of its own over the shard's database; the shard map
    #: lists them all and the router spreads calls over them.
    replicas: int = 1
    #: Run each shard's PostgreSQL as a primary plus a synchronous streaming standby: a commit is
    #: acknowledged only once the standby has it (see `ReplicatedPostgres`).
    standby: bool = False
    router_port: int = 50051
    #: The router's HTTP/JSON front on 127.0.0.1 (0: none).
    http_port: int = 8080
    #: Serve /metrics of every process on a free loopback port (see `metrics_urls`).
    metrics: bool = False
    #: OTLP/gRPC endpoint every process sends its spans to ("" = tracing off).
    otlp_endpoint: str = ""
    #: Archive every shard's WAL into `wal-archive/SHARD/` of the data directory (`archive_mode = on`),
    #: which a point-in-time restore of the shard replays from a base backup (`ShardRestores`).
    wal_archive: bool = True
    #: Process name -> its /metrics port, filled by `start` when `metrics` is on.
    metrics_ports: dict[str, int] = field(default_factory=dict)
    #: The shards this run serves, in the map's order (filled by `start`, grown by `add_shard`).
    shard_ids: list[str] = field(default_factory=list)
    #: One per shard, in the order of `shard_ids`.
    databases: list[LocalPostgres | ReplicatedPostgres] = field(default_factory=list)
    shard_daemons: list[Daemon] = field(default_factory=list)
    router: Daemon | None = None
    #: Held by `add_shard` and `stop`: a stop waits for a shard being added, then stops it too.
    _changing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _stopping: bool = field(default=False, repr=False, compare=False)

    @property
    def shard_map_path(self) -> Path:
        """The shard map file the router and the relays read."""
        return self.data_dir / "shard-map.yaml"

    @property
    def databases_path(self) -> Path:
        """Shard id -> its database's DSN (YAML), for `shard-router reshard`."""
        return self.data_dir / "databases.yaml"

    def existing_shard_map(self) -> ShardMap | None:
        """The map an earlier run of this data directory left (None: a new cluster); ShardMapError
        if the file is there but unusable."""
        return load_shard_map(self.shard_map_path) if self.shard_map_path.exists() else None

    def start(self) -> None:
        """Start everything; on any failure stop what was started.

        A data directory with a shard map is started with that map's shards and slot ranges (the
        shards `add_shard` added and the ranges moves gave them included; `shards` is then not
        used), at new ports, under a higher version.
        """
        if self.shards < 1 or self.replicas < 1:
            raise ValueError("a cluster needs at least one shard, and one daemon per shard")
        busy = self.ports_in_use()
        if busy:
            raise PortInUseError(busy)
        self._stopping = False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        try:
            existing = self.existing_shard_map()
            self.shard_ids = (
                [s.id for s in existing.shards] if existing else [f"shard-{i}" for i in range(self.shards)]
            )
            for shard_id in self.shard_ids:
                db = self._database(shard_id)
                self.databases.append(db)  # before start: a failed start is still stopped
                _start_database(db)
            names = {sid: [self.daemon_name(sid, r) for r in range(self.replicas)] for sid in self.shard_ids}
            ports = {name: free_port() for names_of in names.values() for name in names_of}
            if self.metrics:
                self.metrics_ports = {name: free_port() for name in [*ports, "router"]}
            addresses = {
                sid: [f"127.0.0.1:{ports[name]}" for name in names_of] for sid, names_of in names.items()
            }
            shard_map = (
                _readdressed(existing, addresses) if existing else even_shard_map(addresses, version=1)
            )
            write_shard_map(self.shard_map_path, shard_map)
            self._write_databases(
                {sid: db.dsn_for("shardd") for sid, db in zip(self.shard_ids, self.databases, strict=True)}
            )
            for shard_id, db in zip(self.shard_ids, self.databases, strict=True):
                for name in names[shard_id]:
                    self.shard_daemons.append(self._shardd(shard_id, name, ports[name], db))
            for daemon in self.shard_daemons:
                daemon.start()
            self.router = self._router()
            self.router.start()
        except BaseException:
            self.stop()
            raise

    def ports_in_use(self) -> list[FixedPort]:
        """The router's fixed ports (gRPC, HTTP front) that something listens on now."""
        fixed = [FixedPort(self.router_port, "the router's gRPC port", "--port")]
        if self.http_port:
            fixed.append(
                FixedPort(self.http_port, "the router's HTTP front", "--http-port (0: no HTTP front)")
            )
        return [port for port in fixed if not port_is_free(port.port)]

    def add_shard(self) -> AddedShard:
        """Add a shard to the running cluster: its PostgreSQL (a standby too with `standby`), its
        migrated database and its `replicas` daemons, named in the shard map owning no slots under a
        higher version (the router and the other daemons follow the file) and in `databases.yaml`.

        Its processes are this cluster's: `stop` stops them, and a later `start` of this data
        directory starts them again. On a failure everything of the new shard is undone (the map
        entry too, while the shard owns no slots) and the error raised.
        """
        started = time.monotonic()
        with self._changing:
            if self.router is None or self._stopping:
                raise RuntimeError("the cluster is not running")
            shard_id = self.next_shard_id()
            db = self._database(shard_id)
            names = [self.daemon_name(shard_id, r) for r in range(self.replicas)]
            ports = {name: free_port() for name in names}
            addresses = [f"127.0.0.1:{ports[name]}" for name in names]
            if self.metrics:
                self.metrics_ports |= {name: free_port() for name in names}
            daemons = [self._shardd(shard_id, name, ports[name], db) for name in names]
            named = False
            try:
                _start_database(db)
                self._migrate(daemons[0])
                # shardd refuses to start without its entry in the map, so the entry comes first; it
                # owns no slots, so no call is routed to the shard before its daemons serve.
                shard_map = update_shard_map(
                    self.shard_map_path, lambda current: _with_empty_shard(current, shard_id, addresses)
                )
                named = True
                self._write_databases({**self._read_databases(), shard_id: db.dsn_for("shardd")})
                for daemon in daemons:
                    daemon.start()
            except BaseException:
                for daemon in daemons:
                    daemon.stop()
                if named:
                    self._forget(shard_id)
                for name in names:
                    self.metrics_ports.pop(name, None)
                db.destroy()  # new and empty, owned by no map: nothing of it is worth keeping
                raise
            self.shard_ids.append(shard_id)
            self.databases.append(db)
            self.shard_daemons.extend(daemons)
        return AddedShard(
            shard_id=shard_id,
            addresses=tuple(addresses),
            dsn=db.dsn_for("shardd"),
            map_version=shard_map.version,
            seconds=round(time.monotonic() - started, 1),
        )

    def next_shard_id(self) -> str:
        """`shard-N`, N one above every shard number in the map and among the data directory's
        database folders (a folder of an earlier, larger cluster is never taken over)."""
        numbers = [
            int(match[1])
            for shard in load_shard_map(self.shard_map_path).shards
            if (match := _NUMBERED_SHARD.fullmatch(shard.id))
        ]
        numbers += [
            int(match[1])
            for entry in self.data_dir.iterdir()
            if (match := _SHARD_DATABASE_DIR.fullmatch(entry.name))
        ]
        return f"shard-{max(numbers, default=-1) + 1}"

    def stop(self) -> None:
        """Stop the router, then the shards, then the databases (clean shutdowns); a shard being
        added is added first, then stopped with the rest."""
        with self._changing:
            self._stopping = True
            if self.router:
                self.router.stop()
            for daemon in self.shard_daemons:
                daemon.stop()
            for db in self.databases:
                db.stop("fast")

    def wipe(self) -> None:
        """Delete all data of the cluster."""
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _database(self, shard_id: str) -> LocalPostgres | ReplicatedPostgres:
        """A shard's PostgreSQL (not started): its folder is named after the shard."""
        archive = self.archive_dir(shard_id) if self.wal_archive else None
        if self.standby:
            return ReplicatedPostgres(self.data_dir / f"pg-{shard_id}-replicated", archive_dir=archive)
        return LocalPostgres(self.data_dir / f"pg-{shard_id}", archive_dir=archive)

    def archive_dir(self, shard_id: str) -> Path:
        """Where a shard's PostgreSQL archives its WAL (for a point-in-time restore of the shard:
        `ShardRestores` in `shard_restore.py`)."""
        return self.data_dir / "wal-archive" / shard_id

    def shard_dsn(self, shard_id: str, database: str = "shardd") -> str:
        """The connection string of a shard's database (with `standby`, naming both servers)."""
        return self._shard_database(shard_id).dsn_for(database)

    @contextlib.contextmanager
    def holding(self, shard_id: str) -> Iterator[LocalPostgres | ReplicatedPostgres]:
        """A shard's PostgreSQL in the running cluster, held still for the block: no `add_shard`
        and no `stop` runs until it ends (ValueError: no such shard; RuntimeError: not running)."""
        with self._changing:
            if self.router is None or self._stopping:
                raise RuntimeError("the cluster is not running")
            yield self._shard_database(shard_id)

    def _shard_database(self, shard_id: str) -> LocalPostgres | ReplicatedPostgres:
        if shard_id not in self.shard_ids:
            raise ValueError(f"no shard {shard_id!r} (shards: {', '.join(self.shard_ids)})")
        return self.databases[self.shard_ids.index(shard_id)]

    def _migrate(self, daemon: Daemon) -> None:
        """`shardd migrate` on a daemon's database, logged to that daemon's log."""
        # No shard map: it would have to name the shard already, and migrating does not route.
        env = {k: v for k, v in daemon.env.items() if k != "SHARDD_SHARD_MAP"}
        with daemon.log_path.open("ab") as out:
            done = subprocess.run(
                [*installed_command("shardd"), "migrate"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=_MIGRATE_TIMEOUT_S,
                check=False,
            )
        if done.returncode != 0:
            raise RuntimeError(f"shardd migrate failed ({done.returncode}); see {daemon.log_path}")

    def _read_databases(self) -> dict[str, str]:
        loaded = yaml.safe_load(self.databases_path.read_text(encoding="utf-8"))
        return dict(loaded) if isinstance(loaded, dict) else {}

    def _write_databases(self, dsns: Mapping[str, str]) -> None:
        """Replace `databases.yaml` atomically (a `reshard` reading it sees the old or the new)."""
        temporary = self.databases_path.with_name(f".{self.databases_path.name}.{os.getpid()}.tmp")
        temporary.write_text(yaml.safe_dump(dict(dsns)), encoding="utf-8")
        os.replace(temporary, self.databases_path)

    def _forget(self, shard_id: str) -> None:
        """Take a shard that failed to start out of the map and `databases.yaml` again, unless a
        move has given it slots meanwhile."""

        def without_it(current: ShardMap) -> ShardMap | None:
            index = next(i for i, s in enumerate(current.shards) if s.id == shard_id)
            if any(owner == index for _, _, owner in current.ranges):
                log.warning("%s failed to start but owns slots now; it stays in the map", shard_id)
                return None
            document = shard_map_document(current)
            document["shards"] = [s for s in document["shards"] if s["id"] != shard_id]
            document["version"] = current.version + 1
            return parse_shard_map(document, source=str(self.shard_map_path))

        update_shard_map(self.shard_map_path, without_it)
        self._write_databases({k: v for k, v in self._read_databases().items() if k != shard_id})

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
            "ROUTER_HTTP_LISTEN": f"127.0.0.1:{self.http_port}" if self.http_port else "",
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


def _start_database(db: LocalPostgres | ReplicatedPostgres) -> None:
    """Start a shard's PostgreSQL and create its `shardd` database (if missing)."""
    db.start()
    (db.primary if isinstance(db, ReplicatedPostgres) else db).create_database("shardd")


def _readdressed(shard_map: ShardMap, addresses: Mapping[str, Sequence[str]]) -> ShardMap:
    """The same shards and slot ranges at new addresses, under a higher version."""
    return ShardMap(
        slots=shard_map.slots,
        shards=tuple(Shard(id=s.id, addresses=tuple(addresses[s.id])) for s in shard_map.shards),
        ranges=shard_map.ranges,
        version=shard_map.version + 1,
    )


def _with_empty_shard(shard_map: ShardMap, shard_id: str, addresses: Sequence[str]) -> ShardMap:
    """The map with one more shard, owning no slots, under a higher version."""
    document = shard_map_document(shard_map)
    document["shards"].append({"id": shard_id, "addresses": list(addresses), "slot_ranges": []})
    document["version"] = shard_map.version + 1
    return parse_shard_map(document, source="<added shard>")


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
    "AddedShard",
    "Daemon",
    "FixedPort",
    "LocalCluster",
    "PortInUseError",
    "default_data_dir",
    "installed_command",
    "port_is_free",
    "serves_port",
]
