"""The pgbench scripts the bench writes (bench/pgbench.py): the limit's generated ids draw on random
numbers of their full ranges, so that ids do not collide within a run."""

from __future__ import annotations

import re
import uuid

from bench.pgbench import Captured, Statement, limit_script, script_from_capture
from shardrouter.core.keys import new_key

_KEY_BITS = {"4095", "4611686018427387903"}  # bench_key(r1, r2): 12 bits, then 62 (74 of them random)


def _deposit() -> Captured:
    sql = (
        "WITH stored AS (INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, response)"
        " VALUES ($1, $2, $3, $4, $5, $6) RETURNING key) SELECT 1"
    )
    params: dict[int, str | None] = {
        1: "/shardrouter.v1.TransferService/Deposit|bench",
        2: str(uuid.uuid4()),
        3: "2026-12-06 10:00:00+00",
        4: "/shardrouter.v1.TransferService/Deposit",
        5: "\\x00",
        6: "\\x0a01",
    }
    return Captured("deposit", [Statement(sql, params)], uuid.uuid4(), ("1",), 5)


def test_the_limits_ledger_entry_id_has_random_numbers_of_its_own_of_full_range() -> None:
    script = limit_script(_deposit())
    ranges = dict(re.findall(r"^\\set (\w+) random\(0, (\d+)\)$", script, re.MULTILINE))
    (key_args,) = re.findall(r"VALUES \([^,]+, bench_key\(:(\w+), :(\w+)\)", script)
    (entry_args,) = re.findall(r"SELECT bench_key\(:(\w+), :(\w+)\), id", script)
    for first, second in (key_args, entry_args):
        assert (ranges.get(first), ranges.get(second)) == ("4095", "4611686018427387903"), script
    assert set(key_args).isdisjoint(entry_args), "the entry id would repeat the key's random numbers"
    assert set(ranges.values()) == _KEY_BITS


def _claimed_ahead(claim_sql: str) -> Captured:
    statements = [
        Statement(claim_sql, {1: "scope"}),
        Statement("SELECT current_setting('shardrouter.key_claimed')::bool"),
        Statement("BEGIN"),
        Statement("UPDATE accounts SET balance = balance + 1 WHERE id = $1", {1: "1"}),
        Statement("COMMIT"),
    ]
    return Captured("deposit", statements, new_key(), ("1",), 5)


def test_statements_sent_ahead_of_begin_with_local_settings_share_one_pipeline() -> None:
    """A claim sent ahead of BEGIN notes its outcome in a transaction-local setting that the next
    statement reads: pgbench must send them in one pipeline, as the shard does, or each is a
    transaction of its own and the note is gone."""
    claim = "SELECT c.*, set_config('shardrouter.key_claimed', coalesce(c.locked, false)::text, true) FROM c"
    lines = script_from_capture(_claimed_ahead(claim)).splitlines()
    statements = [line for line in lines if not line.startswith(("--", "\\set"))]
    assert statements[0] == "\\startpipeline" and statements[1].startswith("SELECT c.*")
    assert statements[-2:] == ["COMMIT;", "\\endpipeline"]
    # a claim sent on its own (no transaction-local setting before BEGIN) stays as it was
    alone = script_from_capture(_claimed_ahead("SELECT * FROM idempotency_claim($1)"))
    assert "pipeline" not in alone
