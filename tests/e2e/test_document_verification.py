"""The source document's own verification, run as written against `shard-router dev up`.

Only the host is changed (`http://127.0.0.1:PORT` for `https://api.internal`), and the account id is
quoted in the SQL (account ids are text here). Account 8842 is funded (and 1190 opened) first.
"""

from __future__ import annotations

import json
import signal
import subprocess

import psycopg
import yaml

from shardrouter.localcluster.postgres import free_port
from tests.e2e.test_dev_cluster import _dev_up, _until_running, _wait_no_leftovers
from tests.helpers import pg_data_dir
from tests.processes import ROOT

# Verbatim from the document, but for the host.
VERIFICATION = """\
for i in $(seq 1 20); do
  curl -sS -X POST https://api.internal/transfers \\
    -H 'Idempotency-Key: 9f1c2d64-0a1e-4f7c-9d2b-3d8e5c1a77f0' \\
    -H 'Content-Type: application/json' \\
    -d '{"src":8842,"dst":1190,"amount":2500}' &
done; wait
"""
COUNT = """\
SELECT count(*) FROM ledger_entries
WHERE  kind = 'transfer_out' AND account_id = '8842'
  AND  created_at > now() - interval '5 minutes';
"""


def _bodies(text: str) -> list[dict]:
    """The JSON bodies curl printed one after another (no separator between them)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if text[at].isspace():
            at += 1
            continue
        body, at = decoder.raw_decode(text, at)
        found.append(body)
    return found


def _curl(base: str, path: str, key: str, body: str) -> str:
    return subprocess.run(
        ["curl", "-sS", "-X", "POST", base + path, "-H", f"Idempotency-Key: {key}",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout


def test_twenty_parallel_curls_with_one_key_apply_once() -> None:
    data_dir = pg_data_dir().parent / "cluster-doc"
    http_port = free_port()
    proc = _dev_up(data_dir, free_port(), "--no-demo", "--no-metrics", "--http-port", str(http_port))
    try:
        _until_running(proc, timeout_s=120)
        base = f"http://127.0.0.1:{http_port}"
        _curl(base, "/v1/deposits", "fund-8842", '{"accountId":"8842","amount":{"amountMinor":"100000","currency":"EUR"}}')
        _curl(base, "/v1/deposits", "open-1190", '{"accountId":"1190","amount":{"amountMinor":"1","currency":"EUR"}}')
        run = subprocess.run(
            ["bash", "-c", VERIFICATION.replace("https://api.internal", base)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )
        assert run.returncode == 0, run.stderr
        bodies = _bodies(run.stdout)
        assert len(bodies) == 20, run.stdout
        created = [b for b in bodies if "transfer" in b]
        conflicts = [b for b in bodies if b.get("status") == 409]
        assert created and len(created) + len(conflicts) == 20, bodies
        assert all(c["reason"] == "IDEMPOTENCY_KEY_IN_FLIGHT" for c in conflicts)
        assert all(b == created[0] for b in created), "every 201 is the stored body"
        stored = json.dumps(created[0], sort_keys=True)
        dsns = yaml.safe_load((data_dir / "databases.yaml").read_text())
        total = 0
        for dsn in dsns.values():
            with psycopg.connect(dsn) as conn:
                row = conn.execute(COUNT).fetchone()
                assert row is not None
                total += int(row[0])
        assert total == 1
        # A later retry is the stored body again, byte for byte as the first 201.
        again = _bodies(_curl(base, "/transfers", "9f1c2d64-0a1e-4f7c-9d2b-3d8e5c1a77f0",
                              '{"src":8842,"dst":1190,"amount":2500}'))
        assert [json.dumps(b, sort_keys=True) for b in again] == [stored]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert _wait_no_leftovers(data_dir) == []
