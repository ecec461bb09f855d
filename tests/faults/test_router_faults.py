"""Faults on the caller's path: the router killed -9 and restarted, and the connection between the
router and a shard cut and restored, under steady keyed load with duplicates, through real processes.

Afterwards every operation either completed exactly once or was reported failed; figures are printed.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import pytest
import yaml

from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.v1 import transfer_pb2_grpc
from tests.faults.load import DepositLoad, Ledger
from tests.faults.tcp_proxy import TcpProxy
from tests.processes import router_process, shardd_process


def _run(postgres: LocalPostgres, tmp_path: Path, seconds: float, seed: int) -> None:
    shard_ids = ["shard-0", "shard-1"]
    dsns, shards, proxies = {}, {}, {}
    for sid in shard_ids:
        name = f"rf_{sid.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
        postgres.create_database(name)
        dsns[sid] = postgres.dsn_for(name)
        port = free_port()
        shards[sid] = shardd_process(
            tmp_path, shard_id=sid, dsn=dsns[sid], port=port, extra_env={"SHARDD_LOG_LEVEL": "WARNING"}
        )
        proxies[sid] = TcpProxy("127.0.0.1", port)  # the router reaches each shard through a proxy
    shard_map = even_shard_map({sid: f"127.0.0.1:{proxies[sid].port}" for sid in shard_ids})
    map_path = tmp_path / "shard-map.yaml"
    map_path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    for p in shards.values():
        p.start()
    router = router_process(tmp_path, shard_map=map_path)
    router.start()
    channel = grpc.insecure_channel(
        router.address,
        options=[("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)],
    )
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    faults: Counter[str] = Counter()
    try:
        with DepositLoad(stub, seed=seed, accounts=20) as load:
            step = seconds / 4
            time.sleep(step)
            faults["kill -9 router"] += 1
            router.kill()
            time.sleep(0.3)
            router.start()
            time.sleep(step)
            faults["cut router<->shard-0"] += 1
            proxies["shard-0"].cut()
            time.sleep(1.0)
            proxies["shard-0"].restore()
            time.sleep(step)
            faults["cut router<->all shards"] += 1
            for proxy in proxies.values():
                proxy.cut()
            time.sleep(0.5)
            for proxy in proxies.values():
                proxy.restore()
            time.sleep(step)
        result = load.stop()

        ledger = Ledger.read(dsns.values())
        print(result.summary(faults, ledger))
        assert ledger.unfinished == 0
        assert ledger.duplicates_applied == 0
        assert not result.lost(ledger), "acknowledged operations without a single ledger entry"
        assert all(ledger.entries.get(k, 0) <= 1 for k in result.failed)
        assert ledger.balance == result.expected_balance(ledger)
        assert len(result.completed) > 50
    finally:
        channel.close()
        router.kill()
        for p in shards.values():
            p.kill()
        for proxy in proxies.values():
            proxy.close()


def test_router_killed_and_router_shard_links_cut(postgres, tmp_path):
    _run(postgres, tmp_path, seconds=8.0, seed=21)


@pytest.mark.slow
def test_router_faults_long(postgres, tmp_path):
    _run(postgres, tmp_path, seconds=60.0, seed=22)
