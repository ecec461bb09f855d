"""Real processes for end-to-end tests: shard daemons and routers started as `python -m ...`, and
the one way a test kills a process at a named failpoint (`shardrouter/core/failpoints.py`).

A kill at a failpoint: the process is started with the point armed, the test waits until the
process announces its pause there (`failpoint NAME: paused (pid PID)`), then SIGKILLs that pid and
checks it died of that signal, so the kill provably lands at the point. `run_to_failpoint` does it
for a command that runs to its end (reading its output pipe without blocking);
`ServiceProcess.wait_paused` and `kill_paused` for a daemon, whose output goes to its log file.
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardrouter.core import failpoints
from shardrouter.localcluster.postgres import free_port

ROOT = Path(__file__).resolve().parent.parent
#: A default the caller's environment overrides: grpc's C core logs only errors in the daemons too
#: (its INFO lines, a GOAWAY at every peer restart, are noise in the logs a failing test prints).
_QUIET_GRPC = {"GRPC_VERBOSITY": "ERROR"}


@dataclass
class ServiceProcess:
    """A daemon started as a subprocess, with its port and log file."""

    name: str
    args: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    #: Where the output of the latest start begins in the log file (a restart appends to it).
    log_offset: int = 0

    @property
    def address(self) -> str:
        """host:port of its gRPC server."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0, *, wait: bool = True) -> None:
        """Start and wait until gRPC health says SERVING (`wait=False`: do not wait; for a daemon
        started with a failpoint armed under load, whose worker threads may all be paused there
        before a health check gets one)."""
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(
                [sys.executable, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
            )
        if wait:
            wait_serving(self.address, timeout_s, self)

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, like a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait; the exit code."""
        if not self.proc:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode or 0)

    def restart(self) -> None:
        """Kill (if alive) and start again on the same port."""
        self.kill()
        self.start()

    def log_text(self) -> str:
        """Everything it printed."""
        return self.log_path.read_text(errors="replace")

    def arm(self, *points: str) -> None:
        """Arm failpoints (to pause) for the next start; with none, disarm them all."""
        if points:
            self.env[failpoints.ENV] = armed_value(*points)
        else:
            self.env.pop(failpoints.ENV, None)

    def wait_paused(self, point: str, timeout_s: float = 20.0) -> Paused:
        """Wait until this process, or one of its serving processes, announces its pause at `point`
        (in the log, since the latest start); the process keeps running meanwhile."""
        assert self.proc is not None, f"{self.name} was not started"
        tail = _FileTail(self.log_path, self.log_offset)
        return _await_pause(tail.read, point, timeout_s, self.proc.poll, self.name)

    def kill_paused(self, paused: Paused) -> Paused:
        """SIGKILL the process that announced `paused` and check that it died of it.

        Either this process, or one of its serving processes (`shardd serve --processes N`): a child
        of this one, whose end its parent reaps and logs (`... (pid N) ended with -9`); the parent
        starts it again, with the same failpoints armed.
        """
        assert self.proc is not None, f"{self.name} was not started"
        tail = _FileTail(self.log_path, self.log_offset)
        if paused.pid == self.proc.pid:
            self.proc.send_signal(signal.SIGKILL)
            code = self.proc.wait(10)
            assert code == -signal.SIGKILL, f"{self.name} ended with {code}, not by SIGKILL"
            return Paused(paused.point, paused.pid, paused.output, tail.read())
        assert _parent_of(paused.pid) == self.proc.pid, (
            f"pid {paused.pid} paused at {paused.point} is neither {self.name} nor one of its processes"
        )
        os.kill(paused.pid, signal.SIGKILL)
        ended = f"(pid {paused.pid}) ended with {-signal.SIGKILL}"
        deadline = time.monotonic() + 10
        text = ""
        while ended not in text:
            assert time.monotonic() < deadline, f"{self.name} never reported pid {paused.pid} ended:\n{text}"
            time.sleep(0.05)
            text += tail.read()
        return Paused(paused.point, paused.pid, paused.output, text)

    def kill_at_failpoint(self, point: str, timeout_s: float = 20.0) -> Paused:
        """`wait_paused`, then `kill_paused`: the kill lands at `point`."""
        return self.kill_paused(self.wait_paused(point, timeout_s))


#: The line a process paused at a failpoint writes to standard error (`shardrouter/core/failpoints.py`).
PAUSE_LINE = re.compile(r"^failpoint (?P<point>[A-Za-z0-9._-]+): paused \(pid (?P<pid>\d+)\)$", re.MULTILINE)


@dataclass(frozen=True)
class Paused:
    """A process that announced its pause at a failpoint (and, once killed, what it wrote after)."""

    point: str
    pid: int
    #: What the process wrote up to and including its announcement.
    output: str
    #: What it (or, for a daemon, its log) got after the announcement until the kill was confirmed.
    after: str = ""


def armed_value(*points: str) -> str:
    """The `SHARD_ROUTER_FAILPOINTS` value that arms `points` to pause."""
    return ",".join(f"{point}=pause" for point in points)


def run_to_failpoint(
    command: Sequence[str],
    point: str,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    while_paused: Callable[[Paused], object] | None = None,
) -> Paused:
    """Run `command` with `point` armed until it announces its pause there, call `while_paused`
    (the process still paused), then SIGKILL it and check that it died of that signal.

    Its standard output and error are read together, without blocking; a process that ends, or
    does not pause within `timeout_s`, fails the test with what it wrote.
    """
    environment = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    environment[failpoints.ENV] = armed_value(point)
    process = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, cwd=ROOT
    )
    assert process.stdout is not None
    pipe = _PipeTail(process.stdout.fileno())
    try:
        paused = _await_pause(pipe.read, point, timeout_s, process.poll, " ".join(command[:4]))
        assert paused.pid == process.pid, f"pid {paused.pid} paused, not the process started ({process.pid})"
        if while_paused is not None:
            while_paused(paused)
        process.send_signal(signal.SIGKILL)
        code = process.wait(10)
        after = pipe.read_to_end()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.stdout.close()
    assert code == -signal.SIGKILL, f"the process paused at {point} ended with {code}, not by SIGKILL"
    return Paused(paused.point, paused.pid, paused.output, after)


def _await_pause(
    read: Callable[[], str], point: str, timeout_s: float, ended: Callable[[], int | None], what: str
) -> Paused:
    """Read output until the announcement of a pause at `point`: that pause."""
    text = ""
    deadline = time.monotonic() + timeout_s
    while True:
        code = ended()  # looked at before the last read: a process that paused has said so by then
        text += read()
        for found in PAUSE_LINE.finditer(text):
            if found["point"] == point:
                return Paused(point, int(found["pid"]), text[: found.end()])
        if code is not None:
            raise AssertionError(f"{what} ended with {code} before failpoint {point}:\n{text[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not pause at {point} within {timeout_s} s:\n{text[-4000:]}")
        time.sleep(0.02)


class _PipeTail:
    """What a pipe has to give now, never waiting for more."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self) -> str:
        chunks = []
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return self._decoder.decode(b"".join(chunks))

    def read_to_end(self) -> str:
        """Everything until the writer closed the pipe (call once the process is gone)."""
        os.set_blocking(self._fd, True)
        chunks = []
        while chunk := os.read(self._fd, 65536):
            chunks.append(chunk)
        return self._decoder.decode(b"".join(chunks), final=True)


class _FileTail:
    """What a log file got since the last read (from `offset` on)."""

    def __init__(self, path: Path, offset: int) -> None:
        self._path = path
        self._offset = offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self) -> str:
        with self._path.open("rb") as log:
            log.seek(self._offset)
            data = log.read()
        self._offset += len(data)
        return self._decoder.decode(data)


def _parent_of(pid: int) -> int | None:
    """The parent pid of a live process, from /proc (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def wait_serving(address: str, timeout_s: float, process: ServiceProcess | None = None) -> None:
    """Poll gRPC health until SERVING, failing early if the process died."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process and process.proc and process.proc.poll() is not None:
                raise RuntimeError(
                    f"{process.name} exited with {process.proc.returncode}:\n{process.log_text()[-3000:]}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    tail = process.log_text()[-3000:] if process else ""
    raise TimeoutError(f"{address} not SERVING after {timeout_s} s\n{tail}")


def shardd_process(
    tmp: Path,
    *,
    shard_id: str,
    dsn: str,
    shard_map: Path | None = None,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> ServiceProcess:
    """A `shardd serve` process in dev mode (no TLS) on a free loopback port."""
    port = port or free_port()
    env = {
        **_QUIET_GRPC,
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SHARDD_SHARD_ID": shard_id,
        "SHARDD_DSN": dsn,
        "SHARDD_LISTEN": f"127.0.0.1:{port}",
        "SHARDD_METRICS_PORT": "0",
        "SHARDD_DEV_MODE": "true",
        "SHARDD_SHARD_MAP": str(shard_map or ""),
        "SHARDD_WORKERS": "8",
        "SHARDD_POOL_MAX": "8",
        "SHARDD_SHUTDOWN_GRACE_S": "2",
        **(extra_env or {}),
    }
    return ServiceProcess(
        shard_id, ["-m", "shardrouter.shardd.cli", "serve"], env, port, tmp / f"{shard_id}.log"
    )


def router_process(
    tmp: Path, *, shard_map: Path, port: int | None = None, extra_env: dict[str, str] | None = None
) -> ServiceProcess:
    """A `router serve` process in dev mode (no TLS) on a free loopback port."""
    port = port or free_port()
    env = {
        **_QUIET_GRPC,
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ROUTER_LISTEN": f"127.0.0.1:{port}",
        "ROUTER_METRICS_PORT": "0",
        "ROUTER_DEV_MODE": "true",
        "ROUTER_SHARD_MAP": str(shard_map),
        "ROUTER_MAX_CALLS": "256",
        "ROUTER_SHUTDOWN_GRACE_S": "2",
        "ROUTER_RELOAD_INTERVAL_S": "0.2",
        **(extra_env or {}),
    }
    log_path = tmp / f"router-{port}.log"
    return ServiceProcess(f"router-{port}", ["-m", "shardrouter.router.cli", "serve"], env, port, log_path)


def run_shardd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One `shardd` command to its end (an operator's: migrate, retention, keys, dead letters), with
    only the environment given."""
    return run_cli("shardd", *args, env=env)


def run_cli(program: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One command of `shardrouter.<program>.cli` to its end, with only the environment given."""
    return subprocess.run(
        [sys.executable, "-m", f"shardrouter.{program}.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **(env or {})},
        check=False,
    )
