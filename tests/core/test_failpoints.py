"""Named failpoints (`shardrouter.core.failpoints`): the arming format, and a real process that stops
at an armed point, says so, and stays there until killed, while unarmed points let it through."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from shardrouter.core import failpoints
from shardrouter.core.failpoints import Action, FailpointError, parse
from tests.processes import Paused, run_to_failpoint

#: A process that passes an unarmed point, then reaches `stop.here`.
SCRIPT = """
from shardrouter.core import failpoints
print("before", flush=True)
failpoints.reached("not.armed")
print("passed the unarmed point", flush=True)
failpoints.reached("stop.here")
print("after", flush=True)
"""


def _start(spec: str | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    if spec is not None:
        env[failpoints.ENV] = spec
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.parametrize(
    ("spec", "armed"),
    [
        ("", {}),
        ("  ", {}),
        ("reshard.verified=pause", {"reshard.verified": Action.PAUSE}),
        (" a.b-c_1 = pause , x=pause,", {"a.b-c_1": Action.PAUSE, "x": Action.PAUSE}),
    ],
)
def test_the_format_arms_the_named_points(spec: str, armed: dict[str, Action]) -> None:
    assert parse(spec) == armed


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("reshard.verified", "is not NAME=ACTION"),
        ("=pause", "is not NAME=ACTION"),
        ("a b=pause", "is not NAME=ACTION"),
        ("a=stop", "unknown action 'stop' (known: pause)"),
        ("a=", "unknown action ''"),
        ("a=pause,a=pause", "a is armed twice"),
    ],
)
def test_a_malformed_value_is_refused(spec: str, message: str) -> None:
    with pytest.raises(FailpointError, match=f"^{failpoints.ENV}: .*{re.escape(message)}"):
        parse(spec)


def test_unarmed_points_cost_nothing_here() -> None:
    assert failpoints.ENV not in os.environ
    assert failpoints.armed() == {}
    failpoints.reached("reshard.verified")  # returns at once


def test_an_armed_point_pauses_the_process_until_it_is_killed() -> None:
    def stays_there(paused: Paused) -> None:
        time.sleep(0.5)  # it stays at the point: alive (checked here), and writes nothing more (below)
        os.kill(paused.pid, 0)

    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    killed = run_to_failpoint(
        [sys.executable, "-c", SCRIPT], "stop.here", env=env, timeout_s=30, while_paused=stays_there
    )
    assert killed.output.splitlines() == [
        "before",
        "passed the unarmed point",
        f"failpoint stop.here: paused (pid {killed.pid})",
    ]
    assert killed.after == ""


def test_the_kill_helper_fails_a_process_that_never_reaches_the_point() -> None:
    """`run_to_failpoint` proves the kill landed at the point: a process that ends first fails it."""
    with pytest.raises(AssertionError, match=re.escape("ended with 0 before failpoint not.there")):
        run_to_failpoint([sys.executable, "-c", SCRIPT], "not.there", timeout_s=30)


def test_without_the_variable_every_point_is_passed() -> None:
    process = _start(None)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert out.splitlines() == ["before", "passed the unarmed point", "after"]


def test_other_armed_names_do_not_stop_the_process() -> None:
    process = _start("stop.elsewhere=pause")
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    assert out.splitlines() == ["before", "passed the unarmed point", "after"]


def test_a_malformed_variable_fails_the_process_at_import() -> None:
    process = _start("stop.here=sleep")
    out, _ = process.communicate(timeout=30)
    assert process.returncode != 0
    assert "FailpointError" in out and "unknown action 'sleep'" in out
    assert "before" not in out
