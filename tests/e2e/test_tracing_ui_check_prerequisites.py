"""scripts/tracing_ui_check.py without a browser: one line saying what to install, exit 2, nothing started.

The full check (cluster, Phoenix, headless Chromium) is
tests/e2e/test_dev_cluster.py::test_browser_check_shows_the_replay_span; these run everywhere, fast.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from tests.processes import ROOT

SCRIPT = ROOT / "scripts" / "tracing_ui_check.py"


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env or {**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    return result.returncode, result.stdout, result.stderr, time.monotonic() - started


def _assert_refused_before_starting(code: int, out: str, err: str, seconds: float) -> None:
    assert code == 2, out + err
    assert out == "", "nothing ran: no cluster output, no screenshot"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "apt-get install -y chromium chromium-driver" in lines[0], lines[0]
    # `dev up` with Phoenix takes tens of seconds; a refusal before it is an interpreter start.
    assert seconds < 20, seconds


def test_a_missing_driver_is_one_line_and_exit_2(tmp_path: Path) -> None:
    code, out, err, seconds = _run("--chromedriver", str(tmp_path / "no-such-chromedriver"))
    _assert_refused_before_starting(code, out, err, seconds)
    assert "no-such-chromedriver not found" in err


def test_a_path_without_chromium_is_one_line_and_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": str(empty)}
    code, out, err, seconds = _run(env=env)
    _assert_refused_before_starting(code, out, err, seconds)
    assert "chromium and chromedriver not found" in err
    # Against a running Phoenix too (the --url form), before any request is made.
    code, out, err, seconds = _run("--url", "http://127.0.0.1:1", "--key", "k", env=env)
    _assert_refused_before_starting(code, out, err, seconds)


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tracing_ui_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_screenshot_is_outside_the_repository() -> None:
    default = Path(_script().DEFAULT_SCREENSHOT)
    assert default.parent == Path(tempfile.gettempdir())
    assert ROOT not in default.parents
