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

import random
import shutil
import statistics
import threading
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
from tests.conftest import key_metadata, money
from tests.processes import ServiceProcess, router_process, shardd_process
from tests.reshard.cluster import (
    FIRST,
    LAST,
    SEEDED,
    Answer,
    Pair,
    accounts,
    answer_of,
    assert_no_leftovers,
    check_ledger,
)
from tests.reshard.conftest import new_pair

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED)


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


@dataclass
class Call:
    """One operation as its caller saw it: when it started, how long it took to a final answer."""

    started: float
    seconds: float
    moving: bool
    answer: Answer


@dataclass
class RouterLoad:
    """Keyed calls through both routers from a few threads until stopped."""

    routers: Routers
    moving: list[str]
    everyone: list[str]
    threads: int = 4
    calls: list[Call] = field(default_factory=list)
    first: dict[uuid.UUID, tuple[str, object, Answer]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    duplicates: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def send(self, which: str, method: str, request: object, key: uuid.UUID) -> object:
        give_up = time.monotonic() + 30
        while True:
            try:
                return getattr(self.routers.stub(which), method)(
                    request, metadata=key_metadata(key), timeout=5
                )
            except grpc.RpcError as err:
                if err.code() not in TRANSIENT or time.monotonic() > give_up:
                    return err
                time.sleep(0.01)

    def start(self) -> None:
        self._workers = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(60)

    def _run(self, seed_: int) -> None:
        rng = random.Random(seed_)
        moving = set(self.moving)
        while not self._stop.is_set():
            key = new_key()
            request: object
            if rng.random() < 0.4:
                account = rng.choice(self.everyone)
                method, route = "Deposit", account
                request = transfer_pb2.DepositRequest(account_id=account, amount=money(rng.randint(1, 9)))
            else:
                src, dst = rng.sample(self.everyone, 2)
                method, route = "Transfer", src
                request = transfer_pb2.TransferRequest(
                    source_account_id=src, destination_account_id=dst, amount=money(rng.randint(1, 5))
                )
            which = rng.choice(("following", "stale"))
            started = time.monotonic()
            answer = answer_of(self.send(which, method, request, key))
            call = Call(started, time.monotonic() - started, route in moving, answer)
            again = None
            if rng.random() < 0.3:  # the same key again at once, through the other router
                again = answer_of(
                    self.send("stale" if which == "following" else "following", method, request, key)
                )
            with self._lock:
                self.calls.append(call)
                self.first[key] = (method, request, answer)
                if again is not None:
                    self.duplicates += 1
                    if again != answer:
                        self.mismatches.append(f"{method} {key}: {answer[:2]} then {again[:2]}")

    def deposited(self) -> int:
        return sum(
            r.amount.amount_minor  # type: ignore[attr-defined]
            for m, r, a in self.first.values()
            if m == "Deposit" and a[0] == "ok"
        )


def _seed(routers: Routers, everyone: list[str], load: RouterLoad) -> None:
    for account in everyone:
        answer = load.send(
            "following",
            "Deposit",
            transfer_pb2.DepositRequest(account_id=account, amount=money(SEEDED)),
            new_key(),
        )
        assert not isinstance(answer, grpc.RpcError), answer


def _percentiles(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {statistics.median(ordered) * 1000:.0f} / p99 {p99 * 1000:.0f} / max {ordered[-1] * 1000:.0f} ms"


def _run(routers: Routers, *, accounts_each: int, before_s: float, after_s: float) -> None:
    pair = routers.pair
    moving, staying = accounts(pair, accounts_each)
    everyone = moving + staying
    load = RouterLoad(routers, moving, everyone)
    _seed(routers, everyone, load)
    load.start()
    try:
        time.sleep(before_s)
        move_started = time.monotonic()
        record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
        settings = MoveSettings(copy_timeout_s=60, catch_up_timeout_s=60, final_sync_timeout_s=60)
        phases: dict[str, float] = {}
        with Move(
            record,
            map_path=pair.map_path,
            databases=pair.databases,
            settings=settings,
            progress=lambda line: phases.setdefault(line.split(":")[0], time.monotonic()),
        ) as move:
            move.run()
        move_ended = time.monotonic()
        time.sleep(after_s)
    finally:
        load.stop()

    assert record.phase is Phase.DONE
    assert load.mismatches == []
    # Every key again through both routers, the stale one included: the first answer, verbatim.
    differ = [
        k
        for k, (m, r, first) in load.first.items()
        for which in ("following", "stale")
        if answer_of(load.send(which, m, r, k)) != first
    ]
    assert differ == []
    lost = [c for c in load.calls if c.answer[0] != "ok" and c.answer[1] in TRANSIENT]
    assert lost == [], f"{len(lost)} operations got no final answer"
    check_ledger(pair, len(everyone), load.deposited())
    assert_no_leftovers(pair)

    fenced, committed = phases["fenced"], phases["committed"]
    cut_over = [
        c.seconds
        for c in load.calls
        if c.moving and c.started < committed and c.started + c.seconds > fenced - 0.05
    ]
    moved_before = [c.seconds for c in load.calls if c.moving and c.started + c.seconds < move_started]
    others_before = [c.seconds for c in load.calls if not c.moving and c.started + c.seconds < move_started]
    others_during = [
        c.seconds
        for c in load.calls
        if not c.moving and move_started <= c.started and c.started + c.seconds <= move_ended
    ]
    figures = record.figures
    phase_s = {k[:-2]: v for k, v in figures.items() if k.endswith("_s") and k != "write_pause_s"}
    print(
        f"\nmove through routers: {len(load.first)} operations ({load.duplicates} duplicates through the other"
        f" router), rows moved {sum(figures['rows_moved'].values())} {figures['rows_moved']}, seconds per"
        f" phase {phase_s}, fence to commit {figures['write_pause_s']} s; moved range: before the move"
        f" {_percentiles(moved_before)}, calls spanning the cut-over ({len(cut_over)}) {_percentiles(cut_over)};"
        f" other slots: before {_percentiles(others_before)}, during the move {_percentiles(others_during)};"
        " lost 0, applied twice 0"
    )
    assert len(load.first) > 50


def test_a_move_through_a_following_router_and_a_stale_one(routers: Routers) -> None:
    _run(routers, accounts_each=12, before_s=1.0, after_s=1.0)


@pytest.mark.slow
def test_a_longer_move_through_routers(routers: Routers) -> None:
    _run(routers, accounts_each=200, before_s=10.0, after_s=10.0)
