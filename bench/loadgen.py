"""Runs the Node.js load generator (bench/loadgen/loadgen.js) for one cell and reads its summary.

It speaks gRPC, or HTTP/JSON to the router's HTTP front (`protocol="http"`): the cell's `ok` is the
count of the answers that are its operation (OK / 200-201, or the `expect`ed status: ABORTED, 409).

The servers' CPU is sampled when the generator says its measured window opens and closes (it prints
"window-start" / "window-end" on stderr), so warm-up and connection set-up are not charged to the
operations. The generator's own CPU comes from its summary (process.cpuUsage over the window), its
peak RSS from wait4's rusage.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procstat import Tracked, sample
from bench.results import CellResult

LOADGEN_DIR = Path(__file__).resolve().parent / "loadgen"


def ensure_installed() -> str:
    """The node binary, after a quiet `npm install` into bench/loadgen/node_modules on first use."""
    node = shutil.which("node")
    npm = shutil.which("npm")
    if node is None or npm is None:
        raise SystemExit("bench needs node and npm on PATH for its load generator")
    if not (LOADGEN_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        print(
            "bench: installing the load generator's npm packages into bench/loadgen/node_modules ...",
            flush=True,
        )
        result = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=LOADGEN_DIR,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if result.returncode != 0:
            raise SystemExit(f"npm install failed:\n{result.stderr[-3000:]}")
    return node


@dataclass(frozen=True)
class LoadSpec:
    """What the generator sends (see loadgen.js for the meaning of each option)."""

    target: str
    method: str = "deposit"
    keys: str = "new"
    accounts: Path | None = None
    dst_accounts: Path | None = None
    amount: int = 0
    record: Path | None = None
    max_ops: int = 0
    deadline_ms: int = 10_000
    wait_ms: int = 10_000
    expect: str = "OK"
    #: "grpc", or "http" (the router's HTTP/JSON front; `target` is its host:port).
    protocol: str = "grpc"
    #: Calls started per second across all callers (0: each sends as soon as it is answered).
    rate: float = 0

    def args(self, concurrency: int, duration_s: float, warmup_s: float) -> list[str]:
        """Command-line options of loadgen.js."""
        out = [
            "--target",
            self.target,
            "--method",
            self.method,
            "--concurrency",
            str(concurrency),
            "--duration",
            str(duration_s),
            "--warmup",
            str(warmup_s),
            "--keys",
            self.keys,
            "--amount",
            str(self.amount),
            "--max-ops",
            str(self.max_ops),
            "--deadline-ms",
            str(self.deadline_ms),
            "--wait-ms",
            str(self.wait_ms),
            "--expect",
            self.expect,
            "--protocol",
            self.protocol,
            "--rate",
            str(self.rate),
        ]
        if self.accounts:
            out += ["--accounts", str(self.accounts)]
        if self.dst_accounts:
            out += ["--dst-accounts", str(self.dst_accounts)]
        if self.record:
            out += ["--record", str(self.record)]
        return out


def run_load(
    node: str,
    spec: LoadSpec,
    *,
    scenario: str,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    tracked: list[Tracked],
) -> CellResult:
    """One cell: the generator runs; the tracked processes are sampled over its window."""
    for t in tracked:
        t.reset_peak()
    cmd = [node, str(LOADGEN_DIR / "loadgen.js"), *spec.args(concurrency, duration_s, warmup_s)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=LOADGEN_DIR,
    )
    samples: dict[str, dict[str, float]] = {}
    stderr_lines: list[str] = []

    def watch_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:  # ends when the generator exits
            marker = line.strip()
            if marker in ("window-start", "window-end") and marker not in samples:
                samples[marker] = sample(tracked)
            else:
                stderr_lines.append(line)

    watcher = threading.Thread(target=watch_stderr, daemon=True)
    watcher.start()
    timeout_s = warmup_s + duration_s + spec.deadline_ms / 1000 + spec.wait_ms / 1000 + 30
    stdout, max_rss_kb = _wait_for_exit(proc, timeout_s)
    watcher.join(5)
    if proc.returncode != 0 or not stdout.strip():
        raise RuntimeError(f"load generator failed ({proc.returncode}): {''.join(stderr_lines)[-2000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    start = samples.get("window-start")
    end = samples.get("window-end") or sample(tracked)
    cpu = {name: end[name] - start[name] for name in end} if start else {}
    cpu["client"] = float(summary["cpu_s"])
    errors, extra = _errors_and_extra(summary, spec)
    return CellResult(
        scenario=scenario,
        concurrency=concurrency,
        ok=int(summary.get("ops", summary["ok"])),
        errors=errors,
        throughput=float(summary["throughput"]),
        latency={k: float(v) for k, v in summary["latency"].items()},
        window_s=float(summary["window_s"]),
        cpu_s=cpu,
        peak_rss_kb={t.name: t.peak_kb() for t in tracked} | {"client": max_rss_kb},
        extra=extra,
    )


def _wait_for_exit(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, int]:
    """(its standard output, its peak RSS in KiB) once the generator has exited; killed with its
    process group if it has not within `timeout_s`."""
    stdout = ""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the load generator did not finish in {timeout_s:.0f} s")
            time.sleep(0.02)
        stdout = proc.stdout.read()
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return stdout, int(rusage.ru_maxrss)


def _errors_and_extra(summary: dict[str, Any], spec: LoadSpec) -> tuple[dict[str, int], dict[str, Any]]:
    """The cell's errors by status, and what else the generator's summary reports."""
    extra: dict[str, Any] = {k: summary[k] for k in ("credit_lag", "transfer_latency", "slowest") if k in summary}
    errors = {str(k): int(v) for k, v in summary["errors"].items()}
    if summary.get("protocol") == "http":
        # 200/201 (`ok`) and 409 (`conflicts`) come apart from the other statuses; whichever of the
        # two is not the cell's operation is an error of the cell.
        extra |= {"protocol": "http"} | {k: int(summary[k]) for k in ("ok", "conflicts", "replayed")}
        if spec.expect == "OK" and summary["conflicts"]:
            errors["409"] = int(summary["conflicts"])
        elif spec.expect != "OK" and summary["ok"]:
            errors["2xx"] = int(summary["ok"])
    return errors, extra
