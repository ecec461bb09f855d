"""A local tracing UI: Arize Phoenix, started as a child process on loopback, ingesting OTLP over gRPC.

Phoenix comes with the optional extra `tracing-ui` (`pip install -e '.[tracing-ui]'`, ~800 MB). It is
started with everything that would reach outside turned off: no telemetry pixels, no external
resources (web fonts, sandbox downloads), no agent assistant, no MCP server, no server-side bash or
web tools, no LLM providers, no code sandboxes. Its data (SQLite) lives in `data_dir`.

Phoenix binds its OTLP gRPC receiver to every interface (`[::]:port`, not configurable), so the
process is started through a small launcher that rewrites that bind to the requested host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardrouter.core.wire_names import KEY_ATTRIBUTE, OUTCOME_ATTRIBUTE, OutcomeKind
from shardrouter.localcluster.postgres import free_port

#: Environment for Phoenix: loopback only, nothing phoning home, no agent features.
PHOENIX_ENV = {
    "PHOENIX_TELEMETRY_ENABLED": "false",
    "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
    "PHOENIX_ENABLE_MCP_SERVER": "false",
    "PHOENIX_AGENTS_DISABLE_WEB_ACCESS": "true",
    "PHOENIX_AGENTS_DISABLE_BASH": "true",
    "PHOENIX_AGENTS_DISABLE_GITHUB": "true",
    "PHOENIX_ALLOWED_PROVIDERS": "NONE",
    "PHOENIX_ALLOWED_SANDBOX_PROVIDERS": "NONE",
    "PHOENIX_ENABLE_PROMETHEUS": "false",
    "PHOENIX_ENABLE_AUTH": "false",
}

# Runs Phoenix's own CLI (`python -m phoenix.server.main serve`) after narrowing the OTLP gRPC
# receiver's bind from "[::]:port" to PHOENIX_HOST.
_LAUNCHER = """
import os, sys
import grpc.aio._server as aio_server
host = os.environ["PHOENIX_HOST"]
bind_host = f"[{host}]" if ":" in host else host
original = aio_server.Server.add_insecure_port
def add_insecure_port(self, address):
    if address.startswith("[::]:"):
        address = bind_host + address[4:]
    return original(self, address)
aio_server.Server.add_insecure_port = add_insecure_port
from phoenix.server.main import main
sys.argv = ["phoenix", "serve"]
main()
"""


@dataclass
class PhoenixProcess:
    """A running Phoenix server."""

    process: subprocess.Popen[bytes]
    ui_url: str
    otlp_endpoint: str
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate Phoenix (SIGTERM, then SIGKILL)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)


def phoenix_installed() -> bool:
    """Whether the `tracing-ui` extra is installed in this interpreter (without importing it)."""
    from importlib import metadata

    try:
        metadata.version("arize-phoenix")
    except metadata.PackageNotFoundError:
        return False
    return True


def launch_phoenix(
    data_dir: Path | str,
    host: str = "127.0.0.1",
    *,
    port: int | None = None,
    grpc_port: int | None = None,
    timeout_s: float = 120.0,
) -> PhoenixProcess:
    """Start Phoenix and wait until it answers (UI, REST API and OTLP/gRPC receiver).

    `otlp_endpoint` of the result is for `OTEL_EXPORTER_OTLP_ENDPOINT` (OTLP over gRPC, plaintext);
    its log is `data_dir/phoenix.log`.
    """
    if not phoenix_installed():
        raise RuntimeError(
            "Arize Phoenix is not installed; install the tracing-ui extra: pip install -e '.[tracing-ui]'"
        )
    directory = Path(data_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    grpc_port = grpc_port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
    env.update(PHOENIX_ENV)
    env.update(
        {
            "PHOENIX_HOST": host,
            "PHOENIX_PORT": str(port),
            "PHOENIX_GRPC_PORT": str(grpc_port),
            "PHOENIX_WORKING_DIR": str(directory),
        }
    )
    log_path = directory / "phoenix.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER],
            env=env,
            cwd=directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url_host = f"[{host}]" if ":" in host else host
    ui_url = f"http://{url_host}:{port}"
    started = PhoenixProcess(process, ui_url, f"http://{url_host}:{grpc_port}", log_path)
    try:
        _wait_ready(started, timeout_s)
    except BaseException:
        started.stop()
        raise
    return started


def _wait_ready(phoenix: PhoenixProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if phoenix.process.poll() is not None:
            tail = phoenix.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"Phoenix exited with {phoenix.process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{phoenix.ui_url}/healthz", timeout=1) as reply:  # noqa: S310 - loopback
                if reply.status == 200 and _grpc_port_open(phoenix.otlp_endpoint):
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"Phoenix did not become ready in {timeout_s} s; see {phoenix.log_path}")


def phoenix_spans(
    ui_url: str, project: str, *, attributes: dict[str, str] | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Spans of `project` from Phoenix's REST API (`GET /v1/projects/<project>/spans`), newest first.

    `attributes` filters by exact attribute values, e.g. `{"idempotency.outcome": "replay"}`.
    A project that has no span yet does not exist: [] then.
    """
    query: list[tuple[str, str]] = [("limit", str(limit))]
    for key, value in (attributes or {}).items():
        query.append(("attribute", f"{key}:{json.dumps(value)}"))
    url = f"{ui_url}/v1/projects/{urllib.parse.quote(project, safe='')}/spans?{urllib.parse.urlencode(query)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - the caller's Phoenix URL
            body = json.load(reply)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # the project appears with its first span
            return []
        raise
    spans: list[dict[str, Any]] = body.get("data", [])
    return spans


def replay_spans(ui_url: str, project: str, key: str, *, timeout_s: float) -> list[dict[str, Any]]:
    """The replay spans of idempotency key `key`, waiting up to `timeout_s` for the first to arrive
    (exporters send in batches); [] if none came."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = phoenix_spans(
            ui_url, project, attributes={KEY_ATTRIBUTE: key, OUTCOME_ATTRIBUTE: OutcomeKind.REPLAY}
        )
        if spans or time.monotonic() >= deadline:
            return spans
        time.sleep(0.5)


def span_url(ui_url: str, span_id: str) -> str:
    """Phoenix's deep link to one span (it redirects to the span's trace with the span selected)."""
    return f"{ui_url}/redirects/spans/{urllib.parse.quote(span_id)}"


def _grpc_port_open(endpoint: str) -> bool:
    import socket

    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
            return True
    except OSError:
        return False


__all__ = [
    "PHOENIX_ENV",
    "PhoenixProcess",
    "launch_phoenix",
    "phoenix_installed",
    "phoenix_spans",
    "replay_spans",
    "span_url",
]
