"""A whole shard-router system on one machine: a PostgreSQL per shard (optionally a primary plus a
synchronous standby, `standby`), one or more `shardd` processes per shard (`replicas`, all over the
shard's one database), and the router, each a separate process on loopback. Used by
`shard-router dev up` and the e2e tests.

The shard map file in the data directory is the cluster's record of its shards: a new data
directory gets an even map of `shards` shards, a later start serves the shards of the map it finds
(with the slot ranges moves gave them, at new ports), and `add_shard` adds one to a running cluster.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
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
from shardrouter.localcluster import pitr
from shardrouter.localcluster.datadir import default_data_dir
from shardrouter.localcluster.pitr import Backup, RestorePoint
from shardrouter.localcluster.postgres import LocalPostgres, ReplicatedPostgres, free_port

log = logging.getLogger(__name__)

_NUMBERED_SHARD = re.compile(r"shard-(\d+)")
#: The record of a shard's restore points, in its backups folder.
_RESTORE_POINTS = "restore-points.json"
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


@dataclass(frozen=True)
class RestoredShard:
    """A shard `LocalCluster.restore_shard` put back to a point in time; its daemons serve again."""

    shard_id: str
    #: The base backup it started from.
    backup: Backup
    #: The target: a restore point's name, or a time (UTC); the other is None.
    target_name: str | None
    target_time: datetime | None
    #: The timeline the restored database writes on (one above the history it replayed).
    timeline: int
    #: Where its WAL was when it accepted writes again.
    lsn: str
    #: From the request to its daemons serving again.
    seconds: float


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
    #: The router's HTTP/JSON front on 127.0.0.1 (0: none).
    http_port: int = 8080
    #: Serve /metrics of every process on a free loopback port (see `metrics_urls`).
    metrics: bool = False
    #: OTLP/gRPC endpoint every process sends its spans to ("" = tracing off).
    otlp_endpoint: str = ""
    #: Archive every shard's WAL into `wal-archive/SHARD/` of the data directory (`archive_mode = on`),
    #: which `restore_shard` replays from a base backup (`backup_shard`).
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

    # -- point-in-time restore of one shard ------------------------------------------------------

    def archive_dir(self, shard_id: str) -> Path:
        """Where a shard's PostgreSQL archives its WAL."""
        return self.data_dir / "wal-archive" / shard_id

    def backups_dir(self, shard_id: str) -> Path:
        """Where a shard's base backups (a folder and a `.json` record each) and the record of its
        restore points (`restore-points.json`) are kept."""
        return self.data_dir / "backups" / shard_id

    def backup_shard(self, shard_id: str) -> Backup:
        """Take a base backup of a shard's running PostgreSQL (`pg_basebackup`, plain format, fast
        checkpoint) into `backups_dir(shard_id)`; the daemons keep serving meanwhile."""
        with self._changing:
            server = self._running_server(shard_id)
            started_at = datetime.now(UTC)
            label = started_at.strftime("%Y%m%dT%H%M%S.%fZ")
            path = self.backups_dir(shard_id) / label
            start_lsn, end_lsn, timeline = pitr.base_backup(server, path, f"shard-router {shard_id} {label}")
            backup = Backup(
                shard_id=shard_id,
                label=label,
                path=path,
                started_at=started_at,
                finished_at=datetime.now(UTC),
                start_lsn=start_lsn,
                end_lsn=end_lsn,
                timeline=timeline,
            )
            pitr.write_json(path.with_name(f"{label}.json"), backup.to_json())
        log.info("base backup of %s: %s", shard_id, path)
        return backup

    def backups(self, shard_id: str) -> list[Backup]:
        """A shard's base backups, oldest first (read from the data directory: no cluster needs to
        run)."""
        folder = self.backups_dir(shard_id)
        if not folder.is_dir():
            return []
        found = [
            Backup.from_json(json.loads(record.read_text(encoding="utf-8")))
            for record in folder.glob("*.json")
            if record.name != _RESTORE_POINTS
        ]
        return sorted((b for b in found if b.path.is_dir()), key=lambda b: b.finished_at)

    def prune_backups(self, shard_id: str, keep: int = 1) -> list[Backup]:
        """Delete all but the newest `keep` base backups of a shard, and the archived WAL before
        the oldest one kept (the archive is otherwise never trimmed); the backups deleted."""
        if keep < 1:
            raise ValueError("keep at least one base backup")
        backups = self.backups(shard_id)
        dropped, kept = backups[:-keep], backups[-keep:]
        for backup in dropped:
            shutil.rmtree(backup.path, ignore_errors=True)
            backup.path.with_name(f"{backup.label}.json").unlink(missing_ok=True)
        if kept and self.archive_dir(shard_id).is_dir():
            oldest = min(kept, key=lambda b: pitr.lsn_value(b.start_lsn))
            pitr.prune_archive(self.archive_dir(shard_id), oldest.start_lsn, oldest.timeline)
        return dropped

    def restore_point(self, shard_id: str, name: str) -> RestorePoint:
        """Make a named restore point in a shard's WAL (`pg_create_restore_point`) and record it.

        A restore to a name stops at the first point of that name in the history it replays:
        give each point its own name (a second one of the same name is refused here)."""
        with self._changing:
            server = self._running_server(shard_id)
            if any(p.name == name for p in self.restore_points(shard_id)):
                raise ValueError(f"{shard_id} has a restore point named {name!r} already")
            lsn, created_at, timeline = pitr.create_restore_point(server, name)
            point = RestorePoint(
                shard_id=shard_id, name=name, lsn=lsn, created_at=created_at, timeline=timeline
            )
            folder = self.backups_dir(shard_id)
            folder.mkdir(parents=True, exist_ok=True)
            pitr.write_json(
                folder / _RESTORE_POINTS,
                [p.to_json() for p in [*self.restore_points(shard_id), point]],
            )
        return point

    def restore_points(self, shard_id: str) -> list[RestorePoint]:
        """The restore points `restore_point` made on a shard, oldest first."""
        record = self.backups_dir(shard_id) / _RESTORE_POINTS
        if not record.exists():
            return []
        return [RestorePoint.from_json(raw) for raw in json.loads(record.read_text(encoding="utf-8"))]

    def restore_shard(
        self,
        shard_id: str,
        backup: Backup | None = None,
        *,
        target_name: str | None = None,
        target_time: datetime | None = None,
        timeout_s: float = 120.0,
    ) -> RestoredShard:
        """Restore one shard's database to a point in time, the other shards untouched.

        Exactly one target: `target_name`, a restore point (`restore_point`), or `target_time`
        (timezone-aware; every commit up to and including it is kept). `backup` defaults to the
        newest base backup that ends before the target. The shard's daemons are stopped, its
        PostgreSQL stopped, its data directory replaced with the backup, the WAL archive replayed
        to the target (`recovery_target_action = 'promote'`), and the daemons started again once
        it accepts writes. With `standby` the standby is made afresh from the restored primary.

        The restored shard has forgotten everything after the target: its debits, its outbox, its
        idempotency records (a retry of a key acknowledged after the target applies again) and the
        credits it received, while the other shards keep theirs: what `shard-router reconcile`
        finds and repairs. ValueError (nothing stopped) for a bad target or no fitting backup;
        pitr.RestoreError when PostgreSQL could not reach the target: the shard then runs again
        on the data it had.
        """
        started = time.monotonic()
        if (target_name is None) == (target_time is None):
            raise ValueError("restore to exactly one target: target_name or target_time")
        if target_time is not None and target_time.tzinfo is None:
            raise ValueError("target_time needs a time zone (datetime.now(UTC), say)")
        with self._changing:
            server = self._running_server(shard_id)
            db = self.databases[self.shard_ids.index(shard_id)]
            if isinstance(db, ReplicatedPostgres) and db.promoted:
                raise ValueError(
                    f"{shard_id}'s standby was promoted: restoring after a failover is not supported"
                )
            # Only what lies on the history the shard lives on now can be restored to: an earlier
            # restore left the rest on an abandoned branch.
            timeline = pitr.current_timeline(server)
            history = pitr.timeline_history(self.archive_dir(shard_id), timeline, server.data_dir / "pg_wal")
            point = next((p for p in self.restore_points(shard_id) if p.name == target_name), None)
            if point is not None and not pitr.on_history(point.timeline, point.lsn, timeline, history):
                raise ValueError(
                    f"restore point {point.name!r} is on a history {shard_id} left when it was restored"
                )
            backup = backup or self._backup_before(shard_id, target_time, point, timeline, history)
            if backup.shard_id != shard_id:
                raise ValueError(f"backup {backup.label} is of {backup.shard_id}, not {shard_id}")
            if not pitr.on_history(backup.timeline, backup.end_lsn, timeline, history):
                raise ValueError(
                    f"backup {backup.label} is on a history {shard_id} left when it was restored"
                )
            if target_time is not None and target_time < backup.finished_at:
                raise ValueError(
                    f"{target_time.isoformat()} is before backup {backup.label} was complete"
                    f" ({backup.finished_at.isoformat()})"
                )
            if point is not None and pitr.lsn_value(point.lsn) < pitr.lsn_value(backup.end_lsn):
                raise ValueError(f"restore point {point.name!r} is older than backup {backup.label}")
            if target_time is not None:
                pitr.end_with_a_commit_after(server, target_time)
            daemons = self.daemons_of(shard_id)
            for daemon in daemons:
                daemon.stop()
            try:
                if isinstance(db, ReplicatedPostgres):
                    db.standby.stop("fast")
                    try:
                        restored = pitr.restore(
                            db.primary,
                            backup.path,
                            target_name=target_name,
                            target_time=target_time,
                            timeout_s=timeout_s,
                        )
                    except pitr.RestoreError:
                        db.standby.start()
                        raise
                    db.rebuild_standby()
                else:
                    restored = pitr.restore(
                        db, backup.path, target_name=target_name, target_time=target_time, timeout_s=timeout_s
                    )
            finally:
                for daemon in daemons:
                    daemon.start()
        result = RestoredShard(
            shard_id=shard_id,
            backup=backup,
            target_name=target_name,
            target_time=target_time,
            timeline=restored.timeline,
            lsn=restored.lsn,
            seconds=round(time.monotonic() - started, 1),
        )
        log.info("restored %s: %s", shard_id, result)
        return result

    def shard_dsn(self, shard_id: str, database: str = "shardd") -> str:
        """The connection string of a shard's database (with `standby`, naming both servers)."""
        if shard_id not in self.shard_ids:
            raise ValueError(f"no shard {shard_id!r} (shards: {', '.join(self.shard_ids)})")
        return self.databases[self.shard_ids.index(shard_id)].dsn_for(database)

    def _running_server(self, shard_id: str) -> LocalPostgres:
        """The server of a shard of the running cluster that accepts writes (ValueError: no such
        shard; RuntimeError: not running)."""
        if self.router is None or self._stopping:
            raise RuntimeError("the cluster is not running")
        if shard_id not in self.shard_ids:
            raise ValueError(f"no shard {shard_id!r} (shards: {', '.join(self.shard_ids)})")
        db = self.databases[self.shard_ids.index(shard_id)]
        return db.current_primary if isinstance(db, ReplicatedPostgres) else db

    def _backup_before(
        self,
        shard_id: str,
        target_time: datetime | None,
        point: RestorePoint | None,
        timeline: int,
        history: dict[int, int],
    ) -> Backup:
        """The newest base backup on the shard's current history a restore to the target can start
        from."""
        candidates = [
            b for b in self.backups(shard_id) if pitr.on_history(b.timeline, b.end_lsn, timeline, history)
        ]
        if target_time is not None:
            candidates = [b for b in candidates if b.finished_at <= target_time]
        if point is not None:
            candidates = [b for b in candidates if pitr.lsn_value(b.end_lsn) <= pitr.lsn_value(point.lsn)]
        if not candidates:
            raise ValueError(
                f"{shard_id} has no base backup before the target; take one with backup_shard "
                "(`shard-router dev backup`) before the point to restore to"
            )
        return candidates[-1]

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
    "Backup",
    "Daemon",
    "LocalCluster",
    "RestorePoint",
    "RestoredShard",
    "default_data_dir",
    "installed_command",
]
