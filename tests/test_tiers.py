"""The fast tier (`pytest -m fast`) holds the in-process tests and leaves out every module that starts
processes of its own; tests/conftest.py derives it, and this checks the derivation on the real tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.tier_listing import FAST, OTHER

ROOT = Path(__file__).resolve().parent.parent
_QUIET_PLUGINS = ("-p", "no:cacheprovider", "-p", "tests.tier_listing")


def _tiers(config: pytest.Config, session: pytest.Session) -> tuple[set[str], set[str]]:
    """Test modules with a fast test, and every test module: from this session's own collection when
    it collected the whole tree unfiltered (a default `pytest` run, where each worker collects
    everything), else from one `pytest --collect-only` of its own."""
    whole_tree = (
        config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and not config.option.markexpr
        and not config.option.keyword
        and not config.option.deselect
        and not config.getoption("lf", False)
        and not config.getoption("ff", False)
    )
    if whole_tree:
        listed = [
            (FAST if i.get_closest_marker("fast") else OTHER, i.nodeid.split("::", 1)[0])
            for i in session.items
        ]
        return {path for tier, path in listed if tier == FAST}, {path for _, path in listed}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *_QUIET_PLUGINS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith((FAST, OTHER))]
    return {path for tier, path in lines if tier == FAST}, {path for _, path in lines}


def test_the_fast_tier_keeps_in_process_tests_and_leaves_out_process_tests(
    request: pytest.FixtureRequest,
) -> None:
    fast, everything = _tiers(request.config, request.session)
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
