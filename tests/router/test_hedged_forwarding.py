"""Hedged forwarding through a real router process, to two stand-in daemons of one shard, one of
them stalled: keyed calls and reads are answered by the other after the hedge delay, a keyless write
is not hedged, a hedge carries the wait preference, and the metrics count hedges sent and won."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardrouter.core.errors import Aborted, Reason, to_grpc_status
from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.forwarding import SLOW_DAEMON_AVOID_S
from shardrouter.v1 import transfer_pb2
from tests.metrics import scrape
from tests.processes import ServiceProcess, router_process
from tests.router.fakeshard import FakeShard, SeenCall, echo, start_fake_shard

SERVICE = "/shardrouter.v1.TransferService/"
DEPOSIT = transfer_pb2.DepositRequest(
    account_id="acct-1", amount=transfer_pb2.Money(amount_minor=1, currency="EUR")
).SerializeToString()
BALANCE = transfer_pb2.GetBalanceRequest(account_id="acct-1").SerializeToString()
HEDGE_AFTER_MS = 100
#: How long the router avoids a daemon a call was hedged past: ten hedge delays here.
AVOID_S = max(SLOW_DAEMON_AVOID_S, 10 * HEDGE_AFTER_MS / 1000)


class Stall:
    """A daemon's behaviour that holds every call until released (or `limit_s`), then echoes."""

    def __init__(self, limit_s: float = 5.0) -> None:
        self.released = threading.Event()
        self._limit_s = limit_s

    def __call__(self, call: SeenCall, context: grpc.ServicerContext) -> bytes:
        self.released.wait(self._limit_s)
        return echo(call, context)


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[tuple[FakeShard, FakeShard, ServiceProcess, int]]:
    stalled, healthy = start_fake_shard(), start_fake_shard()
    shard_map = tmp_path / "shard-map.json"
    shard_map.write_text(
        json.dumps(
            {
                "version": 1,
                "shards": [
                    {"id": "shard-0", "addresses": [stalled.address, healthy.address], "slot_ranges": [[0, 16383]]}
                ],
            }
        )
    )
    metrics = free_port()
    router = router_process(
        tmp_path,
        shard_map=shard_map,
        extra_env={"ROUTER_HEDGE_AFTER_MS": str(HEDGE_AFTER_MS), "ROUTER_METRICS_PORT": str(metrics)},
    )
    router.start()
    stall = Stall()
    stalled.behaviour = stall
    try:
        yield stalled, healthy, router, metrics
    finally:
        stall.released.set()
        router.kill()
        stalled.stop()
        healthy.stop()


def _timed(channel: grpc.Channel, method: str, body: bytes, metadata: tuple[tuple[str, str], ...]) -> float:
    started = time.monotonic()
    assert channel.unary_unary(SERVICE + method)(body, metadata=metadata, timeout=10) == body
    return time.monotonic() - started


def _hedges(port: int) -> dict[str, float]:
    return {
        dict(labels)["result"]: value
        for labels, value in scrape(port, "router_hedges_total").items()
        if dict(labels)["result"] in ("sent", "won")
    }


def test_keyed_calls_and_reads_are_answered_past_a_stalled_daemon(shard) -> None:
    stalled, healthy, router, metrics = shard
    with grpc.insecure_channel(router.address) as channel:
        took = [_timed(channel, "Deposit", DEPOSIT, ((KEY_METADATA, str(new_key())),)) for _ in range(6)]
        took += [_timed(channel, "GetBalance", BALANCE, ()) for _ in range(4)]
        # The stalled daemon is avoided for a moment after a call was hedged past it; then it gets
        # calls again, and a call it stalls is hedged again.
        avoided = len(stalled.calls)
        time.sleep(AVOID_S + 0.3)
        took += [_timed(channel, "Deposit", DEPOSIT, ((KEY_METADATA, str(new_key())),)) for _ in range(2)]
    assert max(took) < 3.0, took  # every call answered by the healthy daemon, after a hedge or not
    # Without avoiding it, every other call (5 of 10) would have started at the stalled daemon.
    assert 1 <= avoided < 5, "after a hedge, new calls started at the healthy daemon for a moment"
    assert len(stalled.calls) > avoided, "past the moment, the stalled daemon was tried again"
    hedged = [c for c in healthy.calls if c.method.endswith("/Deposit") and WAIT_METADATA in dict(c.metadata)]
    assert hedged, "a hedged keyed call asks the other daemon to wait for its twin"
    assert int(dict(hedged[0].metadata)[WAIT_METADATA]) > 5000  # most of the call's 10 s deadline
    # Every call that started at the stalled daemon was hedged, and the hedge answered.
    stalled_calls = float(len(stalled.calls))
    assert _hedges(metrics) == {"sent": stalled_calls, "won": stalled_calls}


def test_a_keyless_write_is_not_hedged(shard) -> None:
    stalled, healthy, router, _ = shard
    stalled.behaviour = Stall(limit_s=0.5)
    with grpc.insecure_channel(router.address) as channel:
        took = [_timed(channel, "Deposit", DEPOSIT, ()) for _ in range(2)]
    assert len(stalled.calls) == 1 and len(healthy.calls) == 1
    assert max(took) >= 0.45, took  # the one at the stalled daemon waited for it


def test_a_hedge_that_finds_the_key_in_flight_leaves_the_answer_to_the_first_daemon(shard) -> None:
    """The healthy daemon answers the hedge "in flight" (the stalled one holds the key): not the
    caller's answer; the stalled daemon's, once it goes on, is."""
    stalled, healthy, router, metrics = shard
    stall = Stall(limit_s=0.5)
    stalled.behaviour = stall

    def in_flight(call: SeenCall, context: grpc.ServicerContext) -> bytes:
        context.abort_with_status(to_grpc_status(Aborted("in flight", reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT)))
        raise AssertionError("abort_with_status returns only by raising")

    healthy.behaviour = in_flight
    with grpc.insecure_channel(router.address) as channel:
        took = _timed(channel, "Deposit", DEPOSIT, ((KEY_METADATA, str(new_key())),))
    assert len(stalled.calls) == 1 and len(healthy.calls) == 1
    assert took >= 0.45
    assert _hedges(metrics) == {"sent": 1.0}
