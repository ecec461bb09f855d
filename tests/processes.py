"""Real processes for end-to-end tests: shard daemons and routers started as `python -m ...`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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

    @property
    def address(self) -> str:
        """host:port of its gRPC server."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start and wait until gRPC health says SERVING."""
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
            )
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
