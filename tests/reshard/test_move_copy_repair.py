"""A move's copy that PostgreSQL can no longer finish by itself is started again; one aborted in
the middle leaves no table sync slot behind.

A table sync worker that finished its table's copy (state `f`) then streams from its own slot on
the old owner until it has caught up, and drops that slot in the transaction that records the table
synced. When the old owner's server dies after the drop is done but before the worker hears so,
that transaction rolls back: the table stays `f` and its slot is gone, and PostgreSQL never copies a
table in state `f` again nor makes its slot anew, so every later start of the worker fails ("replication
slot ... does not exist" in the new owner's log every few seconds) and the copy never ends: the
symptom a move resumed after the old owner's PostgreSQL was SIGKILLed during the copy showed now
and then (`test_move_faults`: the copy ran out of time with a table in `f`, errors counted).

Here that state is made on purpose, the same every run, with the old owner on a server of its own:
the `accounts` COPY waits on the new owner for an id held there uncommitted, so an account inserted
on the old owner meanwhile commits after the copy's snapshot and reaches the new owner through the
worker's catch-up; that id held uncommitted too keeps the worker waiting there, in state `f`, while
its slot is dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from shardrouter.core.shardmap import even_shard_map, write_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.reshard import replication
from shardrouter.reshard.move import Move, MoveSettings, find_move, start_move
from shardrouter.reshard.plan import MoveError, Phase
from tests.helpers import own_postgres
from tests.reshard.cluster import (
    FIRST,
    LAST,
    Pair,
    accounts,
    assert_no_leftovers,
    check_ledger,
    seed,
    start_daemons,
)

QUICK = MoveSettings(copy_timeout_s=30, catch_up_timeout_s=20, final_sync_timeout_s=20)
SOURCE, TARGET = "shard-0", "shard-1"


def _wait(what: str, ready: Callable[[], object], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def old_owner_server() -> Iterator[LocalPostgres]:
    """The old owner's own server: a transaction held open on the new owner's must not be one its
    table sync slots wait for while they are made (a slot waits for every running transaction id
    of its server)."""
    yield from own_postgres()


@pytest.fixture
def split_pair(postgres: LocalPostgres, old_owner_server: LocalPostgres, tmp_path: Path) -> Iterator[Pair]:
    """Two shards' databases on two servers, with their in-process daemons (as the `pair` fixture)."""
    ports = {SOURCE: free_port(), TARGET: free_port()}
    map_path = tmp_path / "shard-map.yaml"
    write_shard_map(map_path, even_shard_map({s: f"127.0.0.1:{p}" for s, p in ports.items()}, version=1))
    dsns = {}
    for sid, server in ((SOURCE, old_owner_server), (TARGET, postgres)):
        name = f"cr{uuid.uuid4().hex[:10]}"
        server.create_database(name)
        dsns[sid] = server.dsn_for(name)
    pair = Pair(map_path, dsns, ports)
    daemons = start_daemons(pair)
    yield pair
    pair.close()
    for daemon in daemons.values():
        daemon.stop(0.2)


def _sync_slot(pair: Pair, relid: int) -> str | None:
    rows = pair.sql(
        SOURCE,
        "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
        " AND slot_name LIKE %s",
        (f"pg\\_%\\_sync\\_{relid}\\_%",),
    )
    return str(rows[0][0]) if rows else None


def _tablesync_waiting(pair: Pair, relid: int, state: str) -> bool:
    """Whether the table's sync worker waits on a row another transaction holds, the table in `state`."""
    return bool(
        pair.sql(
            TARGET,
            "SELECT 1 FROM pg_stat_subscription s JOIN pg_stat_activity a ON a.pid = s.pid"
            " JOIN pg_subscription_rel r ON r.srsubid = s.subid AND r.srrelid = s.relid"
            " WHERE s.relid = %s AND a.wait_event_type = 'Lock' AND r.srsubstate = %s",
            (relid, state),
        )
    )


def _hold(conn: psycopg.Connection[Any], account: str, currency: str) -> None:
    """Insert the account on the new owner in `conn`'s transaction, left open (as a replica, so the
    move's fence there lets it in): whoever inserts the same id next waits for it."""
    conn.execute("SET LOCAL session_replication_role = replica")
    conn.execute(
        "INSERT INTO accounts (id, currency, account_hash) VALUES (%s, %s, account_hash(%s))",
        (account, currency, account),
    )


def _strand_accounts(pair: Pair, name: str, copied: str, newcomer: str) -> None:
    """Subscribe as the move's copy does, and leave `accounts` in state `f` without its sync slot:
    its COPY waits on `copied` (held on the new owner) until `newcomer` is committed on the old owner
    after the copy's snapshot, then its catch-up waits on `newcomer` (held too) while the slot goes."""
    relid = int(pair.sql(TARGET, "SELECT 'accounts'::regclass::oid")[0][0])  # type: ignore[call-overload]
    currency = str(pair.sql(SOURCE, "SELECT currency FROM accounts LIMIT 1")[0][0])
    with (
        psycopg.connect(pair.dsns[TARGET]) as copy_holder,
        psycopg.connect(pair.dsns[TARGET]) as catch_up_holder,
        psycopg.connect(pair.dsns[TARGET], autocommit=True) as target,
        psycopg.connect(pair.dsns[SOURCE], autocommit=True) as source,
    ):
        _hold(copy_holder, copied, currency)
        _hold(catch_up_holder, newcomer, currency)
        replication.create_subscription(
            target, name, source_conninfo=pair.dsns[SOURCE], publication=name, slot=name
        )
        _wait("the accounts COPY waiting", lambda: _tablesync_waiting(pair, relid, "d"))
        source.execute("INSERT INTO accounts (id, currency) VALUES (%s, %s)", (newcomer, currency))
        inserted = replication.current_lsn(source)
        _wait(
            "the apply worker past the insert",
            lambda: target.execute(
                "SELECT 1 FROM pg_stat_subscription WHERE subname = %s AND relid IS NULL"
                " AND received_lsn >= %s::pg_lsn",
                (name, inserted),
            ).fetchone(),
        )
        copy_holder.rollback()
        _wait("the accounts catch-up waiting", lambda: _tablesync_waiting(pair, relid, "f"))
        slot = _sync_slot(pair, relid)
        assert slot is not None
        replication.drop_slot(source, slot, timeout_s=0)  # ends its walsender first
        catch_up_holder.rollback()
    with psycopg.connect(pair.dsns[TARGET], autocommit=True) as target:
        assert replication.copy_state(target, name).states["accounts"] == "f"


def test_a_table_left_copied_without_its_sync_slot_is_copied_again(split_pair: Pair) -> None:
    pair = split_pair
    moving, staying = accounts(pair, 4)
    seed(pair, moving[:3] + staying)
    newcomer = moving[3]
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, TARGET)
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.PREPARED)
    name = record.plan.object_name
    _strand_accounts(pair, name, moving[0], newcomer)
    # Stuck for good: the worker fails at each start ("replication slot ... does not exist", every
    # wal_retrieve_retry_interval, 5 s), and nothing makes the slot again.
    time.sleep(6)
    with (
        psycopg.connect(pair.dsns[TARGET], autocommit=True) as target,
        psycopg.connect(pair.dsns[SOURCE], autocommit=True) as source,
    ):
        assert replication.stranded_tables(source, target, name) == ["accounts"]
    # A new orchestrator resumes the move from its journal: the copy starts again and finishes.
    resumed = find_move(pair.databases, record.plan.move_id)
    assert resumed.phase is Phase.PREPARED
    with Move(resumed, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run()
    assert resumed.phase is Phase.DONE
    assert resumed.figures["copy_restarts"] == 1
    assert resumed.figures["copy_restarted_for"] == ["accounts"]
    assert all(pair.owner(a) == TARGET for a in moving)
    assert pair.sql(TARGET, "SELECT balance FROM accounts WHERE id = %s", (newcomer,)) == [(0,)]
    check_ledger(pair, len(moving) - 1 + len(staying), 0)
    assert_no_leftovers(pair)


def test_a_copy_that_stays_stranded_is_given_up_after_a_few_restarts(split_pair: Pair) -> None:
    """Bounded: once a run's restarts (`copy_restarts`) ran out, a stranded copy is an error that
    says to abort, not a copy started again forever."""
    pair = split_pair
    moving, staying = accounts(pair, 2)
    seed(pair, moving + staying)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, TARGET)
    settings = MoveSettings(copy_timeout_s=60, copy_restarts=0)
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=settings) as move:
        move.run(until=Phase.PREPARED)
        _strand_accounts(pair, record.plan.object_name, moving[0], accounts(pair, 3)[0][2])
        with pytest.raises(MoveError, match=r"accounts.*sync slot.*abort"):
            move.run()
        move.abort()
    assert_no_leftovers(pair)


def test_an_abort_during_the_copy_drops_the_sync_slots_the_new_owner_cannot_reach(split_pair: Pair) -> None:
    """An abort while a table is being copied, the new owner's server unable to reach the old owner
    (DROP SUBSCRIPTION then leaves the table sync slots there): the abort drops them itself."""
    pair = split_pair
    moving, staying = accounts(pair, 2)
    seed(pair, moving + staying)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, TARGET)
    name = record.plan.object_name
    relid = int(pair.sql(TARGET, "SELECT 'accounts'::regclass::oid")[0][0])  # type: ignore[call-overload]
    currency = str(pair.sql(SOURCE, "SELECT currency FROM accounts LIMIT 1")[0][0])
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.PREPARED)
        with (
            psycopg.connect(pair.dsns[TARGET]) as copy_holder,
            psycopg.connect(pair.dsns[TARGET], autocommit=True) as target,
        ):
            _hold(copy_holder, moving[0], currency)  # the accounts COPY waits on it
            replication.create_subscription(
                target, name, source_conninfo=pair.dsns[SOURCE], publication=name, slot=name
            )
            _wait("the accounts COPY waiting", lambda: _tablesync_waiting(pair, relid, "d"))
            assert _sync_slot(pair, relid) is not None
            # From now on the new owner's server reaches nothing there.
            target.execute(
                sql.SQL("ALTER SUBSCRIPTION {} CONNECTION {}").format(
                    sql.Identifier(name), sql.Literal(f"host=127.0.0.1 port={free_port()} connect_timeout=1")
                )
            )
            move.abort()
            copy_holder.rollback()
    assert record.phase is Phase.ABORTED
    assert _sync_slot(pair, relid) is None
    assert_no_leftovers(pair)
