"""`shard-router check --local-cluster` with faults on a schedule: the installed command starts a
local cluster of its own, SIGKILLs its shard daemons and its router while the workload runs, starts
them again, and every proof still holds."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from shardrouter.localcluster.cluster import installed_command


def test_a_run_under_kills_of_shard_daemons_and_the_router_passes(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    done = subprocess.run(
        [
            *installed_command("shard-router"),
            "check",
            "--local-cluster",
            "--kill-shard-daemon-every",
            "0.5",
            "--kill-router-every",
            "0.8",
            "--operations",
            "400",
            "--concurrency",
            "6",
            "--history",
            str(history),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    kills = re.search(r"faults: (\d+) SIGKILL", done.stdout)
    assert kills is not None and int(kills[1]) >= 2, done.stdout
    assert "did not start again" not in done.stdout
    assert re.search(r"answers: \d+ acknowledged, \d+ refused, 0 pending", done.stdout), done.stdout
    assert "verdict: PASS, every proof holds" in done.stdout
    assert history.stat().st_size > 0
