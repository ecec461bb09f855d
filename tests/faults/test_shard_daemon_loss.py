"""Process-loss drill: a shard served by two daemons over its one database, one of them SIGKILLed under
keyed load through the router. The callers see nothing beyond retried attempts, nothing is lost or
applied twice, and the latency during the loss is printed beside the latency before it.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import grpc
import pytest

from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.v1 import transfer_pb2_grpc
from tests.faults.load import DepositLoad, Ledger
from tests.processes import ServiceProcess, router_process, shardd_process


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def _run(postgres: LocalPostgres, tmp_path: Path, before_s: float, after_s: float, seed: int) -> None:
    name = f"loss_{uuid.uuid4().hex[:8]}"
    postgres.create_database(name)
    dsn = postgres.dsn_for(name)
    daemons = [
        shardd_process(
            tmp_path,
            shard_id="shard-0",
            dsn=dsn,
            extra_env={"SHARDD_LOG_LEVEL": "WARNING", "SHARDD_RELAY_WORKERS": "0"},
        )
        for _ in range(2)
    ]
    shard_map = tmp_path / "shard-map.json"
    shard_map.write_text(
        json.dumps(
            {
                "version": 1,
                "shards": [
                    {"id": "shard-0", "addresses": [d.address for d in daemons], "slot_ranges": [[0, 16383]]}
                ],
            }
        )
    )
    for daemon in daemons:
        daemon.env["SHARDD_SHARD_MAP"] = str(shard_map)
        daemon.start()
    router: ServiceProcess = router_process(tmp_path, shard_map=shard_map)
    router.start()
    channel = grpc.insecure_channel(router.address)
    try:
        with DepositLoad(transfer_pb2_grpc.TransferServiceStub(channel), seed=seed, accounts=10) as load:
            time.sleep(before_s)
            killed_at = time.monotonic()
            daemons[1].kill()
            time.sleep(after_s)
            result = load.stop()
        ledger = Ledger.read([dsn])
    finally:
        channel.close()
        router.kill()
        for daemon in daemons:
            daemon.kill()

    before = [d for start, d in result.latencies if start < killed_at]
    during = [d for start, d in result.latencies if killed_at <= start < killed_at + 2.0]
    retried = {k: v for k, v in result.counts.items() if k.isupper()}
    print(
        f"\nprocess loss: operations {len(result.outcomes)}, duplicates sent {result.counts['duplicates sent']}, "
        f"attempts {result.counts['attempts']}, retried answers {retried}; completed {len(result.completed)}, "
        f"reported failed {len(result.failed)}, lost {len(result.lost(ledger))}, "
        f"applied twice {ledger.duplicates_applied}; latency before the kill p50 {_p(before, 0.5):.1f} ms "
        f"p99 {_p(before, 0.99):.1f} ms ({len(before)} calls), in the 2 s after it p50 {_p(during, 0.5):.1f} ms "
        f"p99 {_p(during, 0.99):.1f} ms max {max(during, default=0) * 1000:.1f} ms ({len(during)} calls)"
    )
    assert len(result.outcomes) > 50
    assert during, "no call was answered after the kill"
    assert result.failed == set(), "a caller saw a failure beyond retried attempts"
    assert result.completed == set(result.outcomes)
    assert result.lost(ledger) == []
    assert ledger.duplicates_applied == 0
    assert ledger.unfinished == 0 and ledger.orphans == 0 and ledger.empty == 0
    assert ledger.balance == result.expected_balance(ledger)


def test_losing_one_of_a_shards_two_daemons(postgres: LocalPostgres, tmp_path: Path) -> None:
    _run(postgres, tmp_path, before_s=2.0, after_s=3.0, seed=17)


@pytest.mark.slow
def test_losing_one_of_a_shards_two_daemons_long(postgres: LocalPostgres, tmp_path: Path) -> None:
    _run(postgres, tmp_path, before_s=10.0, after_s=20.0, seed=18)
