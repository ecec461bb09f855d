"""`shard-router check` against a real local cluster (a PostgreSQL, a `shardd` process per shard and
the router): a run with the full mix passes, and the checker fails, naming the key, when a double
apply, a lost credit or a changed replay is planted after it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from shardrouter.check import cli
from shardrouter.check.history import History, read_history
from shardrouter.check.verify import answers_of
from shardrouter.localcluster.cluster import LocalCluster, installed_command
from shardrouter.v1 import transfer_pb2
from tests.processes import ROOT, ServiceProcess, router_process
from tests.reconcile.drive import dsns, running_cluster, sql
from tests.tls import CertFiles, TestCA


@dataclass
class Run:
    """The module's check run: its cluster, history file and first verdict."""

    cluster: LocalCluster
    history_path: Path
    history: History
    code: int
    verdict: dict[str, Any]
    databases: Path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with running_cluster() as cluster:
        where = tmp_path_factory.mktemp("check")
        history = where / "history.jsonl"
        args = ["--target", f"127.0.0.1:{cluster.router_port}", "--databases", str(cluster.databases_path)]
        code, verdict = _check(
            *args, "--history", str(history), "--operations", "160", "--concurrency", "6", "--seed", "3"
        )
        yield Run(cluster, history, read_history(history), code, verdict, cluster.databases_path)


def _check(*args: str) -> tuple[int, dict[str, Any]]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([*args, "--json", "--settle", "20"])
    return code, json.loads(out.getvalue())


def _verify(run: Run, history: Path | None = None) -> tuple[int, dict[str, Any]]:
    return _check("--verify", str(history or run.history_path), "--databases", str(run.databases))


def _named(verdict: dict[str, Any], kind: str) -> set[str]:
    return {v["key"] for v in verdict["violations"] if v["kind"] == kind}


def _acknowledged(run: Run, label: str) -> list[tuple[str, bytes]]:
    """(key, first answer's response bytes) of the run's acknowledged operations with `label`."""
    found = []
    for key, op in run.history.operations.items():
        first = answers_of(run.history.attempts[key]).first
        if op.label == label and first is not None and first.code == "OK":
            found.append((key, first.response))
    return found


def test_a_run_with_the_full_mix_passes(run: Run) -> None:
    assert run.code == 0, run.verdict["violations"]
    f = run.verdict["figures"]
    assert f["pending"] == 0 and f["in_flight_transfers"] == 0
    assert f["operations"] == 12 + 160 + 2  # seed deposits, the mix, the expired keys
    assert f["in_flight_duplicates"] > 0 and f["later_duplicates"] > 0 and f["replays"] > 0
    assert f["reused_bodies"] > 0 and f["reused_refused"] == f["reused_bodies"]
    assert f["expired_refused"] == f["expired_keys"] == 2
    assert f["same_shard"] > 0 and f["cross_shard"] > 0 and f["credited"] > 0
    money = run.verdict["money"]
    assert money["acknowledged_deposits"] == money["balances"] > 0 and money["in_flight"] == 0
    # Every attempt is in the history, with its request's hash and its answer's bytes.
    lines = run.history_path.read_text().splitlines()
    assert sum(1 for line in lines if json.loads(line)["type"] == "attempt") == f["attempts"]


def test_the_installed_command_proves_the_history_again(run: Run) -> None:
    done = subprocess.run(
        [
            *installed_command("shard-router"),
            "check",
            "--verify",
            str(run.history_path),
            "--databases",
            str(run.databases),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: PASS" in done.stdout


def test_a_changed_replay_is_named(run: Run, tmp_path: Path) -> None:
    """One key's later answer edited in the history: not byte-identical to its first answer."""
    records = [json.loads(line) for line in run.history_path.read_text().splitlines()]
    seen: set[str] = set()
    target = None
    for record in records:
        if record["type"] == "attempt" and record["code"] == "OK" and record["role"] != "reused_body":
            if record["key"] in seen:
                target = record
                break
            seen.add(record["key"])
    assert target is not None, "the run has no key answered twice"
    response = bytearray(base64.b64decode(target["response_b64"]))
    response[-1] ^= 0x01
    target["response_b64"] = base64.b64encode(bytes(response)).decode()
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, verdict = _verify(run, edited)
    assert code == 1
    assert _named(verdict, "answer_changed") == {target["key"]}


def test_a_double_apply_is_named(run: Run) -> None:
    """A second deposit entry and its balance change, for an acknowledged key."""
    key, response = _acknowledged(run, "deposit")[0]
    op = run.history.operations[key]
    shard_dsn = _holding(run, op.account)
    entry = uuid.uuid4()
    sql(
        shard_dsn,
        "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, idempotency_key, reference)"
        " VALUES (%s, %s, %s, 'deposit', %s, 'planted')",
        (entry, op.account, op.amount_minor, key),
    )
    sql(shard_dsn, "UPDATE accounts SET balance = balance + %s WHERE id = %s", (op.amount_minor, op.account))
    try:
        code, verdict = _verify(run)
        assert code == 1
        assert key in _named(verdict, "applied_twice")
        assert _named(verdict, "money_not_conserved") == {""}
        text = _verify_text(run)
        assert f"applied_twice: key {key}" in text and "verdict: FAIL" in text
        assert transfer_pb2.DepositResponse.FromString(response).entry_id  # the answer named one entry
    finally:
        sql(shard_dsn, "DELETE FROM ledger_entries WHERE id = %s", (entry,))
        sql(
            shard_dsn,
            "UPDATE accounts SET balance = balance - %s WHERE id = %s",
            (op.amount_minor, op.account),
        )
    assert _verify(run)[0] == 0


def test_a_lost_credit_is_named(run: Run) -> None:
    """A cross-shard transfer's credit (entry and balance) deleted on its destination's shard."""
    key, response = _acknowledged(run, "cross_shard")[0]
    op = run.history.operations[key]
    transfer_id = transfer_pb2.TransferResponse.FromString(response).transfer.transfer_id
    shard_dsn = _holding(run, op.destination)
    with psycopg.connect(shard_dsn) as conn:
        cur = conn.execute(
            "DELETE FROM ledger_entries WHERE transfer_id = %s AND kind = 'transfer_in' RETURNING *",
            (transfer_id,),
        )
        names = [c.name for c in cur.description or ()]
        row = cur.fetchone()
        assert row is not None
        conn.execute(
            "UPDATE accounts SET balance = balance - %s WHERE id = %s", (op.amount_minor, op.destination)
        )
    try:
        code, verdict = _verify(run)
        assert code == 1
        assert _named(verdict, "credit_lost") == {key}
        assert "money_not_conserved" in {v["kind"] for v in verdict["violations"]}
    finally:
        with psycopg.connect(shard_dsn) as conn:
            conn.execute(
                f"INSERT INTO ledger_entries ({', '.join(names)}) VALUES ({', '.join(['%s'] * len(names))})",
                row,
            )
            conn.execute(
                "UPDATE accounts SET balance = balance + %s WHERE id = %s", (op.amount_minor, op.destination)
            )
    assert _verify(run)[0] == 0


def _verify_text(run: Run) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["--verify", str(run.history_path), "--databases", str(run.databases), "--settle", "0"])
    return out.getvalue()


def _holding(run: Run, account: str) -> str:
    for dsn in dsns(run.cluster).values():
        if sql(dsn, "SELECT 1 FROM accounts WHERE id = %s", (account,)):
            return dsn
    raise AssertionError(f"no shard holds {account}")


def _tls_router(run: Run, tmp_path: Path, server: CertFiles) -> ServiceProcess:
    """A router over the module's cluster that speaks only TLS and verifies its callers (mTLS)."""
    process = router_process(
        tmp_path,
        shard_map=run.cluster.shard_map_path,
        extra_env={
            "ROUTER_DEV_MODE": "false",
            "ROUTER_TLS_CERT": str(server.cert),
            "ROUTER_TLS_KEY": str(server.key),
            "ROUTER_TLS_CA": str(server.ca),
        },
    )
    # ServiceProcess.start waits on a plaintext health check; this router speaks only TLS.
    with process.log_path.open("ab") as log:
        process.proc = subprocess.Popen(
            [sys.executable, *process.args], env=process.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
    return process


def test_a_run_over_mutual_tls_passes(run: Run, tmp_path: Path) -> None:
    """What a production router asks of the checker: TLS, and a client certificate it verifies."""
    ca = TestCA(tmp_path)
    router = _tls_router(run, tmp_path, ca.issue("router.local", server=True))
    checker = ca.issue("shard-router-check")
    try:
        code, verdict = _check(
            *("--target", router.address, "--databases", str(run.databases)),
            *("--tls-ca", str(checker.ca), "--tls-cert", str(checker.cert), "--tls-key", str(checker.key)),
            *("--history", str(tmp_path / "tls.jsonl"), "--operations", "40", "--concurrency", "4"),
            *("--seed", "5", "--accounts", "4"),
        )
    finally:
        router.kill()
    assert code == 0, verdict["violations"]
    figures = verdict["figures"]
    assert figures["operations"] == 4 + 40 + 2 and figures["pending"] == 0, figures
    assert figures["replays"] > 0 and figures["cross_shard"] + figures["same_shard"] > 0, figures


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--tls-cert", "a.pem"), "--tls-cert and --tls-key go together"),
        (("--tls-cert", "a.pem", "--tls-key", "k.pem"), "--tls-cert needs --tls-ca"),
        (("--tls-ca", "missing-ca.pem"), "--tls-ca missing-ca.pem: no such file"),
    ],
)
def test_tls_flags_that_cannot_work_are_refused(flags: tuple[str, ...], said: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [*installed_command("shard-router"), "check", "--dsn", "shard-0=postgresql://x/y", *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and said in done.stderr, done.stderr
