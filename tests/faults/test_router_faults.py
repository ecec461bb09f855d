"""Faults on the caller's path, through real processes:

- a shard daemon killed -9 in the middle of a keyed call the router forwarded to it, at a named
  failpoint (`core/failpoints.py`): `shardd.claimed_before_commit` (claimed, writes sent, nothing
  committed) or `shardd.committed_before_answer` (committed, not answered). The router sees the
  daemon's connection break, resends the same bytes and key to the shard's other daemon within the
  caller's one call, and the caller gets the deposit applied once, or its stored outcome replayed.
- the router killed -9 and restarted, and the connection between the router and a shard cut and
  restored, under steady keyed load with duplicates (no shard daemon is killed: these faults are the
  router's and the network's, wherever the calls are); afterwards every operation either completed
  exactly once or was reported failed; figures are printed.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import pytest
import yaml

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd.idempotency.steps import CLAIMED_BEFORE_COMMIT, COMMITTED_BEFORE_ANSWER
from shardrouter.v1 import transfer_pb2_grpc
from tests.faults.daemons import (
    DEPOSIT,
    OneShard,
    balances,
    call_in_background,
    deposit_request,
    entries,
    stored_response,
)
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


@pytest.mark.parametrize("point", [CLAIMED_BEFORE_COMMIT, COMMITTED_BEFORE_ANSWER])
def test_the_router_resends_a_call_whose_daemon_was_killed_at_a_failpoint(
    postgres: LocalPostgres, tmp_path: Path, point: str
) -> None:
    """Failpoints `shardd.claimed_before_commit` and `shardd.committed_before_answer`: a keyed
    Deposit through the router, whose first call goes to the shard's first daemon (its turns over a
    shard's daemons start there), the armed one."""
    shard = OneShard.build(postgres, tmp_path)
    armed, _ = shard.daemons
    armed.arm(point)
    try:
        shard.start()
        key, request = str(new_key()), deposit_request("acct-r", 250)
        answer = call_in_background(shard.router.address, DEPOSIT, request, key)
        paused = armed.wait_paused(point)
        committed = point == COMMITTED_BEFORE_ANSWER
        stored = stored_response(shard.dsn, key)
        assert (stored is not None) is committed
        assert not answer.done()
        armed.kill_paused(paused)

        # One call for the caller: the router resent it to the other daemon.
        got = answer.result(20)
        assert got.code is grpc.StatusCode.OK, (got, shard.logs())
        assert got.replayed is committed
        if committed:
            assert got.response == stored
        assert stored_response(shard.dsn, key) == got.response
        assert entries(shard.dsn, key) == [("deposit", "acct-r", 250)]
        assert balances(shard.dsn, "acct-r") == [250]
    finally:
        shard.stop()


def test_router_killed_and_router_shard_links_cut(postgres, tmp_path):
    _run(postgres, tmp_path, seconds=8.0, seed=21)


@pytest.mark.slow
def test_router_faults_long(postgres, tmp_path):
    _run(postgres, tmp_path, seconds=60.0, seed=22)
