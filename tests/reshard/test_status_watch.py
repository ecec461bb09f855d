"""`shard-router reshard status --watch`: lines while a move is active, and the end once it is done
or aborted (finished meanwhile by another orchestrator, here a thread), or on Ctrl-C.

The command runs in this process (`shardrouter.reshard.cli.main`) against two real shards over two
databases of a real PostgreSQL (`conftest.pair`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from shardrouter.reshard import cli
from shardrouter.reshard.journal import MoveRecord
from shardrouter.reshard.move import Move, MoveSettings, find_move, start_move
from shardrouter.reshard.plan import Phase
from tests.reshard.cluster import FIRST, LAST, Pair, accounts, seed

QUICK = MoveSettings(copy_timeout_s=30, catch_up_timeout_s=30, final_sync_timeout_s=30)
#: A line of the watch: time, then the move's phase and the step under way.
PROGRESS = re.compile(
    r"^\d\d:\d\d:\d\d (?P<move>\S+): slots \d+-\d+ shard-0 -> shard-1, (?P<phase>[a-z_]+) "
    r"\((?P<step>[a-z ]+) for (>= )?\d+ s\); rows copied (?P<rows>\d+); lag (?P<lag>\d+ bytes|-)"
)


def dsn_args(pair: Pair) -> list[str]:
    return [arg for sid, dsn in pair.dsns.items() for arg in ("--dsn", f"{sid}={dsn}")]


def stopped_move(pair: Pair, at: Phase) -> MoveRecord:
    """A move of the test range with a few accounts, run until `at` and left there."""
    moving, _ = accounts(pair, 4)
    seed(pair, moving)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=at)
    return record


@contextmanager
def meanwhile(pair: Pair, move_id: str, finish: Callable[[Move], object]) -> Iterator[None]:
    """Another orchestrator that picks the move up from its journal after a second and finishes it."""
    failures: list[BaseException] = []

    def orchestrate() -> None:
        try:
            time.sleep(1.0)
            record = find_move(pair.databases, move_id)
            with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
                finish(move)
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    thread = threading.Thread(target=orchestrate, daemon=True)
    thread.start()
    yield
    thread.join(60)
    assert not thread.is_alive() and failures == []


def test_watch_prints_a_stopped_move_until_another_orchestrator_finishes_it(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    record = stopped_move(pair, Phase.COPIED)
    move_id = record.plan.move_id
    capsys.readouterr()
    started = time.monotonic()
    with meanwhile(pair, move_id, lambda move: move.run()):
        code = cli.main(["status", "--watch", move_id, "--interval", "0.1", *dsn_args(pair)])
    assert code == 0
    assert time.monotonic() - started < 60
    lines = capsys.readouterr().out.splitlines()
    progress = [m for m in map(PROGRESS.match, lines) if m]
    assert len(progress) >= 5, lines  # a second of looks while the move waits, at least
    first = progress[0]
    assert (first["move"], first["phase"], first["step"]) == (move_id, "copied", "catching up")
    assert int(first["rows"]) == record.figures["rows_copied"] > 0
    assert first["lag"].endswith("bytes")  # live, from the slot on the old owner
    # Under way at the first look: the time in the phase is a lower bound; and the copy's seconds.
    assert "(catching up for >= " in lines[0] and "seconds: prepare " in lines[0] and "copy " in lines[0]
    # The last line is the finished move, and nothing comes after it.
    assert move_id in lines[-1] and ", done; rows moved " in lines[-1] and "write pause" in lines[-1]
    assert not PROGRESS.match(lines[-1])


def test_watch_of_every_move_ends_when_the_move_is_aborted(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    record = stopped_move(pair, Phase.PREPARED)
    capsys.readouterr()
    with meanwhile(pair, record.plan.move_id, lambda move: move.abort()):
        code = cli.main(["status", "--watch", "--interval", "0.1", *dsn_args(pair)])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert PROGRESS.match(lines[0]) and "prepared (copying for >= " in lines[0]
    assert f"{record.plan.move_id}: slots {FIRST}-{LAST} shard-0 -> shard-1, aborted" in lines[-1]


def test_watch_ends_at_once_without_an_active_move(pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--watch", *dsn_args(pair)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(" no active moves")
    # A finished move named on the command line: its last state, once.
    record = stopped_move(pair, Phase.PLANNED)
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.abort()
    capsys.readouterr()
    assert cli.main(["status", "--watch", record.plan.move_id, *dsn_args(pair)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert f"{record.plan.move_id}: slots" in line and ", aborted" in line


def test_ctrl_c_ends_the_watch_with_0_and_leaves_the_move(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    record = stopped_move(pair, Phase.PLANNED)

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    capsys.readouterr()
    assert cli.watch_moves(pair.databases, record.plan.move_id, interval_s=5, sleep=interrupted) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert PROGRESS.match(line) and "planned (preparing for >= 0 s)" in line and "lag -" in line
    assert find_move(pair.databases, record.plan.move_id).phase is Phase.PLANNED


def test_watch_is_refused_where_it_has_no_meaning(pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["resume", "m1", "--watch", *dsn_args(pair)]) == 2
    assert "--watch goes with status" in capsys.readouterr().err
    assert cli.main(["status", "--watch", "--json", *dsn_args(pair)]) == 2
    assert "leave out --json" in capsys.readouterr().err
    assert cli.main(["status", "--watch", "--interval", "0", *dsn_args(pair)]) == 2
    assert "--interval 0.0: give a positive number" in capsys.readouterr().err
