"""Every daemon command refuses what it cannot run and explains itself: unknown flags and commands are
usage errors that name the closest valid one, `--help` anywhere lists every setting (generated from
the settings classes), unknown `PREFIX_*` variables are reported, an unreachable database is one line,
and a SIGTERM during start-up migrations is a clean stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import psycopg
import pytest

from shardrouter.core.settings_source import UsageError, parse_command, setting_docs, split_command_line
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.settings import ENV_PREFIX as ROUTER_PREFIX
from shardrouter.router.settings import RouterSettings
from shardrouter.shardd.migrations import _MIGRATION_LOCK
from shardrouter.shardd.settings import ENV_PREFIX as SHARDD_PREFIX
from shardrouter.shardd.settings import ShardSettings
from tests.helpers import allow_all_policy_file
from tests.processes import ROOT, run_cli

DAEMONS = {"shardd": (ShardSettings, SHARDD_PREFIX), "router": (RouterSettings, ROUTER_PREFIX)}


@pytest.mark.parametrize(
    ("program", "args", "message"),
    [
        (
            "shardd",
            ["serve", "--dns", "postgresql://x", "--workres", "4"],
            "unknown flag --dns (did you mean --dsn?)",
        ),
        ("shardd", ["serve", "--workres=4"], "unknown flag --workres (did you mean --workers?)"),
        ("shardd", ["sevre"], "unknown command 'sevre' (did you mean 'serve'?)"),
        ("shardd", ["dead-letters", "purge"], "'dead-letters' takes one of: dead-letters list"),
        ("shardd", ["dead-letters", "show"], "'dead-letters show' takes 1 argument(s), got 0"),
        ("shardd", ["serve", "--listen"], "flag --listen needs a value"),
        ("shardd", [], "no command given"),
        (
            "router",
            ["serve", "--shard-mpa", "m.yaml"],
            "unknown flag --shard-mpa (did you mean --shard-map?)",
        ),
        ("router", ["serv"], "unknown command 'serv' (did you mean 'serve'?)"),
        ("router", ["serve", "extra"], "'serve' takes no argument, got 1"),
    ],
)
def test_usage_errors_exit_2_and_name_the_closest_valid_choice(program, args, message) -> None:
    result = run_cli(program, *args)
    assert result.returncode == 2, result
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{program} --help" in result.stderr


@pytest.mark.parametrize("program", sorted(DAEMONS))
@pytest.mark.parametrize("where", ["alone", "after the command"])
def test_help_lists_every_setting_and_starts_nothing(program, where) -> None:
    cls, prefix = DAEMONS[program]
    args = ["--help"] if where == "alone" else ["serve", "--listen", "127.0.0.1:1", "--help"]
    started = time.monotonic()
    result = run_cli(program, *args)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 20
    for f in fields(cls):
        flag, env = "--" + f.name.replace("_", "-"), prefix + f.name.upper()
        assert f"{flag} " in result.stdout and env in result.stdout, f"{flag} / {env} missing from --help"
    assert "serve" in result.stdout


@pytest.mark.parametrize("program", sorted(DAEMONS))
def test_every_setting_is_documented(program) -> None:
    cls, prefix = DAEMONS[program]
    undocumented = [d.name for d in setting_docs(cls, prefix) if len(d.help) < 10]
    assert not undocumented, f"settings without a #: comment: {undocumented}"


def test_settings_reference_is_current() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/generate_settings_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_command_line_parsing_unit() -> None:
    line = split_command_line(["--dsn=x", "keys", "lookup", "--listen", "h:1", "K"], ShardSettings)
    assert line.words == ["keys", "lookup", "K"] and line.flags == {"dsn": "x", "listen": "h:1"}
    assert parse_command(line.words, {("keys", "lookup"): 1, ("serve",): 0}) == (("keys", "lookup"), ["K"])
    with pytest.raises(UsageError, match="unknown flag -x"):
        split_command_line(["serve", "-x"], ShardSettings)


def test_unknown_prefixed_environment_variable_is_reported_at_start() -> None:
    result = run_cli(
        "shardd",
        "migrate",
        "--dsn",
        "postgresql://postgres@127.0.0.1:1/postgres",
        "--log-format",
        "text",
        env={"SHARDD_WORKRES": "4", "SHARDD_MAX_IN_FLIGHT_PER_CALLER": "8"},
    )
    assert "SHARDD_WORKRES is set but no setting reads it (did you mean SHARDD_WORKERS?)" in result.stderr
    assert "SHARDD_MAX_IN_FLIGHT_PER_CALLER is set but no setting reads it" in result.stderr


@pytest.mark.parametrize(
    "command",
    [
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--authz-policy-file",
            str(allow_all_policy_file()),
        ],
        ["migrate"],
    ],
)
def test_unreachable_database_is_one_clear_line(command) -> None:
    port = free_port()
    result = run_cli("shardd", *command, "--dsn", f"postgresql://app:hunter2@127.0.0.1:{port}/ledger")
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardd:")]
    assert lines == [
        f"shardd: cannot reach the database at 127.0.0.1:{port} (database ledger): connection failed: "
        f'connection to server at "127.0.0.1", port {port} failed: Connection refused'
    ], result.stderr
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr


def test_serving_outside_dev_mode_needs_a_valid_authorization_policy(tmp_path: Path) -> None:
    """Checked before the database is reached: one line naming the setting, or the bad place."""
    dsn = f"postgresql://app@127.0.0.1:{free_port()}/ledger"
    result = run_cli("shardd", "serve", "--dsn", dsn, "--listen", "127.0.0.1:0", "--metrics-port", "0")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardd:")]
    assert len(lines) == 1 and "authz_policy_file (SHARDD_AUTHZ_POLICY_FILE" in lines[0], result.stderr
    listen = f"127.0.0.1:{free_port()}"
    several = run_cli(
        "shardd", "serve", "--dsn", dsn, "--listen", listen, "--metrics-port", "0", "--processes", "2"
    )
    assert several.returncode == 2 and "SHARDD_AUTHZ_POLICY_FILE" in several.stderr, several.stderr
    bad = tmp_path / "policy.json"
    bad.write_text('{"name": "p", "allow_policies": [{"name": "a", "request": {"headers": []}}]}')
    result = run_cli(
        "shardd",
        "serve",
        "--dsn",
        dsn,
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "0",
        "--authz-policy-file",
        str(bad),
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardd:")]
    assert lines == [
        f"shardd: cannot start: {bad}: allow_policies[0].request.headers: header matches are not "
        "supported (only paths and accounts)"
    ], result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_during_start_up_migrations_is_a_clean_stop(database: str, tmp_path: Path) -> None:
    """The migration lock is held elsewhere, so `shardd serve` waits in its migrations; a SIGTERM then
    stops it at once with exit 0 and a log line, and nothing of the schema is half made."""
    log_path = tmp_path / "shardd.log"
    with psycopg.connect(database, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK,))
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shardrouter.shardd.cli",
                    "serve",
                    "--dsn",
                    database,
                    "--listen",
                    "127.0.0.1:0",
                ],
                cwd=ROOT,
                env={
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "SHARDD_METRICS_PORT": "0",
                    "SHARDD_DEV_MODE": "1",
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                waiting = holder.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone()
                if waiting and waiting[0]:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("shardd never waited for the migration lock:\n" + log_path.read_text())
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=10)
        finally:
            if process.poll() is None:
                process.kill()
        assert code == 0, log_path.read_text()
        assert "stopped during start-up" in log_path.read_text()
        assert "Traceback" not in log_path.read_text()
        # The waiting statement was cancelled: no backend waits for the lock any more.
        waiting = holder.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ).fetchone()
        assert waiting == (0,)
