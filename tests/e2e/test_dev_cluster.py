"""`shard-router dev up`: the local cluster as a new user runs it, with its demo, and a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrouter.localcluster.postgres import free_port
from tests.helpers import pg_data_dir, requires_tracing_ui
from tests.processes import ROOT


def _leftovers(data_dir: Path) -> list[str]:
    """Processes whose command line mentions the cluster's data directory (postgres, shardd, router)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = (
                (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
            environ = (Path("/proc") / pid / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(data_dir) in cmdline or str(data_dir) in environ:
            found.append(f"{pid}: {cmdline[:120]}")
    return found


def _wait_no_leftovers(data_dir: Path, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _leftovers(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _dev_up(data_dir: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardrouter.localcluster.command",
            "dev",
            "up",
            "--shards",
            "2",
            "--data-dir",
            str(data_dir),
            "--port",
            str(port),
            *(() if "--http-port" in extra else ("--http-port", str(free_port()))),
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_dev_up_runs_the_demo_and_stops_cleanly(tmp_path):
    data_dir = pg_data_dir().parent / "cluster"  # not under tmp_path: the PostgreSQL user must reach it
    proc = _dev_up(data_dir, free_port(), "--exit-after-demo")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    assert "identical bytes: True, trailer idempotency-replayed: 'true'" in out
    assert "applied 1," in out and "ABORTED" in out
    assert "after the relay: TRANSFER_STATE_COMPLETED" in out
    assert "Stopped." in out
    assert _wait_no_leftovers(data_dir) == []
    assert (data_dir / "shard-map.yaml").exists() and (data_dir / "pg-shard-0" / "PG_VERSION").exists()


def test_dev_up_stops_everything_on_sigterm_and_keeps_data(tmp_path):
    data_dir = pg_data_dir().parent / "cluster"  # not under tmp_path: the PostgreSQL user must reach it
    port = free_port()
    proc = _dev_up(data_dir, port, "--no-demo")
    _until_running(proc, timeout_s=120)
    balance = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardrouter.localcluster.command",
            "--target",
            f"127.0.0.1:{port}",
            "--store",
            str(tmp_path / "ops.db"),
            "deposit",
            "--account",
            "zoe",
            "--amount",
            "3.00",
            "--currency",
            "EUR",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert balance.returncode == 0, balance.stdout + balance.stderr
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "Stopped." in rest
    assert _wait_no_leftovers(data_dir) == []
    assert (data_dir / "pg-shard-0" / "PG_VERSION").exists(), "data must stay unless --wipe"


def _until_running(proc: subprocess.Popen[str], timeout_s: float = 180) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Cluster running" in line or not line:
            break
    assert any("Cluster running" in line for line in lines), "".join(lines)
    return lines


def _printed(lines: list[str], prefix: str) -> str:
    return next(line.split(prefix, 1)[1].split()[0] for line in lines if prefix in line)


@requires_tracing_ui
def test_dev_up_with_tracing_ui_shows_the_replay_span_and_its_metrics(tmp_path):
    """A new user's path: `dev up --tracing-ui`, a retried deposit, the replay span in Phoenix."""
    import urllib.request

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from shardrouter.client import SqliteOperationStore, TransferClient
    from shardrouter.core import tracing
    from shardrouter.localcluster import tracing_ui

    data_dir = pg_data_dir().parent / "cluster"  # not under tmp_path: the PostgreSQL user must reach it
    port = free_port()
    proc = _dev_up(data_dir, port, "--no-demo", "--tracing-ui")
    try:
        lines = _until_running(proc)
        ui = _printed(lines, "tracing UI: ")
        shard_metrics = {
            name: _printed(lines, f"metrics of {name}: ") for name in ("shard-0", "shard-1", "router")
        }
        # The caller traces too, to the same Phoenix (OTLP/gRPC on the endpoint the cluster uses).
        endpoint = next(
            line.split("OTEL_EXPORTER_OTLP_ENDPOINT=", 1)[1].split()[0]
            for line in lines
            if "OTEL_EXPORTER_OTLP_ENDPOINT=" in line
        )
        provider = tracing.new_tracer_provider(
            "e2e-caller", [OTLPSpanExporter(endpoint=endpoint, insecure=True)], batch=False
        )
        with TransferClient(
            f"127.0.0.1:{port}",
            store=SqliteOperationStore(str(tmp_path / "ops.db")),
            caller_id="e2e",
            tracer_provider=provider,
        ) as client:
            op = client.create_deposit("zoe", 300, "EUR")
            assert client.send_with_retries(op).ok
            replayed = client.send_with_retries(op)  # the retry a lost answer would cause
            assert replayed.ok and replayed.replayed
        provider.shutdown()

        spans = tracing_ui.replay_spans(ui, tracing.TRACE_PROJECT, op.idempotency_key, timeout_s=30)
        assert len(spans) == 1, spans
        replay = spans[0]
        attrs = replay["attributes"]
        assert attrs["idempotency.scope"] == "/shardrouter.v1.TransferService/Deposit|e2e"
        owner = attrs["shard.id"]
        assert owner in ("shard-0", "shard-1")
        assert attrs["service.name"] == f"shardd-{owner}"
        assert [e["name"] for e in replay["events"]] == ["idempotency.replay"]
        assert replay["status_code"] == "UNSET"
        # The whole trace of the replayed attempt: caller, router and shard, all in Phoenix.
        trace_id = replay["context"]["trace_id"]
        deadline = time.monotonic() + 30
        services: set[str] = set()
        while time.monotonic() < deadline and len(services) < 3:
            everything = tracing_ui.phoenix_spans(ui, tracing.TRACE_PROJECT, limit=1000)
            services = {
                s["attributes"].get("service.name", "")
                for s in everything
                if s["context"]["trace_id"] == trace_id
            }
            time.sleep(0.5)
        assert services == {"e2e-caller", "router", f"shardd-{owner}"}, services
        # The owning shard's metrics count the replay.
        with urllib.request.urlopen(shard_metrics[owner], timeout=5) as reply:
            text = reply.read().decode()
        assert 'shardd_requests_total{method="Deposit",outcome="replay"} 1.0' in text, text
        with urllib.request.urlopen(shard_metrics["router"], timeout=5) as reply:
            router_text = reply.read().decode()
        assert f'router_requests_total{{code="OK",method="Deposit",protocol="grpc",shard="{owner}"}}' in router_text, router_text
        if _BROWSER or os.environ.get("SHARD_ROUTER_REQUIRE_BROWSER"):
            _browser_check(["--url", ui, "--key", op.idempotency_key], tmp_path / "tracing-ui.png")
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert _wait_no_leftovers(data_dir) == []


_BROWSER = Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()


def _browser_check(args: list[str], shot: Path) -> None:
    """`scripts/tracing_ui_check.py` with `args`: the replay span found by its API, then seen in the
    UI by headless Chromium, with a screenshot."""
    result = subprocess.run(
        [sys.executable, "scripts/tracing_ui_check.py", *args, "--screenshot", str(shot)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "outcome=replay" in out and "events=['idempotency.replay']" in out, out
    assert "shows the replay span of" in out, out
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The tracing UI test above runs the browser check against its own cluster's UI (`--url`); this is
# the script as a user runs it, starting a cluster of its own: a second Phoenix start-up, so slow.
@pytest.mark.slow
@requires_tracing_ui
@pytest.mark.skipif(
    not _BROWSER and not os.environ.get("SHARD_ROUTER_REQUIRE_BROWSER"),
    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
)
def test_browser_check_shows_the_replay_span(tmp_path):
    """The committed browser check, as a user runs it: cluster, replay, API, then headless Chromium."""
    _browser_check([], tmp_path / "tracing-ui.png")
