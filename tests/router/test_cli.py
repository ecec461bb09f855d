"""The `router` command: start-up errors, argument handling, and shutdown on SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from shardrouter.router.cli import main
from shardrouter.v1 import transfer_pb2
from tests.processes import ROOT, router_process
from tests.router.fakeshard import SeenCall, single_shard_map, start_fake_shard

SERVICE = "/shardrouter.v1.TransferService/"


def test_usage_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "router COMMAND" in capsys.readouterr().out
    assert main([]) == 2
    # A flag's value is not a command word: "--shard-map serve" must not read as the serve command.
    assert main(["--shard-map", "serve", "frobnicate"]) == 2
    assert "router COMMAND" in capsys.readouterr().err


def _run_router(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ROUTER_DEV_MODE": "true",
        "ROUTER_METRICS_PORT": "0",
        **(env_extra or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "shardrouter.router.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read"),
        ("shards: []\n", "'shards' must be a non-empty list"),
        (
            "slots: 4\nshards:\n  - {id: a, address: 'h:1', slot_ranges: [[0, 2]]}\n",
            "slots 3..3 are owned by no shard",
        ),
    ],
)
def test_bad_shard_map_at_start_is_a_clear_error(tmp_path: Path, content: str | None, problem: str) -> None:
    path = tmp_path / "bad-map.yaml"
    if content is not None:
        path.write_text(content)
    result = _run_router(["--shard-map", str(path), "--listen", "127.0.0.1:0", "serve"])
    assert result.returncode == 2
    assert str(path) in result.stderr
    assert problem in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_setting_at_start_is_a_clear_error() -> None:
    result = _run_router(["serve"], {"ROUTER_MAX_CALLS": "none"})
    assert result.returncode == 2
    assert "ROUTER_MAX_CALLS" in result.stderr and "Traceback" not in result.stderr


def test_sigterm_lets_in_flight_calls_finish_and_exits_zero(tmp_path: Path) -> None:
    slow = start_fake_shard()
    try:

        def take_a_second(call: SeenCall, context: grpc.ServicerContext) -> bytes:
            time.sleep(1.0)
            return call.request

        slow.reset(take_a_second)
        map_path = tmp_path / "map.json"
        map_path.write_text(json.dumps(single_shard_map(slow.address)))
        router = router_process(tmp_path, shard_map=map_path, extra_env={"ROUTER_SHUTDOWN_GRACE_S": "5"})
        router.start()
        request = transfer_pb2.GetBalanceRequest(account_id="acct-1").SerializeToString()
        with grpc.insecure_channel(router.address) as channel, futures.ThreadPoolExecutor(1) as pool:
            call = channel.unary_unary(
                SERVICE + "GetBalance", request_serializer=None, response_deserializer=None
            )
            pending = pool.submit(call, request, timeout=10)
            deadline = time.monotonic() + 5
            while not slow.calls and time.monotonic() < deadline:
                time.sleep(0.01)
            assert slow.calls
            started = time.monotonic()
            code = router.terminate(timeout_s=10)
            elapsed = time.monotonic() - started
            assert pending.result(timeout=5) == request  # the in-flight call completed
        assert code == 0
        assert elapsed < 5
        assert '"received SIGTERM' in router.log_text()
    finally:
        slow.stop()


def test_unreadable_tls_file_at_start_is_a_clear_error(tmp_path: Path) -> None:
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(single_shard_map("127.0.0.1:1")))
    missing = tmp_path / "nope.crt"
    result = _run_router(
        ["serve", "--listen", "127.0.0.1:0"],
        {"ROUTER_SHARD_MAP": str(map_path), "ROUTER_TLS_CERT": str(missing), "ROUTER_TLS_KEY": str(missing)},
    )
    assert result.returncode == 2
    assert str(missing) in result.stderr and "Traceback" not in result.stderr


def test_port_in_use_is_refused_not_shared(tmp_path: Path) -> None:
    taken = start_fake_shard()
    try:
        map_path = tmp_path / "map.json"
        map_path.write_text(json.dumps(single_shard_map("127.0.0.1:1")))
        result = _run_router(["serve", "--listen", taken.address, "--shard-map", str(map_path)])
        assert result.returncode != 0
        assert "cannot listen on" in result.stderr
    finally:
        taken.stop()
