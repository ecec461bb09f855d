"""A move under load through real routers, as callers see it: shard daemons and two routers as
processes, one router following the shard map file and one left on a copy of the old map for good.

Keyed Deposits and Transfers go through either router; 30 % are sent again at once through the other
one (before, during and after the cut-over). Each call is retried with its key on a transient code.
Afterwards every key is sent again through both routers: each answer must be the first one, byte
for byte; every ledger leg exists once; money is conserved; nothing of the move is left behind.

Prints the figures the README quotes: rows moved, seconds per phase, the pause callers of the moved
range saw (latency of their calls around the cut-over: p50/p99/max), the latency of other slots
before and during the move, lost and applied twice. `--run-slow` runs a longer, larger variant.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from shardrouter.core.keys import new_key
from shardrouter.reshard.move import Move, MoveSettings, start_move
from shardrouter.reshard.plan import Phase
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, money
from tests.processes import ServiceProcess, router_process, shardd_process
from tests.reshard.cluster import (
    FIRST,
    LAST,
    SEEDED,
    TRANSIENT,
    Call,
    Load,
    Pair,
    accounts,
    assert_no_leftovers,
    assert_replays_match,
    check_ledger,
    new_pair,
    until_final,
)


@dataclass
class Routers:
    """The shard daemons and routers as processes, and a channel to each router."""

    pair: Pair
    processes: list[ServiceProcess]
    following: ServiceProcess
    stale: ServiceProcess
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def stub(self, which: str) -> transfer_pb2_grpc.TransferServiceStub:
        if which not in self.channels:
            router = self.following if which == "following" else self.stale
            self.channels[which] = grpc.insecure_channel(router.address)
        return transfer_pb2_grpc.TransferServiceStub(self.channels[which])

    def send(self, method: str, request: object, key: uuid.UUID, route: str, sending: int = 0) -> object:
        """One attempt (a `cluster.Sender`) through either router, as the key falls: its duplicate
        (`sending` 1) through the other one."""
        which = ("following", "stale")[(key.int + sending) % 2]
        return getattr(self.stub(which), method)(request, metadata=key_metadata(key), timeout=5)


@pytest.fixture
def routers(postgres: object, tmp_path: Path) -> Iterator[Routers]:
    pair = new_pair(postgres, tmp_path)  # type: ignore[arg-type]
    old_map = tmp_path / "old-shard-map.yaml"
    shutil.copy(pair.map_path, old_map)
    processes: list[ServiceProcess] = []
    try:
        for sid, port in pair.ports.items():
            daemon = shardd_process(
                tmp_path, shard_id=sid, dsn=pair.dsns[sid], shard_map=pair.map_path, port=port
            )
            processes.append(daemon)
            daemon.start()
        following = router_process(tmp_path, shard_map=pair.map_path)
        stale = router_process(tmp_path, shard_map=old_map)
        for router in (following, stale):
            processes.append(router)
            router.start()
        cluster = Routers(pair, processes, following, stale)
        yield cluster
        for channel in cluster.channels.values():
            channel.close()
    finally:
        for process in reversed(processes):
            process.terminate(5)


def _seed(routers: Routers, everyone: list[str]) -> None:
    deposit = routers.stub("following").Deposit
    for account in everyone:
        request = transfer_pb2.DepositRequest(account_id=account, amount=money(SEEDED))
        attempt = functools.partial(deposit, request, metadata=tuple(key_metadata(new_key())), timeout=5)
        answer = until_final(attempt, retry_on=TRANSIENT, pause_s=0.01)
        assert not isinstance(answer, grpc.RpcError), answer


def _percentiles(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {statistics.median(ordered) * 1000:.0f} / p99 {p99 * 1000:.0f} / max {ordered[-1] * 1000:.0f} ms"


def _run(routers: Routers, *, accounts_each: int, moves: int, between_s: float) -> None:
    """`moves` moves of the range, to shard-1 and back in turn, `between_s` apart under the load."""
    pair = routers.pair
    moving, staying = accounts(pair, accounts_each)
    everyone = moving + staying
    load = Load(routers.send, everyone, retry_on=TRANSIENT, pause_s=0.01, timed=True)
    _seed(routers, everyone)
    settings = MoveSettings(copy_timeout_s=60, catch_up_timeout_s=60, final_sync_timeout_s=60)
    records = []
    windows: list[tuple[float, float]] = []  # each move's (start, end)
    cut_overs: list[tuple[float, float]] = []  # each move's (fenced, committed)
    load.start()
    try:
        time.sleep(between_s)
        for number in range(moves):
            started = time.monotonic()
            target = "shard-1" if number % 2 == 0 else "shard-0"
            record = start_move(pair.map_path, pair.databases, FIRST, LAST, target)
            phases: dict[str, float] = {}
            with Move(
                record,
                map_store=pair.map_path,
                databases=pair.databases,
                settings=settings,
                progress=lambda line, seen=phases: seen.setdefault(line.split(":")[0], time.monotonic()),
            ) as move:
                move.run()
            records.append(record)
            windows.append((started, time.monotonic()))
            cut_overs.append((phases["fenced"], phases["committed"]))
            time.sleep(between_s)
    finally:
        load.stop()

    assert [r.phase for r in records] == [Phase.DONE] * moves
    assert all(pair.owner(a) == ("shard-1" if moves % 2 else "shard-0") for a in moving)
    assert load.mismatches == []
    # Every key again through both routers, the stale one included: the first answer, verbatim.
    assert_replays_match(load, pair, sendings=(0, 1))
    lost = [c for c in load.calls if c.answer[0] != "ok" and c.answer[1] in TRANSIENT]
    assert lost == [], f"{len(lost)} operations got no final answer"
    check_ledger(pair, len(everyone), load.deposited())
    assert_no_leftovers(pair)
    assert len(load.answers) > 50

    def during(call: Call, spans: list[tuple[float, float]], margin: float = 0.0) -> bool:
        return any(
            call.started < end and call.started + call.seconds > start - margin for start, end in spans
        )

    moved = set(moving)
    first_move = windows[0][0]
    cut_over = [c.seconds for c in load.calls if c.route in moved and during(c, cut_overs, margin=0.05)]
    moved_before = [c.seconds for c in load.calls if c.route in moved and c.started + c.seconds < first_move]
    others_before = [
        c.seconds for c in load.calls if c.route not in moved and c.started + c.seconds < first_move
    ]
    others_during = [c.seconds for c in load.calls if c.route not in moved and during(c, windows)]
    rows = [sum(r.figures["rows_moved"].values()) for r in records]
    per_phase = {
        k[:-2]: round(statistics.median(float(r.figures[k]) for r in records), 3)
        for k in records[0].figures
        if k.endswith("_s") and k != "write_pause_s"
    }
    pauses = [float(r.figures["write_pause_s"]) for r in records]
    print(
        f"\n{moves} move(s) through routers: {len(load.answers)} operations ({load.duplicates} duplicates"
        f" through the other router), rows moved per move {rows}, median seconds per phase {per_phase},"
        f" fence to commit {pauses} s; moved range: before the moves {_percentiles(moved_before)}, calls"
        f" spanning a cut-over ({len(cut_over)}) {_percentiles(cut_over)}; other slots: before"
        f" {_percentiles(others_before)}, during the moves {_percentiles(others_during)}; lost 0,"
        " applied twice 0"
    )


def test_a_move_through_a_following_router_and_a_stale_one(routers: Routers) -> None:
    _run(routers, accounts_each=12, moves=1, between_s=1.0)


@pytest.mark.slow
def test_moves_there_and_back_through_routers(routers: Routers) -> None:
    _run(routers, accounts_each=200, moves=6, between_s=5.0)
