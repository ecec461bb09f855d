"""`shardd serve --processes 2`: two serving processes share one port, both take calls, one killed
with SIGKILL is started again while the other keeps answering, and SIGTERM stops them all."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import grpc
import psycopg
import pytest

from shardrouter.client import load_service_config
from shardrouter.core.keys import new_key
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.channels import CHANNEL_OPTIONS
from shardrouter.shardd.processes import PARENT_PID_ENV, port_is_free, stop_with_parent
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import money
from tests.metrics import scrape
from tests.processes import ServiceProcess, shardd_process


def _metric(port: int, name: str) -> float:
    return sum(scrape(port, name).values())


def _deposits(address: str, connections: int, each: int) -> list[str]:
    """`each` Deposits on each of `connections` separate connections, retried as the published
    service config retries (UNAVAILABLE, ABORTED) with the same key, over channels that reconnect as
    the router's do (a connection the killed process had accepted is reset: the retry needs a new
    one before its attempts run out); the errors that remain."""
    errors: list[str] = []
    options = [
        *CHANNEL_OPTIONS,
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.service_config", load_service_config()),
        ("grpc.enable_retries", 1),
    ]
    for n in range(connections):
        with grpc.insecure_channel(address, options=options) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            for i in range(each):
                try:
                    stub.Deposit(
                        transfer_pb2.DepositRequest(account_id=f"p-{n}-{i}", amount=money(1)),
                        metadata=[("idempotency-key", str(new_key()))],
                        timeout=10,
                    )
                except grpc.RpcError as err:
                    errors.append(f"{err.code().name}: {err.details()}")
    return errors


def _children(parent_pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid:
                found.append(int(entry.name))
    return found


def _free_port_pair() -> int:
    """A free port whose next one is free too: process i serves /metrics on the first plus i."""
    for _ in range(100):
        port = free_port()
        if port_is_free(f"127.0.0.1:{port + 1}"):
            return port
    raise AssertionError("no two free ports in a row")


def test_two_serving_processes_share_a_port_and_survive_a_kill(database: str, tmp_path: Path) -> None:
    metrics = _free_port_pair()
    process: ServiceProcess = shardd_process(
        tmp_path,
        shard_id="shard-0",
        dsn=database,
        extra_env={"SHARDD_PROCESSES": "2", "SHARDD_METRICS_PORT": str(metrics), "SHARDD_LOG_FORMAT": "json"},
    )
    process.start()
    try:
        deadline = time.monotonic() + 30
        children = _serving_processes(process, 2, timeout_s=30)
        assert len(children) == 2, process.log_text()
        assert not port_is_free(process.address)

        # Each says so once it serves calls and /metrics ("(process i of 2)"; the parent's own
        # "started serving process i of 2" comes before that, so it must not match).
        def serving() -> bool:
            return all(f"(process {i} of 2)" in process.log_text() for i in (1, 2))

        while time.monotonic() < deadline and not serving():
            time.sleep(0.1)
        assert serving(), process.log_text()

        assert _deposits(process.address, connections=12, each=3) == []
        served = [_metric(metrics + i, "shardd_requests_total") for i in range(2)]
        assert sum(served) == 36 and all(s > 0 for s in served), f"calls per process: {served}"

        # SIGKILL one serving process: the other keeps answering and the parent starts it again.
        os.kill(children[0], 9)  # a call it had accepted is lost with it; the retry finds the other
        assert _deposits(process.address, connections=4, each=2) == []
        while time.monotonic() < deadline + 30 and "starting it again" not in process.log_text():
            time.sleep(0.1)
        assert "starting it again" in process.log_text()
        _serving_processes(process, 2, timeout_s=30)
        assert _deposits(process.address, connections=6, each=1) == []
        with psycopg.connect(database) as conn:
            row = conn.execute(
                "SELECT count(*), count(DISTINCT idempotency_key) FROM ledger_entries"
            ).fetchone()
        assert row == (50, 50), "every acknowledged deposit is there exactly once"

        survivors = _children(process.proc.pid)  # type: ignore[union-attr]
        assert len(survivors) == 2
        assert process.terminate(timeout_s=30) == 0
        assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in survivors)
        lines = [json.loads(line) for line in process.log_text().splitlines() if line.startswith("{")]
        assert any("stopped 2 serving processes" in line.get("msg", "") for line in lines)
    finally:
        process.kill()


def test_serving_processes_stop_when_their_parent_is_killed(database: str, tmp_path: Path) -> None:
    """SIGKILL of the parent (an OOM kill, say): its serving processes stop by themselves."""
    process = shardd_process(tmp_path, shard_id="shard-0", dsn=database, extra_env={"SHARDD_PROCESSES": "2"})
    process.start()
    try:
        children = _serving_processes(process, 2, timeout_s=30)
        assert len(children) == 2
    finally:
        process.kill()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(
        Path(f"/proc/{pid}").exists() and not _zombie(pid) for pid in children
    ):
        time.sleep(0.1)
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
    for pid in alive:  # leave nothing behind, whatever the outcome
        os.kill(pid, 9)
    assert not alive, "serving processes outlived their killed parent"
    assert port_is_free(process.address)


def _serving_processes(process: ServiceProcess, count: int, timeout_s: float) -> list[int]:
    """The parent's child processes, once there are `count` of them (or what there is at the time-out)."""
    assert process.proc is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(_children(process.proc.pid)) < count:
        time.sleep(0.1)
    return _children(process.proc.pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_processes_need_a_fixed_port(database: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.processes import ROOT

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardrouter.shardd.cli",
            "serve",
            "--processes",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--dsn",
            database,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "needs a fixed --listen port" in result.stderr


@pytest.mark.parametrize("listen", ["127.0.0.1:{port}"])
def test_port_is_free_sees_a_listener(listen: str) -> None:
    port = free_port()
    address = listen.format(port=port)
    assert port_is_free(address)
    import socket

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert not port_is_free(address)


def test_a_serving_process_whose_named_parent_is_not_its_parent_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A serving process handed to init before it watched (its parent killed while starting it) still
    stops: it checks its parent against the pid its parent put in its environment."""
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getpid()))  # never our own parent
    stop = threading.Event()
    stop_with_parent(stop, poll_s=0.01).join(5)
    assert stop.is_set()


def test_a_serving_process_whose_named_parent_lives_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid()))
    stop = threading.Event()
    watcher = stop_with_parent(stop, poll_s=0.01)
    assert not stop.wait(0.2)  # twenty polls, the parent still there
    stop.set()
    watcher.join(5)
