"""Two moves of one range started at once: only one is journaled. The first start holds a lock on
both shards' databases from its checks to its journal entry, and a second start meanwhile is told
to try again instead of passing the same checks and journaling a second, overlapping move."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from shardrouter.reshard.move import Move, MoveError, MoveSettings, start_move
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

    run_to_failpoint(command, "reshard.start_checked", while_paused=refused_meanwhile)
    # Killed before it journaled anything: its lock went with its connections, and a start goes on.
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=MoveSettings()) as move:
        move.abort()
    assert_no_leftovers(pair)
