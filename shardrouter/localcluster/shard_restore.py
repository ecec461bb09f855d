"""Point-in-time restore of one shard of a running local cluster: its base backups, its named
restore points and the restore itself, which stops the shard's daemons around the server-level
steps of `pitr` and starts them again. `shard-router dev backup|restore-point|restore|backups` and
the tests use it (docs/local-cluster-restore.md).

Where things are kept, in the cluster's data directory: a shard's WAL archive in
`wal-archive/SHARD/` (the cluster starts its PostgreSQL archiving there, `LocalCluster.archive_dir`),
its base backups (a folder and a `.json` record each) and its restore points
(`restore-points.json`) in `backups/SHARD/`. Reading them needs no running cluster.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from shardrouter.localcluster import pitr
from shardrouter.localcluster.cluster import LocalCluster
from shardrouter.localcluster.pitr import Backup, RestorePoint
from shardrouter.localcluster.postgres import LocalPostgres, ReplicatedPostgres

log = logging.getLogger(__name__)

#: The record of a shard's restore points, in its backups folder.
_RESTORE_POINTS = "restore-points.json"


@dataclass(frozen=True)
class RestoredShard:
    """A shard `ShardRestores.restore_shard` put back to a point in time; its daemons serve again."""

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


@dataclass(frozen=True)
class _History:
    """The history a shard's server lives on now: its timeline and its ancestors' switch points.
    Only what lies on it can be restored to: an earlier restore left the rest on an abandoned branch."""

    timeline: int
    switches: dict[int, int]

    def holds(self, timeline: int, lsn: str) -> bool:
        return pitr.on_history(timeline, lsn, self.timeline, self.switches)


class ShardRestores:
    """Base backups, restore points and point-in-time restores of the shards of one `LocalCluster`
    (of a running one for what touches a server; `backups`, `restore_points` and `prune_backups`
    read and trim the data directory alone)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def backups_dir(self, shard_id: str) -> Path:
        """Where a shard's base backups (a folder and a `.json` record each) and the record of its
        restore points (`restore-points.json`) are kept."""
        return self.cluster.data_dir / "backups" / shard_id

    def backup_shard(self, shard_id: str) -> Backup:
        """Take a base backup of a shard's running PostgreSQL (`pg_basebackup`, plain format, fast
        checkpoint) into `backups_dir(shard_id)`; the daemons keep serving meanwhile."""
        with self.cluster.holding(shard_id) as db:
            started_at = datetime.now(UTC)
            label = started_at.strftime("%Y%m%dT%H%M%S.%fZ")
            path = self.backups_dir(shard_id) / label
            start_lsn, end_lsn, timeline = pitr.base_backup(
                _writable(db), path, f"shard-router {shard_id} {label}"
            )
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
        archive = self.cluster.archive_dir(shard_id)
        if kept and archive.is_dir():
            oldest = min(kept, key=lambda b: pitr.lsn_value(b.start_lsn))
            pitr.prune_archive(archive, oldest.start_lsn, oldest.timeline)
        return dropped

    def restore_point(self, shard_id: str, name: str) -> RestorePoint:
        """Make a named restore point in a shard's WAL (`pg_create_restore_point`) and record it.

        A restore to a name stops at the first point of that name in the history it replays:
        give each point its own name (a second one of the same name is refused here)."""
        with self.cluster.holding(shard_id) as db:
            if any(p.name == name for p in self.restore_points(shard_id)):
                raise ValueError(f"{shard_id} has a restore point named {name!r} already")
            lsn, created_at, timeline = pitr.create_restore_point(_writable(db), name)
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
        with self.cluster.holding(shard_id) as db:
            if isinstance(db, ReplicatedPostgres) and db.promoted:
                raise ValueError(
                    f"{shard_id}'s standby was promoted: restoring after a failover is not supported"
                )
            server = _writable(db)
            backup = self._backup_for(shard_id, server, backup, target_name, target_time)
            if target_time is not None:
                pitr.end_with_a_commit_after(server, target_time)
            daemons = self.cluster.daemons_of(shard_id)
            for daemon in daemons:
                daemon.stop()
            try:
                restored = _restore_database(
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

    def _backup_for(
        self,
        shard_id: str,
        server: LocalPostgres,
        backup: Backup | None,
        target_name: str | None,
        target_time: datetime | None,
    ) -> Backup:
        """The base backup to restore from (the one given, checked, else the newest that fits), on
        the history the shard lives on now; ValueError when the target cannot be reached from it."""
        timeline = pitr.current_timeline(server)
        history = _History(
            timeline,
            pitr.timeline_history(self.cluster.archive_dir(shard_id), timeline, server.data_dir / "pg_wal"),
        )
        point = next((p for p in self.restore_points(shard_id) if p.name == target_name), None)
        if point is not None and not history.holds(point.timeline, point.lsn):
            raise ValueError(
                f"restore point {point.name!r} is on a history {shard_id} left when it was restored"
            )
        backup = backup or self._backup_before(shard_id, target_time, point, history)
        if backup.shard_id != shard_id:
            raise ValueError(f"backup {backup.label} is of {backup.shard_id}, not {shard_id}")
        if not history.holds(backup.timeline, backup.end_lsn):
            raise ValueError(f"backup {backup.label} is on a history {shard_id} left when it was restored")
        if target_time is not None and target_time < backup.finished_at:
            raise ValueError(
                f"{target_time.isoformat()} is before backup {backup.label} was complete"
                f" ({backup.finished_at.isoformat()})"
            )
        if point is not None and pitr.lsn_value(point.lsn) < pitr.lsn_value(backup.end_lsn):
            raise ValueError(f"restore point {point.name!r} is older than backup {backup.label}")
        return backup

    def _backup_before(
        self, shard_id: str, target_time: datetime | None, point: RestorePoint | None, history: _History
    ) -> Backup:
        """The newest base backup on the shard's current history a restore to the target can start
        from."""
        candidates = [b for b in self.backups(shard_id) if history.holds(b.timeline, b.end_lsn)]
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


def _writable(db: LocalPostgres | ReplicatedPostgres) -> LocalPostgres:
    """The server of a shard that accepts writes."""
    return db.current_primary if isinstance(db, ReplicatedPostgres) else db


def _restore_database(
    db: LocalPostgres | ReplicatedPostgres,
    backup_path: Path,
    *,
    target_name: str | None,
    target_time: datetime | None,
    timeout_s: float,
) -> pitr.RestoredServer:
    """`pitr.restore` of a shard's server; with a standby, the standby is stopped first and made
    afresh from the restored primary (or started again on the old data when the restore failed)."""
    if not isinstance(db, ReplicatedPostgres):
        return pitr.restore(
            db, backup_path, target_name=target_name, target_time=target_time, timeout_s=timeout_s
        )
    db.standby.stop("fast")
    try:
        restored = pitr.restore(
            db.primary, backup_path, target_name=target_name, target_time=target_time, timeout_s=timeout_s
        )
    except pitr.RestoreError:
        db.standby.start()
        raise
    db.rebuild_standby()
    return restored


__all__ = ["RestoredShard", "ShardRestores"]
