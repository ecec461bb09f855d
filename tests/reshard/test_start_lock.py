"""Two moves of one range started at once: only one is journaled. The first start holds a lock on
both shards' databases from its checks to its journal entry, and a second start meanwhile is told
to try again instead of passing the same checks and journaling a second, overlapping move."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from shardrouter.reshard import move as move_module
from shardrouter.reshard.move import START_CHECKED, Move, MoveError, MoveSettings, start_move
from tests.processes import Paused, run_to_failpoint
from tests.reshard.cluster import FIRST, LAST, Pair, assert_no_leftovers


def test_a_start_while_another_is_between_its_checks_and_its_journal_is_refused(
    pair: Pair, tmp_path: Path
) -> None:
    databases = tmp_path / "databases.yaml"
    databases.write_text(yaml.safe_dump(pair.dsns), encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "shardrouter.localcluster.command",
        "reshard",
        "--slots",
        f"{FIRST}-{LAST}",
        "--to",
        "shard-1",
        "--map",
        str(pair.map_path),
        "--databases",
        str(databases),
    ]

    def refused_meanwhile(_: Paused) -> None:
        # The same range, and a range inside it: both refused while the first holds the start lock.
        for first_slot, last_slot in ((FIRST, LAST), (FIRST, FIRST)):
            with pytest.raises(MoveError, match="another move is being started on shard-0 right now"):
                start_move(pair.map_path, pair.databases, first_slot, last_slot, "shard-1")

    run_to_failpoint(command, START_CHECKED, while_paused=refused_meanwhile)
    # Killed before it journaled anything: its lock went with its connections, and a start goes on.
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=MoveSettings()) as move:
        move.abort()
    assert_no_leftovers(pair)


def test_a_start_lets_its_lock_go_before_it_returns(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    # A closed connection's backend drops its locks only once it has exited: a start that left its
    # lock to the closing of its sessions refused the next start meanwhile ("another move is being
    # started"). Here its sessions stay open after it returns, as a backend still exiting would.
    kept: list[psycopg.Connection[Any]] = []
    opened = move_module._connect

    def connect_kept_open(dsn: str) -> psycopg.Connection[Any]:
        conn = opened(dsn)
        setattr(conn, "close", lambda: None)  # noqa: B010 (shadows the method on this instance)
        kept.append(conn)
        return conn

    try:
        with monkeypatch.context() as patched:
            patched.setattr(move_module, "_connect", connect_kept_open)
            records = [
                start_move(pair.map_path, pair.databases, FIRST, FIRST + 9, "shard-1"),
                start_move(pair.map_path, pair.databases, LAST - 9, LAST, "shard-1"),
            ]
    finally:
        for conn in kept:
            psycopg.Connection.close(conn)
    for record in records:
        with Move(record, map_store=pair.map_path, databases=pair.databases, settings=MoveSettings()) as move:
            move.abort()
    assert_no_leftovers(pair)
