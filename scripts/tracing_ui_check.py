"""Browser check of the local tracing UI: a replayed call must show as a tagged span in Arize Phoenix.

    python scripts/tracing_ui_check.py                 # start `shard-router dev up --tracing-ui`, check, stop
    python scripts/tracing_ui_check.py --url http://127.0.0.1:6006 --key <idempotency key>

The first form is the whole path of a new user: it starts the local cluster with its tracing UI (the
project's own `shard-router dev up --tracing-ui`, everything on 127.0.0.1), sends a deposit and its
retry through the caller library (traced to the same Phoenix), finds the replay span through
Phoenix's REST API, then opens Phoenix's deep link to that span in headless Chromium (Debian's
`chromium` + `chromium-driver`, driven by Selenium) and checks that the rendered page shows the
span with `idempotency.outcome` = `replay` and the key. It saves a screenshot of the page under the
system's temporary directory (the path is printed); `--screenshot docs/tracing-ui.png` refreshes the
one in the docs.

Before it starts anything it checks that Chromium, its driver, Selenium and (without --url) Phoenix
are there, and says in one line what to install if not.
Exit status 0 when the browser showed the replay span, 1 otherwise, 2 when something is missing.

Needs: pip install -e '.[dev,tracing-ui]'; apt-get install -y chromium chromium-driver.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shardrouter.core import tracing  # noqa: E402
from shardrouter.localcluster import tracing_ui  # noqa: E402
from shardrouter.localcluster.postgres import free_port  # noqa: E402

#: Debian's `chromium` and `chromium-driver` put these on PATH (in /usr/bin).
CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"
#: Outside the repository: a check run must not rewrite the tracked docs/tracing-ui.png.
DEFAULT_SCREENSHOT = Path(tempfile.gettempdir()) / "shard-router-tracing-ui.png"
INSTALL_BROWSER = "apt-get install -y chromium chromium-driver"
INSTALL_EXTRAS = "pip install -e '.[dev,tracing-ui]'"


def find_program(name: str) -> str | None:
    """`name` as a path to an executable file, or found on PATH; None if neither."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return shutil.which(name)


def missing_prerequisite(chromium: str, chromedriver: str, *, need_phoenix: bool) -> str | None:
    """One line saying what to install, or None when everything the check uses is there.

    Checked before a cluster starts: finding out from Selenium's traceback after a minute of
    start-up is the experience this replaces.
    """
    missing = [what for what in (chromium, chromedriver) if find_program(what) is None]
    if missing:
        return (
            f"tracing_ui_check: {' and '.join(missing)} not found; install Debian's chromium and "
            f"chromium-driver packages: {INSTALL_BROWSER}"
        )
    if importlib.util.find_spec("selenium") is None:
        return f"tracing_ui_check: the selenium package is missing; install the dev extra: {INSTALL_EXTRAS}"
    if need_phoenix and not tracing_ui.phoenix_installed():
        return f"tracing_ui_check: Arize Phoenix is missing; install the tracing-ui extra: {INSTALL_EXTRAS}"
    return None


def browser_check(
    page_url: str,
    key: str,
    shot: Path | None,
    timeout_s: float = 60.0,
    *,
    chromium: str = CHROMIUM,
    chromedriver: str = CHROMEDRIVER,
) -> bool:
    """Open `page_url` in headless Chromium; True once the page shows the replay span of `key`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium_path, driver_path = find_program(chromium), find_program(chromedriver)
    assert chromium_path and driver_path, "missing_prerequisite() is checked first"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium_path
    # No outside traffic: this machine's network is closed, and the check needs none.
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        # An explicit driver path: Selenium would otherwise try to download one.
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
        try:
            driver.get(page_url)
            deadline = time.monotonic() + timeout_s
            wanted = ("idempotency.outcome", "replay", key, "idempotency")
            text = ""
            while time.monotonic() < deadline:
                text = driver.find_element("tag name", "body").text
                if all(w in text for w in wanted):
                    break
                time.sleep(0.5)
            shown = all(w in text for w in wanted)
            if shot is not None:
                shot.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(shot))
                print(f"screenshot of {driver.current_url} saved to {shot}")
            if not shown:
                missing = [w for w in wanted if w not in text]
                print(f"the page never showed {missing}; it showed:\n{text[:2000]}", file=sys.stderr)
            return shown
        finally:
            driver.quit()


def check(
    ui_url: str, key: str, shot: Path | None, browser: tuple[str, str] = (CHROMIUM, CHROMEDRIVER)
) -> int:
    """Find the replay span of `key` through the API, then see it in the browser."""
    spans = tracing_ui.replay_spans(ui_url, tracing.TRACE_PROJECT, key, timeout_s=30)
    if not spans:
        print(f"Phoenix at {ui_url} has no replay span for idempotency.key={key}", file=sys.stderr)
        return 1
    span = spans[0]
    attrs = span["attributes"]
    print(
        f"API: span {span['context']['span_id']} of trace {span['context']['trace_id']}: "
        f"outcome={attrs['idempotency.outcome']} key={attrs['idempotency.key']} shard={attrs.get('shard.id')} "
        f"events={[e['name'] for e in span['events']]}"
    )
    page = tracing_ui.span_url(ui_url, span["context"]["span_id"])
    if not browser_check(page, key, shot, chromium=browser[0], chromedriver=browser[1]):
        return 1
    print(f"browser: {page} shows the replay span of {key}")
    return 0


def _cluster(data_dir: Path, port: int) -> tuple[subprocess.Popen[str], str, str]:
    """`shard-router dev up --tracing-ui --no-demo`; returns (process, ui url, otlp endpoint)."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "shardrouter.localcluster.command", "dev", "up", "--shards", "2"),
            *("--no-demo", "--tracing-ui", "--data-dir", str(data_dir), "--port", str(port)),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        print("  | " + line, end="")
        if "Cluster running" in line:
            break
    else:
        raise RuntimeError("the cluster did not start:\n" + "".join(lines))
    ui = next(line.split("tracing UI: ", 1)[1].split()[0] for line in lines if "tracing UI: " in line)
    otlp = next(
        line.split("OTEL_EXPORTER_OTLP_ENDPOINT=", 1)[1].split()[0]
        for line in lines
        if "OTEL_EXPORTER_OTLP_ENDPOINT=" in line
    )
    return proc, ui, otlp


def _deposit_and_replay(port: int, otlp: str, store: Path) -> str:
    """A deposit and its retry through the traced caller library; the operation's key."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from shardrouter.client import SqliteOperationStore, TransferClient

    provider = tracing.new_tracer_provider(
        "browser-check-caller", [OTLPSpanExporter(endpoint=otlp, insecure=True)], batch=False
    )
    try:
        with TransferClient(
            f"127.0.0.1:{port}",
            store=SqliteOperationStore(str(store)),
            caller_id="browser-check",
            tracer_provider=provider,
        ) as client:
            op = client.create_deposit("alice", 500, "EUR", reference="browser check")
            first = client.send_with_retries(op)
            again = client.send_with_retries(op)
            print(f"deposit {op.idempotency_key}: first {first.state}, retry replayed={again.replayed}")
            if not (first.ok and again.replayed):
                raise RuntimeError("the retry was not a replay")
    finally:
        provider.shutdown()
    return op.idempotency_key


def run_all(shot: Path | None, browser: tuple[str, str] = (CHROMIUM, CHROMEDRIVER)) -> int:
    """Start the local cluster with its tracing UI, make a replay, check it in the browser, stop."""
    with tempfile.TemporaryDirectory(prefix="tracing-ui-check-") as work:
        port = free_port()
        proc, ui, otlp = _cluster(Path(work) / "cluster", port)
        try:
            key = _deposit_and_replay(port, otlp, Path(work) / "ops.db")
            return check(ui, key, shot, browser)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running Phoenix (e.g. from `shard-router dev up --tracing-ui`)")
    parser.add_argument("--key", help="with --url: the idempotency key whose replay to look for")
    parser.add_argument(
        "--screenshot",
        type=Path,
        default=DEFAULT_SCREENSHOT,
        help=f"PNG to write (default {DEFAULT_SCREENSHOT}; docs/tracing-ui.png to refresh the docs' one)",
    )
    parser.add_argument("--no-screenshot", action="store_true")
    parser.add_argument("--chromium", default=CHROMIUM, help="Chromium binary, a path or a name on PATH")
    parser.add_argument("--chromedriver", default=CHROMEDRIVER, help="its driver, a path or a name on PATH")
    args = parser.parse_args(argv)
    if args.url and not args.key:
        parser.error("--url needs --key")
    problem = missing_prerequisite(args.chromium, args.chromedriver, need_phoenix=not args.url)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    shot = None if args.no_screenshot else args.screenshot
    browser = (args.chromium, args.chromedriver)
    if args.url:
        return check(args.url.rstrip("/"), args.key, shot, browser)
    return run_all(shot, browser)


if __name__ == "__main__":
    sys.exit(main())
