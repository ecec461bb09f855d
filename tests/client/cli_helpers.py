"""Running the `shard-router` command (`python -m shardrouter.localcluster.command`) and the crash helper as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from tests.processes import ROOT


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def json(self) -> Any:
        return json.loads(self.stdout)


def child_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARD_ROUTER_")}
    env.update({"PYTHONPATH": str(ROOT), "XDG_DATA_HOME": str(tmp / "xdg"), **extra})
    return env


def cli(tmp: Path, *args: str, store: Path | None = None, env: dict[str, str] | None = None) -> Run:
    store_args = ["--store", str(store)] if store is not None else []
    proc = subprocess.run(
        [sys.executable, "-m", "shardrouter.localcluster.command", *store_args, *args],
        check=False,
        env=env or child_env(tmp),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def crash_helper(tmp: Path, mode: str, store: Path, target: str, *args: str) -> Run:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.client.crash_helper", mode, str(store), target, *args],
        check=False,
        env=child_env(tmp),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def ledger_count(dsn: str, key: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (str(key),)
        ).fetchone()
    assert row is not None
    return int(row[0])


def balance_of(dsn: str, account: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT balance FROM accounts WHERE id = %s", (account,)).fetchone()
    assert row is not None
    return int(row[0])
