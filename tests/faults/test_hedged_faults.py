"""Hedged forwarding under faults: keyed Deposits with duplicates through a router that hedges at a
shard's second daemon, while one daemon is stalled (SIGSTOP) and then the other is SIGKILLed and
started again. The callers see no failure, nothing is lost or applied twice, and hedges were sent."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc

from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.v1 import transfer_pb2_grpc
from tests.faults.daemons import OneShard
from tests.faults.load import DepositLoad, Ledger
from tests.metrics import scrape

#: The stall: as long as a long GC pause or a CPU-starved node, short for a test.
STALL_S = 1.0


def _hedges(port: int) -> dict[str, float]:
    """router_hedges_total by result, summed over shards."""
    found: dict[str, float] = {}
    for labels, value in scrape(port, "router_hedges_total").items():
        result = dict(labels)["result"]
        found[result] = found.get(result, 0.0) + value
    return found


def test_hedged_load_through_a_stall_and_a_kill_applies_each_key_once(postgres: LocalPostgres, tmp_path: Path) -> None:
    metrics = free_port()
    shard = OneShard.build(
        postgres,
        tmp_path,
        router_env={
            "ROUTER_HEDGE_AFTER_MS": "30",
            "ROUTER_HEDGE_BUDGET_PERCENT": "50",
            "ROUTER_METRICS_PORT": str(metrics),
        },
    )
    stalled, killed = shard.daemons
    shard.start()
    channel = grpc.insecure_channel(shard.router.address)
    try:
        with DepositLoad(transfer_pb2_grpc.TransferServiceStub(channel), seed=41, accounts=10) as load:
            time.sleep(1.0)
            assert stalled.proc is not None
            stalled.proc.send_signal(signal.SIGSTOP)
            time.sleep(STALL_S)
            stalled.proc.send_signal(signal.SIGCONT)
            time.sleep(0.5)
            killed.kill()
            killed.start(wait=False)
            time.sleep(1.5)
            result = load.stop()
        ledger = Ledger.read([shard.dsn])
        hedges = _hedges(metrics)
    finally:
        channel.close()
        shard.stop()
    failures = {key: result.outcomes[key] for key in sorted(result.failed)}
    assert result.failed == set(), f"a caller saw a failure beyond retried attempts: {failures}"
    assert len(result.outcomes) > 50 and result.completed == set(result.outcomes)
    assert result.lost(ledger) == []
    assert ledger.duplicates_applied == 0
    assert ledger.unfinished == 0 and ledger.orphans == 0 and ledger.empty == 0
    assert ledger.balance == result.expected_balance(ledger)
    assert hedges.get("sent", 0) > 0 and hedges.get("won", 0) > 0, hedges
