"""A move's metrics on real shard daemons: the old owner's /metrics shows the move while it is active
(phase, rows copied, live lag of its replication slot) and no longer once it ended; every shard
counts its fences by kind.

Two in-process shard daemons with /metrics on loopback over two databases of a real PostgreSQL
(wal_level=logical), following one shard map file (`cluster.new_pair`, `cluster.start_daemons`).
The tests refresh the database gauges themselves instead of waiting for the collector's next round.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.reshard.journal import MoveRecord
from shardrouter.reshard.move import Move, MoveSettings, start_move
from shardrouter.reshard.plan import ACTIVE_PHASES, Phase
from shardrouter.shardd import observability
from shardrouter.shardd.server import ShardDaemon
from tests.observability.test_metrics import Samples, collector_of, scrape, value
from tests.reshard.cluster import FIRST, LAST, Pair, accounts, new_pair, seed, start_daemons

QUICK = MoveSettings(copy_timeout_s=30, catch_up_timeout_s=30, final_sync_timeout_s=30)
FENCES = "shardd_slot_fences"
ACTIVE = "shardd_slot_move_active"


@dataclass
class MeteredPair:
    """The two shards and their daemons, each serving /metrics."""

    pair: Pair
    daemons: dict[str, ShardDaemon]

    def samples(self, shard_id: str) -> Samples:
        """The shard's /metrics right after a refresh of its database gauges."""
        daemon = self.daemons[shard_id]
        assert collector_of(daemon).refresh()
        return scrape(daemon.metrics_port)

    def move(self, record: MoveRecord) -> Move:
        return Move(record, map_store=self.pair.map_path, databases=self.pair.databases, settings=QUICK)


@pytest.fixture
def metered(postgres: LocalPostgres, tmp_path: Path) -> Iterator[MeteredPair]:
    pair = new_pair(postgres, tmp_path)
    daemons = start_daemons(pair, metrics=True)
    yield MeteredPair(pair, daemons)
    pair.close()
    for daemon in daemons.values():
        daemon.stop(0.2)


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric, by its labels."""
    return {labels: v for (n, labels), v in samples.items() if n == name}


def fences(samples: Samples) -> dict[str, float]:
    return {dict(labels)["kind"]: v for labels, v in series(samples, FENCES).items()}


def active_labels(samples: Samples) -> list[dict[str, str]]:
    return [dict(labels) for labels, v in series(samples, ACTIVE).items() if v == 1]


NO_FENCES = {"incoming": 0, "outgoing": 0, "moved_out": 0, "stale": 0}


def test_the_phases_are_those_of_the_reshard_tool() -> None:
    # shardd cannot import the reshard package above it, so it writes the order again.
    assert tuple(p.value for p in Phase) == observability.MOVE_PHASES
    assert {p.value for p in Phase if p not in ACTIVE_PHASES} == observability.FINISHED_MOVE_PHASES


def test_an_aborted_move_is_shown_while_active_then_as_the_last_finished(metered: MeteredPair) -> None:
    pair = metered.pair
    moving, _ = accounts(pair, 6)
    seed(pair, moving)
    assert fences(metered.samples("shard-0")) == NO_FENCES
    assert active_labels(metered.samples("shard-0")) == []

    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    move_id = record.plan.move_id
    planned = metered.samples("shard-0")
    assert active_labels(planned) == [
        {
            "move_id": move_id,
            "first_slot": str(FIRST),
            "last_slot": str(LAST),
            "target": "shard-1",
            "phase": "planned",
        }
    ]
    assert value(planned, "shardd_slot_move_phase_rank", move_id=move_id) == 0
    assert value(planned, "shardd_slot_move_lag_bytes", move_id=move_id) is None  # no slot yet

    with metered.move(record) as move:
        move.run(until=Phase.PREPARED)
        # The slot exists and no subscription reads it yet: every write on the old owner is lag.
        seed(pair, moving, 1)
        prepared = metered.samples("shard-0")
        lag = value(prepared, "shardd_slot_move_lag_bytes", move_id=move_id)
        assert lag is not None and lag > 0

        move.run(until=Phase.COPIED)
        copied = metered.samples("shard-0")
        assert [labels["phase"] for labels in active_labels(copied)] == ["copied"]  # one series per move
        assert value(copied, "shardd_slot_move_phase_rank", move_id=move_id) == Phase.COPIED.rank
        rows = value(copied, "shardd_slot_move_rows_copied", move_id=move_id)
        assert rows is not None and rows == record.figures["rows_copied"] >= len(moving)
        assert value(copied, "shardd_slot_move_lag_bytes", move_id=move_id) is not None
        # The new owner is fenced for the range from the prepare step on; the old owner not yet.
        assert fences(metered.samples("shard-1")) == {**NO_FENCES, "incoming": 1}
        assert fences(copied) == NO_FENCES
        # The new owner holds no journal: it shows no move.
        assert active_labels(metered.samples("shard-1")) == []

        move.abort()

    aborted = metered.samples("shard-0")
    assert active_labels(aborted) == []
    # The last finished move stays, with the rank of `aborted`; its slot is gone, so is its lag.
    assert value(aborted, "shardd_slot_move_phase_rank", move_id=move_id) == Phase.ABORTED.rank
    assert value(aborted, "shardd_slot_move_rows_copied", move_id=move_id) == rows
    assert value(aborted, "shardd_slot_move_lag_bytes", move_id=move_id) is None
    assert fences(metered.samples("shard-1")) == NO_FENCES


def test_a_finished_move_leaves_its_marker_fence_and_its_write_pause(metered: MeteredPair) -> None:
    pair = metered.pair
    moving, _ = accounts(pair, 4)
    seed(pair, moving)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    move_id = record.plan.move_id
    with metered.move(record) as move:
        move.run(until=Phase.FENCED)
        # Cutting over: both owners fenced, the old one for a move journaled in its own database.
        fenced = metered.samples("shard-0")
        assert fences(fenced) == {**NO_FENCES, "outgoing": 1}
        assert fences(metered.samples("shard-1")) == {**NO_FENCES, "incoming": 1}
        assert [labels["phase"] for labels in active_labels(fenced)] == ["fenced"]
        assert value(fenced, "shardd_slot_move_write_pause_seconds", move_id=move_id) is None
        move.run()

    done = metered.samples("shard-0")
    assert active_labels(done) == []
    assert value(done, "shardd_slot_move_phase_rank", move_id=move_id) == Phase.DONE.rank
    pause = value(done, "shardd_slot_move_write_pause_seconds", move_id=move_id)
    assert pause is not None and pause == record.figures["write_pause_s"] >= 0
    # The old owner keeps its fence as the lasting marker of the range that left; the new owner's is gone.
    assert fences(done) == {**NO_FENCES, "moved_out": 1}
    assert fences(metered.samples("shard-1")) == NO_FENCES


def test_only_active_moves_and_the_last_finished_one_have_series(metered: MeteredPair) -> None:
    """However many moves the journal holds, the gauges show the active ones and one finished."""
    pair = metered.pair
    journal = [
        ("m-old-done", "done", "2026-01-01T00:00:00Z"),
        ("m-old-aborted", "aborted", "2026-01-02T00:00:00Z"),
        ("m-last-done", "done", "2026-01-03T00:00:00Z"),
        ("m-going", "copied", "2026-01-04T00:00:00Z"),
    ]
    for move_id, phase, at in journal:
        pair.sql(
            "shard-0",
            "INSERT INTO slot_moves (move_id, slots, first_slot, last_slot, source_shard_id, target_shard_id,"
            " phase, figures, created_at, updated_at)"
            " VALUES (%s, 16384, 16000, 16001, 'shard-0', 'shard-1', %s, '{\"rows_copied\": 3}', %s, %s)"
            " RETURNING move_id",
            (move_id, phase, at, at),
        )
    # A fence that an aborted move left behind (the `stale` kind), in a range nobody writes to here.
    pair.sql(
        "shard-0",
        "INSERT INTO slot_fences (move_id, slots, first_slot, last_slot) VALUES ('m-old-aborted', 16384, 16383, 16383)"
        " RETURNING move_id",
    )
    samples = metered.samples("shard-0")
    assert {dict(labels)["move_id"] for labels in series(samples, "shardd_slot_move_phase_rank")} == {
        "m-last-done",
        "m-going",
    }
    assert [labels["move_id"] for labels in active_labels(samples)] == ["m-going"]
    assert value(samples, "shardd_slot_move_rows_copied", move_id="m-going") == 3
    assert fences(samples) == {**NO_FENCES, "stale": 1}
