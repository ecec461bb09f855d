"""Point-in-time restore of one local PostgreSQL server with PostgreSQL's own tools: a base backup
(`pg_basebackup`, plain format) plus the WAL archive the server writes (`archive_mode = on`, see
`LocalPostgres.archive_dir`), replayed up to a named restore point (`pg_create_restore_point`) or
a time, then promoted.

The cluster-level API (`ShardRestores` in `shard_restore.py`: `backup_shard`, `restore_point`,
`restore_shard`) stops and restarts a shard's daemons around these; this module knows only the
server.

Restoring, as PostgreSQL's manual describes it: the server is stopped cleanly; its data directory
is set aside (not deleted until the restore has succeeded: a failed restore puts it back and starts
it again); the base backup is copied in its place; the WAL segments the old server had not archived
yet (the current segment at least) are copied from its `pg_wal` into the new one, where recovery
finds what the archive lacks; `restore_command`, the target and `recovery_target_action = 'promote'`
go into `postgresql.auto.conf` with a `recovery.signal`. Once the server has replayed to the target
and promoted itself (a new timeline, archived like the rest) the recovery settings are taken out
again, so a later base backup of it (a standby's, say) does not carry them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardrouter.localcluster.postgres import LocalPostgres, postgres_bin_path

#: A WAL segment file's name (timeline, log, segment: 24 hex digits) or a timeline history file.
_WAL_FILE = re.compile(r"[0-9A-F]{24}|[0-9A-F]{8}\.history")
#: An archived segment, a backup history file or a timeline's last partial segment.
_ARCHIVED_SEGMENT = re.compile(r"[0-9A-F]{24}(\.[0-9A-F]{8}\.backup|\.partial)?")
#: Settings a restore writes into postgresql.auto.conf and takes out again once promoted.
_RECOVERY_KEYS = (
    "restore_command",
    "recovery_target",
    "recovery_target_name",
    "recovery_target_time",
    "recovery_target_xid",
    "recovery_target_lsn",
    "recovery_target_action",
    "recovery_target_inclusive",
)
#: The suffix of a data directory set aside while a restore replaces it.
SET_ASIDE_SUFFIX = ".before-restore"


class RestoreError(RuntimeError):
    """A restore failed; the server runs again on the data it had before (the message says so)."""


def lsn_value(lsn: str) -> int:
    """A `pg_lsn` text ("16/B374D848") as a number, for comparing."""
    high, _, low = lsn.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclass(frozen=True)
class Backup:
    """A base backup of one shard's PostgreSQL (a plain-format copy of its data directory)."""

    shard_id: str
    #: Its name among the shard's backups (a UTC time stamp, sortable).
    label: str
    #: The folder holding the copy.
    path: Path
    #: When `pg_basebackup` started (UTC).
    started_at: datetime
    #: When the copy was complete (UTC): a restore can target any time from here on.
    finished_at: datetime
    #: Where its WAL starts and where replay makes it consistent.
    start_lsn: str
    end_lsn: str
    #: The timeline it was taken on.
    timeline: int

    def to_json(self) -> dict[str, Any]:
        """Its record, as written beside the copy."""
        return {
            "shard_id": self.shard_id,
            "label": self.label,
            "path": str(self.path),
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat(),
            "start_lsn": self.start_lsn,
            "end_lsn": self.end_lsn,
            "timeline": self.timeline,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Backup:
        """The record `to_json` wrote."""
        return cls(
            shard_id=str(raw["shard_id"]),
            label=str(raw["label"]),
            path=Path(raw["path"]),
            started_at=datetime.fromisoformat(raw["started_at"]),
            finished_at=datetime.fromisoformat(raw["finished_at"]),
            start_lsn=str(raw["start_lsn"]),
            end_lsn=str(raw["end_lsn"]),
            timeline=int(raw["timeline"]),
        )


@dataclass(frozen=True)
class RestorePoint:
    """A named restore point (`pg_create_restore_point`) in one shard's WAL."""

    shard_id: str
    name: str
    #: Where it is in the WAL.
    lsn: str
    #: The server's clock when it was made (UTC).
    created_at: datetime
    #: The timeline it was made on.
    timeline: int = 1

    def to_json(self) -> dict[str, Any]:
        """Its record, as kept in the shard's list of restore points."""
        return {
            "shard_id": self.shard_id,
            "name": self.name,
            "lsn": self.lsn,
            "created_at": self.created_at.isoformat(),
            "timeline": self.timeline,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RestorePoint:
        """The record `to_json` wrote."""
        return cls(
            shard_id=str(raw["shard_id"]),
            name=str(raw["name"]),
            lsn=str(raw["lsn"]),
            created_at=datetime.fromisoformat(raw["created_at"]),
            timeline=int(raw.get("timeline", 1)),
        )


@dataclass(frozen=True)
class RestoredServer:
    """What replaying a base backup to its target gave."""

    #: The timeline the promoted server writes on (one above the one it replayed).
    timeline: int
    #: Where its WAL was when it accepted writes again.
    lsn: str


def base_backup(server: LocalPostgres, dest: Path, label: str) -> tuple[str, str, int]:
    """`pg_basebackup` of the running `server` into the new folder `dest` (plain format, with the
    WAL it needs streamed in, a fast checkpoint); (start LSN, end LSN, timeline)."""
    if dest.exists():
        raise FileExistsError(f"a backup folder {dest} exists already")
    if server.archive_dir is not None:
        server.enable_archive()  # before the backup starts: its WAL on is kept
    dest.mkdir(parents=True)
    server._own(dest)  # the server's user writes it; the folders above traversable
    os.chmod(dest, 0o700)
    server._run(
        [
            str(postgres_bin_path() / "pg_basebackup"),
            "-D",
            str(dest),
            "-h",
            "127.0.0.1",
            "-p",
            str(server.port),
            "-U",
            "postgres",
            "-X",
            "stream",
            "-c",
            "fast",
            "-l",
            label,
            "--no-sync",
        ]
    )
    # The copy's server.log is the source's (pg_ctl writes it into the data directory).
    (dest / "server.log").unlink(missing_ok=True)
    backup_label = (dest / "backup_label").read_text()
    start = re.search(r"^START WAL LOCATION: ([0-9A-F]+/[0-9A-F]+)", backup_label, re.MULTILINE)
    timeline = re.search(r"^START TIMELINE: (\d+)", backup_label, re.MULTILINE)
    if start is None or timeline is None:
        raise RuntimeError(f"{dest}/backup_label has no start location or timeline:\n{backup_label}")
    end = start[1]
    manifest = dest / "backup_manifest"
    if manifest.exists():
        ranges = json.loads(manifest.read_text()).get("WAL-Ranges", [])
        if ranges:
            end = str(ranges[-1]["End-LSN"])
    return start[1], end, int(timeline[1])


def create_restore_point(server: LocalPostgres, name: str) -> tuple[str, datetime, int]:
    """`pg_create_restore_point(name)` on the running server: (its LSN, the server's clock, the
    timeline)."""
    import psycopg

    if not name or len(name) >= 64:
        raise ValueError("a restore point's name has 1 to 63 characters")
    with psycopg.connect(server.dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT pg_create_restore_point(%s)::text, clock_timestamp(),"
            " pg_walfile_name(pg_current_wal_lsn())",
            (name,),
        ).fetchone()
    assert row is not None
    return str(row[0]), row[1].astimezone(UTC), int(str(row[2])[:8], 16)


def end_with_a_commit_after(server: LocalPostgres, target_time: datetime) -> None:
    """Commit an empty transaction (an xid, so a commit record) on the running server, after
    checking that `target_time` has passed by its clock (ValueError otherwise).

    Replay to a time stops at the first commit after it; where none follows the target in the
    WAL, PostgreSQL ends recovery with "recovery ended before configured recovery target was
    reached" instead of keeping everything. This commit is that first one after the target."""
    import psycopg

    with psycopg.connect(server.dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        if row[0] <= target_time:
            raise ValueError(
                f"the target time {target_time.isoformat()} has not passed yet (the server's clock: "
                f"{row[0].astimezone(UTC).isoformat()})"
            )
        conn.execute("SELECT pg_current_xact_id()")


def current_timeline(server: LocalPostgres) -> int:
    """The timeline the running (primary) server writes on."""
    import psycopg

    with psycopg.connect(server.dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone()
    assert row is not None
    return int(str(row[0])[:8], 16)


def timeline_history(archive_dir: Path, timeline: int, pg_wal: Path | None = None) -> dict[int, int]:
    """Each ancestor timeline of `timeline` -> the LSN (as a number) where its history left it,
    read from its `0000000N.history` in the archive, else in the server's `pg_wal` (the archiver
    may not have copied it yet); none for timeline 1, or when neither has the file."""
    if timeline <= 1:
        return {}
    name = f"{timeline:08X}.history"
    found = [d / name for d in (archive_dir, pg_wal) if d is not None and (d / name).is_file()]
    if not found:
        return {}
    switches: dict[int, int] = {}
    for line in found[0].read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit():
            switches[int(fields[0])] = lsn_value(fields[1])
    return switches


def on_history(timeline: int, lsn: str, current: int, history: dict[int, int]) -> bool:
    """Whether WAL position `lsn` of `timeline` lies on the history of timeline `current` (whose
    ancestors' switch points are `history`): a backup or restore point after the place a restore
    left its timeline is on an abandoned branch, which a restore cannot reach."""
    if timeline == current:
        return True
    switch = history.get(timeline)
    return switch is not None and lsn_value(lsn) <= switch


def restore(
    server: LocalPostgres,
    backup_path: Path,
    *,
    target_name: str | None = None,
    target_time: datetime | None = None,
    timeout_s: float = 120.0,
) -> RestoredServer:
    """Replace `server`'s data with the base backup at `backup_path` and replay its WAL archive up
    to the target (exactly one of a restore point's name or a time), then promote.

    The server is stopped first (cleanly) and runs afterwards, on the restored data or, when the
    restore fails (RestoreError), on the data it had. Whoever uses the server must be stopped by
    the caller, and is best started only once this returns.
    """
    if (target_name is None) == (target_time is None):
        raise ValueError("restore to exactly one target: a restore point's name or a time")
    if target_time is not None and target_time.tzinfo is None:
        raise ValueError("the target time needs a time zone (UTC, say)")
    if server.archive_dir is None:
        raise ValueError(f"the server of {server.data_dir} has no WAL archive")
    recovery = _recovery_settings(server.archive_dir, target_name, target_time)
    data = server.data_dir
    aside = data.with_name(data.name + SET_ASIDE_SUFFIX)
    server.stop("fast")
    _take_back_set_aside(data, aside)
    os.replace(data, aside)
    try:
        _lay_out_backup(server, backup_path, aside, recovery)
        server.start(timeout_s)
        restored = _wait_promoted(server, timeout_s)
    except BaseException as exc:
        log_tail = _tail(data / "server.log")
        _put_back(server, aside)
        if isinstance(exc, Exception):
            raise RestoreError(
                f"restoring {data} failed, it runs on its earlier data again: {exc}\n"
                f"the restore's server log ends:\n{log_tail}"
            ) from exc
        raise
    _set_recovery(data / "postgresql.auto.conf", {})
    shutil.rmtree(aside, ignore_errors=True)
    return restored


def _recovery_settings(
    archive_dir: Path, target_name: str | None, target_time: datetime | None
) -> dict[str, str]:
    """What `postgresql.auto.conf` says for a replay of `archive_dir` to the target, then promotion."""
    recovery = {
        "restore_command": f"cp {shlex.quote(str(archive_dir))}/%f %p",
        "recovery_target_action": "promote",
    }
    if target_name is not None:
        recovery["recovery_target_name"] = target_name
    else:
        assert target_time is not None
        recovery["recovery_target_time"] = target_time.astimezone(UTC).isoformat(sep=" ")
    return recovery


def _take_back_set_aside(data: Path, aside: Path) -> None:
    """Where a restore that was killed left data set aside, the set-aside data is the real one
    unless the data directory holds a complete, promoted server."""
    if not aside.exists():
        return
    if (data / "PG_VERSION").exists() and not (data / "recovery.signal").exists():
        shutil.rmtree(aside)
    else:
        shutil.rmtree(data, ignore_errors=True)
        os.replace(aside, data)


def _lay_out_backup(server: LocalPostgres, backup_path: Path, aside: Path, recovery: dict[str, str]) -> None:
    """The backup copied into the (moved away) data directory, with the old server's unarchived
    WAL, its log, the recovery settings and `recovery.signal`, owned by the server's user."""
    data = server.data_dir
    assert server.archive_dir is not None
    shutil.copytree(backup_path, data, symlinks=True)
    os.chmod(data, 0o700)
    (data / "backup_manifest").unlink(missing_ok=True)
    _carry_unarchived_wal(aside / "pg_wal", data / "pg_wal", server.archive_dir)
    with contextlib.suppress(FileNotFoundError):  # one log across restores
        os.replace(aside / "server.log", data / "server.log")
    _set_recovery(data / "postgresql.auto.conf", recovery)
    (data / "recovery.signal").touch()
    if server._user is not None:
        for path in [data, *data.rglob("*")]:
            os.lchown(path, server._user.pw_uid, server._user.pw_gid)


def _put_back(server: LocalPostgres, aside: Path) -> None:
    """After a failed restore: the server stopped, the set-aside data (with the log, which tells
    what went wrong) in its place again, and the server started on it."""
    data = server.data_dir
    server.stop("immediate")
    if (data / "server.log").exists() and not (aside / "server.log").exists():
        with contextlib.suppress(OSError):
            os.replace(data / "server.log", aside / "server.log")
    shutil.rmtree(data, ignore_errors=True)
    os.replace(aside, data)
    server.start()


def prune_archive(archive_dir: Path, oldest_start_lsn: str, timeline: int) -> int:
    """Delete the archived WAL segments (of every timeline) before the one where the oldest kept
    base backup starts; timeline history files stay. The number of files deleted."""
    keep_from = _segment_name(oldest_start_lsn, timeline)[8:]
    removed = 0
    for entry in archive_dir.iterdir():
        name = entry.name
        if _ARCHIVED_SEGMENT.fullmatch(name) and name[8:24] < keep_from:
            entry.unlink()
            removed += 1
    return removed


def _segment_name(lsn: str, timeline: int, segment_bytes: int = 16 * 1024 * 1024) -> str:
    """The WAL file holding `lsn` (default segment size, which the local cluster's servers use)."""
    number = lsn_value(lsn) // segment_bytes
    per_log = 0x1_0000_0000 // segment_bytes
    return f"{timeline:08X}{number // per_log:08X}{number % per_log:08X}"


def _carry_unarchived_wal(old: Path, new: Path, archive: Path) -> None:
    """Copy the old server's WAL files that the archive lacks into the restored `pg_wal` (its
    current segment at least), for recovery to read after the archive."""
    if not old.is_dir():
        return
    for entry in old.iterdir():
        if _WAL_FILE.fullmatch(entry.name) and entry.is_file() and not (archive / entry.name).exists():
            shutil.copy2(entry, new / entry.name)


def _set_recovery(auto_conf: Path, settings: dict[str, str]) -> None:
    """`postgresql.auto.conf` without any recovery setting, plus `settings`."""
    lines = auto_conf.read_text().splitlines() if auto_conf.exists() else []
    kept = [line for line in lines if line.split("=", 1)[0].strip() not in _RECOVERY_KEYS]
    added = [f"{key} = '{value.replace(chr(39), chr(39) * 2)}'" for key, value in settings.items()]
    auto_conf.write_text("\n".join([*kept, *added]) + "\n")


def _wait_promoted(server: LocalPostgres, timeout_s: float) -> RestoredServer:
    """Wait until the server has left recovery (reached its target and promoted)."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not (server.data_dir / "postmaster.pid").exists():
            raise RuntimeError("the server stopped during recovery")
        try:
            with psycopg.connect(server.dsn, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute(
                    "SELECT pg_is_in_recovery(), CASE WHEN pg_is_in_recovery() THEN NULL"
                    " ELSE pg_walfile_name(pg_current_wal_lsn()) END, CASE WHEN pg_is_in_recovery()"
                    " THEN NULL ELSE pg_current_wal_lsn()::text END"
                ).fetchone()
        except psycopg.OperationalError as exc:
            last = exc
        else:
            assert row is not None
            if not row[0]:
                return RestoredServer(timeline=int(str(row[1])[:8], 16), lsn=str(row[2]))
        time.sleep(0.05)
    raise TimeoutError(f"the server did not leave recovery within {timeout_s} s ({last})")


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


def write_json(path: Path, document: object) -> None:
    """Write a JSON file atomically (a reader sees the old or the new)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


__all__ = [
    "SET_ASIDE_SUFFIX",
    "Backup",
    "RestoreError",
    "RestorePoint",
    "RestoredServer",
    "base_backup",
    "create_restore_point",
    "current_timeline",
    "end_with_a_commit_after",
    "lsn_value",
    "on_history",
    "prune_archive",
    "restore",
    "timeline_history",
    "write_json",
]
