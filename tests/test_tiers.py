"""The fast tier (`pytest -m fast`) holds the in-process tests and leaves out every module that starts
processes of its own; tests/conftest.py derives it, and this checks the derivation on the real tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tier_listing import FAST, OTHER

ROOT = Path(__file__).resolve().parent.parent
_QUIET_PLUGINS = ("-p", "no:cacheprovider", "-p", "tests.tier_listing")


def _tiers() -> tuple[set[str], set[str]]:
    """Test modules with a fast test, and every test module, from one `pytest --collect-only`."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *_QUIET_PLUGINS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    listed = [line.split() for line in result.stdout.splitlines() if line.startswith((FAST, OTHER))]
    return {path for tier, path in listed if tier == FAST}, {path for _, path in listed}


def test_the_fast_tier_keeps_in_process_tests_and_leaves_out_process_tests() -> None:
    fast, everything = _tiers()
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
