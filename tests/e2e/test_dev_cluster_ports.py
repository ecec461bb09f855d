"""A second `shard-router dev up` beside a running one: it fails at once on the busy ports, with one
clear line, and never calls the first cluster; and a daemon whose port a stranger answers on is
refused even when that stranger reports healthy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import psycopg
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardrouter.core.grpcserver import server_options
from shardrouter.localcluster.cluster import Daemon, port_is_free, serves_port
from shardrouter.localcluster.postgres import free_port
from tests.e2e.test_dev_cluster import _dev_up, _until_running
from tests.helpers import pg_data_dir


def _one_shard_up(data_dir: Path, port: int, http_port: int, *extra: str) -> subprocess.Popen[str]:
    """`dev up` with one shard on the given router ports (flags given later win over `_dev_up`'s)."""
    return _dev_up(data_dir, port, "--http-port", str(http_port), "--shards", "1", "--no-metrics", *extra)


def _records(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM idempotency_record").fetchone()
    assert row is not None
    return int(row[0])


def test_second_dev_up_on_the_same_ports_fails_clearly_and_leaves_the_first_alone():
    first_dir = pg_data_dir().parent / "cluster"  # not under tmp_path: the PostgreSQL user must reach it
    second_dir = pg_data_dir().parent / "cluster"
    port, http_port = free_port(), free_port()
    first = _one_shard_up(first_dir, port, http_port, "--no-demo")
    try:
        lines = _until_running(first, timeout_s=150)
        dsn = next(line.split("database ", 1)[1].split()[0] for line in lines if "  shard-0: " in line)
        assert _records(dsn) == 0

        started = time.monotonic()
        second = _one_shard_up(second_dir, port, http_port, "--exit-after-demo")
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 1, out
        assert time.monotonic() - started < 20, out  # at once, not after starting PostgreSQL
        errors = [line for line in out.splitlines() if line.startswith("shard-router dev up:")]
        assert len(errors) == 1, out
        assert (
            f"port {port} (the router's gRPC port) is in use on 127.0.0.1: give another --port" in errors[0]
        )
        assert f"port {http_port} (the router's HTTP front)" in errors[0] and "--http-port" in errors[0]
        assert "Router listening" not in out and "deposit" not in out, out
        assert not (second_dir / "pg-shard-0").exists(), "nothing of the second cluster may start"
        # No call of the second demo reached the first cluster.
        assert _records(dsn) == 0
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        rest, _ = first.communicate(timeout=60)
    assert first.returncode == 0, rest


@pytest.fixture
def stranger():
    """A healthy gRPC server of this test process, on a port of its own, owning it (no SO_REUSEPORT)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(2),
        options=server_options(max_message_bytes=1 << 20, max_metadata_bytes=8192, max_streams=10),
    )
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def test_a_daemon_is_refused_when_a_stranger_answers_its_health_check(stranger, tmp_path):
    # The started process never binds: a healthy answer on its port comes from someone else.
    daemon = Daemon("router", ["sleep", "30"], dict(os.environ), stranger, tmp_path / "router.log")
    try:
        with pytest.raises(RuntimeError, match="not from the process this cluster started"):
            daemon.start(timeout_s=10)
    finally:
        daemon.stop()
    assert serves_port(os.getpid(), stranger) is True
    assert port_is_free(stranger) is False


def test_a_daemon_that_owns_its_port_is_accepted(tmp_path):
    port = free_port()
    serve = (
        "import grpc, sys;"
        "from concurrent import futures;"
        "from grpc_health.v1 import health, health_pb2, health_pb2_grpc;"
        "s = grpc.server(futures.ThreadPoolExecutor(2), options=[('grpc.so_reuseport', 0)]);"
        "h = health.HealthServicer(); h.set('', health_pb2.HealthCheckResponse.SERVING);"
        "health_pb2_grpc.add_HealthServicer_to_server(h, s);"
        f"s.add_insecure_port('127.0.0.1:{port}'); s.start(); s.wait_for_termination()"
    )
    daemon = Daemon("own", [sys.executable, "-c", serve], dict(os.environ), port, tmp_path / "own.log")
    try:
        daemon.start(timeout_s=30)
        assert daemon.proc is not None
        assert serves_port(daemon.proc.pid, port) is True
    finally:
        daemon.stop()
