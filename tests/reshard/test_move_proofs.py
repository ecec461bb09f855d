"""What a move proves before it commits and before it deletes: verification on a subscriber proven
still (disabled, no worker, every table ready, no apply error or conflict since it was made), both
sides of every account it names, a clean-up that deletes only the rows verified, and a subscription
whose streaming mode is chosen (off: a transaction larger than logical_decoding_work_mem is spilled
on the old owner and sent whole, never handed to parallel apply workers mid-stream)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml

from shardrouter.core.shardmap import load_shard_map
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.reshard.move import PUBLISHED, Move, MoveSettings, find_move, start_move
from shardrouter.reshard.plan import MoveError, Phase
from shardrouter.reshard.verify import rows_in_range
from tests.processes import Paused, run_to_failpoint
from tests.reshard.cluster import FIRST, LAST, SEEDED, Pair, accounts, seed

QUICK = MoveSettings(copy_timeout_s=30, catch_up_timeout_s=30, final_sync_timeout_s=30)


def _as_apply_worker(pair: Pair, shard: str, statement: str, params: tuple[object, ...] = ()) -> None:
    """Run a write the way a replication apply worker does: fence triggers skipped."""
    with psycopg.connect(pair.dsns[shard], autocommit=True) as conn, conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(statement, params)


def _wait_for(check: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _subscription(pair: Pair, name: str) -> list[tuple[object, ...]]:
    return pair.sql(
        "shard-1",
        "SELECT s.subenabled, s.substream, (SELECT count(*) FROM pg_stat_subscription w"
        " WHERE w.subid = s.oid AND w.pid IS NOT NULL) FROM pg_subscription s WHERE s.subname = %s",
        (name,),
    )


def test_verification_stops_the_subscription_and_refuses_after_a_skipped_change(pair: Pair) -> None:
    moving, _ = accounts(pair, 3)
    seed(pair, moving)
    ghost = next(a for a in accounts(pair, 20)[0] if a not in moving)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    name = record.plan.object_name
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.COPIED)
        pair.sql("shard-0", "INSERT INTO accounts (id, currency) VALUES (%s, 'EUR') RETURNING id", (ghost,))
        _wait_for(
            lambda: pair.sql("shard-1", "SELECT 1 FROM accounts WHERE id = %s", (ghost,)), "not replicated"
        )
        # The new owner loses the row; the old owner then updates and deletes it: PostgreSQL skips
        # both changes (counted as conflicts, logged), and both sides end without the row, so the
        # tables and balances alone would agree.
        _as_apply_worker(pair, "shard-1", "DELETE FROM accounts WHERE id = %s", (ghost,))
        pair.sql("shard-0", "UPDATE accounts SET balance = balance WHERE id = %s RETURNING id", (ghost,))
        pair.sql("shard-0", "DELETE FROM accounts WHERE id = %s RETURNING id", (ghost,))
        move.run(until=Phase.FENCED)
        with pytest.raises(MoveError) as failed:
            move.run(until=Phase.VERIFIED)
        # Verified still: disabled, no worker.
        assert _subscription(pair, name) == [(False, "f", 0)]
        assert find_move(pair.databases, record.plan.move_id).phase is Phase.FENCED  # stopped there
        move.abort()  # (a subscription is in a catalog every database of the server shares)
    message = str(failed.value)
    assert "the subscription met conflicts since it was made" in message
    assert "'confl_update_missing': 1" in message and "'confl_delete_missing': 1" in message
    assert "stream: final position " in message and "origin applied up to " in message


def test_a_verification_failure_shows_both_sides_of_the_accounts_it_names(pair: Pair) -> None:
    moving, _ = accounts(pair, 3)
    seed(pair, moving)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.FENCED)
        _as_apply_worker(
            pair, "shard-1", "UPDATE accounts SET balance = balance + 7 WHERE id = %s", (moving[1],)
        )
        with pytest.raises(MoveError) as failed:
            move.run(until=Phase.VERIFIED)
        # Both databases kept as verification found them, for whoever looks into it: the move
        # stopped at its phase with every row on both sides, the subscription and slot in place,
        # and the failure in its journal (a resumed move verifies again; an abort rolls back).
        kept = find_move(pair.databases, record.plan.move_id)
        assert kept.phase is Phase.FENCED
        assert kept.figures["verify_failed"] == str(failed.value)
        with (
            psycopg.connect(pair.dsns["shard-0"], autocommit=True) as source,
            psycopg.connect(pair.dsns["shard-1"], autocommit=True) as target,
        ):
            assert rows_in_range(source, record.plan) == rows_in_range(target, record.plan)
        assert _subscription(pair, record.plan.object_name) == [(False, "f", 0)]
        assert pair.sql(
            "shard-0", "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (record.plan.object_name,)
        ) == [(1,)]
        move.abort()
    message = str(failed.value)
    # The stream's positions and the subscription's counters, then both sides of the account.
    assert re.search(
        r"stream: final position [0-9A-F]+/[0-9A-F]+, slot confirmed [0-9A-F]+/[0-9A-F]+, "
        r"origin applied up to [0-9A-F]+/[0-9A-F]+; counters \{.*'confl_update_missing': 0", message
    ), message
    assert "1 moved account(s) whose balance is not the sum of their ledger; on the old owner 0" in message
    assert "1 moved account(s) differ between the old owner and the new" in message
    assert (
        f"{moving[1]}: old owner balance {SEEDED}, ledger sum {SEEDED}, 1 entries, newest first: [deposit {SEEDED}]; "
        f"new owner balance {SEEDED + 7}, ledger sum {SEEDED} (off by 7), 1 entries" in message
    )


def _reshard(pair: Pair, databases: Path, *args: str) -> list[str]:
    command = [sys.executable, "-m", "shardrouter.localcluster.command", "reshard", *args]
    return [*command, "--map", str(pair.map_path), "--databases", str(databases)]


def test_clean_up_refuses_to_delete_rows_that_changed_after_verification(pair: Pair, tmp_path: Path) -> None:
    moving, _ = accounts(pair, 3)
    seed(pair, moving)
    databases = tmp_path / "databases.yaml"
    databases.write_text(yaml.safe_dump(pair.dsns), encoding="utf-8")

    def straggler(_: Paused) -> None:
        # Committed, handed over, published, not yet cleaned up: a write into the old owner's range
        # that no replication carried (a writer the drain missed).
        _as_apply_worker(
            pair, "shard-0", "UPDATE accounts SET balance = balance + 1 WHERE id = %s", (moving[0],)
        )

    killed = run_to_failpoint(
        _reshard(pair, databases, "--slots", f"{FIRST}-{LAST}", "--to", "shard-1"),
        PUBLISHED,
        while_paused=straggler,
    )
    found = re.search(r"move (m\w+):", killed.output)
    assert found, killed.output
    move_id = found[1]
    resumed = subprocess.run(
        _reshard(pair, databases, "resume", move_id), capture_output=True, text=True, timeout=120, check=False
    )
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    assert "are not the rows verified" in resumed.stderr and "accounts: [" in resumed.stderr
    assert "nothing is deleted" in resumed.stderr
    record = find_move(pair.databases, move_id)
    assert record.phase is Phase.COMMITTED
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        assert sum(rows_in_range(conn, record.plan).values()) > 0
    assert pair.sql("shard-0", "SELECT balance FROM accounts WHERE id = %s", (moving[0],)) == [(SEEDED + 1,)]


@pytest.fixture
def small_decoding_memory(postgres: LocalPostgres) -> Iterator[None]:
    """logical_decoding_work_mem at its minimum (64 kB) on the session server, so a modest
    transaction is one PostgreSQL would stream."""
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
        conn.execute("SELECT pg_reload_conf()")
    yield
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM RESET logical_decoding_work_mem")
        conn.execute("SELECT pg_reload_conf()")


@pytest.mark.usefixtures("small_decoding_memory")
def test_a_move_carries_a_transaction_larger_than_the_decoding_memory_without_streaming_it(
    pair: Pair,
) -> None:
    moving, _ = accounts(pair, 3)
    seed(pair, moving)
    slots = load_shard_map(pair.map_path).slots
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    name = record.plan.object_name
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.COPIED)
        # One transaction of a few thousand rows in the range (some hundred kB decoded): larger
        # than the decoding memory, so with streaming it would go to the subscriber mid-transaction.
        with psycopg.connect(pair.dsns["shard-0"]) as conn:
            big = conn.execute(
                "INSERT INTO accounts (id, currency) SELECT 'big-' || g, 'EUR' FROM generate_series(1, 12000) g"
                " WHERE account_hash('big-' || g) %% %s BETWEEN %s AND %s",
                (slots, FIRST, LAST),
            ).rowcount
            conn.commit()
        assert big > 2000
        move.run(until=Phase.FENCED)
        stats = pair.sql(
            "shard-0",
            "SELECT spill_txns, stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s",
            (name,),
        )
        assert _subscription(pair, name)[0][1] == "f"  # streaming = off
        move.run()
    assert stats and stats[0][0] >= 1 and stats[0][1] == 0, stats  # spilled there, never streamed
    assert record.phase is Phase.DONE
    assert pair.count("shard-1", "SELECT count(*) FROM accounts WHERE id LIKE 'big-%%'") == big
