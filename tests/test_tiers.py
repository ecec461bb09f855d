"""The fast tier (`pytest -m fast`) holds the in-process tests and leaves out every module that starts
processes of its own; tests/conftest.py derives it, and this checks the derivation on the real tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> set[str]:
    """Test modules `pytest --collect-only` selects with `args`."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return {line.split("::", 1)[0] for line in result.stdout.splitlines() if "::" in line}


def test_the_fast_tier_keeps_in_process_tests_and_leaves_out_process_tests() -> None:
    fast = _collected("-m", "fast")
    everything = _collected()
    assert {
        "tests/unit/test_guarded_call.py",
        "tests/shardd/test_interceptor_outcomes.py",
        "tests/router/http/test_problems.py",
        "tests/architecture/test_core_is_shared.py",
    } <= fast
    left_out = everything - fast
    # By folder: processes of their own (daemons, clusters, kubectl, the bench).
    assert {
        path for path in everything if path.startswith(("tests/e2e/", "tests/faults/", "tests/reshard/"))
    } <= left_out
    # By source: a module in an in-process folder that starts a daemon process (run_shardd).
    assert "tests/shardd/test_migrations.py" in left_out
    assert "tests/test_readme.py" in left_out and "tests/test_tiers.py" in left_out
