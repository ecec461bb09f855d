"""Resuming a move whose world changed while it was stopped: the old owner's server is reached at
another address now (a restarted local cluster takes new ports; a failed-over primary is another
host), so the subscription it left must follow the DSN it is given when it resumes."""

from __future__ import annotations

import shutil
from pathlib import Path

import psycopg
from psycopg import sql

from shardrouter.core.shardmap import load_shard_map
from shardrouter.reshard import cli
from shardrouter.reshard.move import Move, MoveSettings, find_move, start_move
from shardrouter.reshard.plan import Phase
from tests.reshard.cluster import FIRST, LAST, Pair, accounts, assert_no_leftovers, check_ledger, seed

QUICK = MoveSettings(copy_timeout_s=20, catch_up_timeout_s=20, final_sync_timeout_s=20)


def test_a_resumed_move_points_its_subscription_at_the_old_owner_where_it_is_now(pair: Pair) -> None:
    moving, staying = accounts(pair, 3)
    seed(pair, moving + staying)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.COPIED)
    name = record.plan.object_name
    # What the subscription knows is an address where nothing listens any more.
    with psycopg.connect(pair.dsns["shard-1"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER SUBSCRIPTION {} CONNECTION {}").format(
                sql.Identifier(name), sql.Literal("host=127.0.0.1 port=1 dbname=gone connect_timeout=1")
            )
        )
    seed(pair, moving, 1)  # changes the stream must still carry to the new owner
    resumed = find_move(pair.databases, record.plan.move_id)
    with Move(resumed, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run()
    assert resumed.phase is Phase.DONE
    assert all(pair.owner(a) == "shard-1" for a in moving)
    check_ledger(pair, len(moving) + len(staying), len(moving))
    assert_no_leftovers(pair)


def test_the_new_owner_reaches_the_old_one_by_the_replication_dsn_given(pair: Pair) -> None:
    moving, _ = accounts(pair, 2)
    seed(pair, moving)
    by_another_name = pair.dsns["shard-0"] + "?application_name=shardrouter-move"
    common = ["--map", str(pair.map_path), *(f"--dsn={s}={d}" for s, d in pair.dsns.items())]
    common.append(f"--replication-dsn=shard-0={by_another_name}")
    assert cli.main(["--slots", f"{FIRST}-{LAST}", "--to", "shard-1", "--stop-after", "copied", *common]) == 0
    with psycopg.connect(pair.dsns["shard-1"], autocommit=True) as conn:
        # pg_subscription is shared by every database of the server: this database's alone.
        subscriptions = conn.execute(
            "SELECT subconninfo FROM pg_subscription"
            " WHERE subdbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
        assert subscriptions == [(by_another_name,)]
    (move_id,) = pair.sql("shard-0", "SELECT move_id FROM slot_moves")[0]
    assert cli.main(["resume", str(move_id), *common]) == 0
    assert all(pair.owner(a) == "shard-1" for a in moving)
    assert_no_leftovers(pair)


def test_a_resume_publishes_the_committed_map_where_it_is_told_to(pair: Pair, tmp_path: Path) -> None:
    moving, _ = accounts(pair, 2)
    seed(pair, moving)
    before = tmp_path / "published-before.yaml"
    shutil.copy(pair.map_path, before)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.COMMITTED)
    # Resumed against a copy of the map from before the commit (a store nobody published to): the
    # commit recorded in the databases is published there before the old rows go.
    with Move(record, map_store=before, databases=pair.databases, settings=QUICK) as move:
        move.run()
    assert record.phase is Phase.DONE
    published = load_shard_map(before)
    assert published == load_shard_map(pair.map_path)
    assert published.version == record.figures["map_version"]
    assert all(pair.owner(a, published) == "shard-1" for a in moving)
    assert pair.sql("shard-0", "SELECT count(*) FROM accounts WHERE id = ANY(%s)", (moving,)) == [(0,)]
    assert_no_leftovers(pair)
