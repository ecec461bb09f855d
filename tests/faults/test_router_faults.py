"""Faults on the caller's path: the router killed -9 and restarted, and the connection between the
router and a shard cut and restored, under steady keyed load with duplicates, through real processes.

Afterwards every operation either completed exactly once or was reported failed; figures are printed.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml

from localcluster.postgres import LocalPostgres, free_port
from shardrouter.keys import new_key
from shardrouter.shardmap import even_shard_map, shard_map_document
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.faults.tcp_proxy import TcpProxy
from tests.processes import router_process, shardd_process

TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _run(postgres: LocalPostgres, tmp_path: Path, seconds: float, seed: int) -> None:
    rng = random.Random(seed)
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
    outcomes: dict[str, list[str]] = {}
    amounts: dict[str, int] = {}
    counts: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    try:

        def operation(n: int) -> None:
            key, amount = str(new_key()), rng.randint(1, 100)
            with lock:
                outcomes[key], amounts[key] = [], amount
                copies = rng.choice([1, 2, 3])
                counts["duplicates sent"] += copies - 1
            request = transfer_pb2.DepositRequest(
                account_id=f"acct-{n % 20}", amount=transfer_pb2.Money(amount_minor=amount, currency="EUR")
            )
            for _ in range(copies):
                give_up = time.monotonic() + 30
                while True:
                    with lock:
                        counts["attempts"] += 1
                    try:
                        stub.Deposit(request, metadata=[("idempotency-key", key)], timeout=3)
                        outcomes[key].append("OK")
                        break
                    except grpc.RpcError as err:
                        if err.code() not in TRANSIENT or time.monotonic() > give_up:
                            outcomes[key].append(f"FAILED:{err.code().name}")
                            break
                        with lock:
                            counts[err.code().name] += 1
                        time.sleep(0.05 + rng.random() * 0.1)

        def load() -> None:
            n = 0
            with ThreadPoolExecutor(8) as pool:
                while not stop.is_set():
                    pool.submit(operation, n)
                    n += 1
                    time.sleep(0.01)

        loader = threading.Thread(target=load)
        loader.start()
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
        stop.set()
        loader.join()

        ok = {k for k, v in outcomes.items() if v and all(o == "OK" for o in v)}
        failed = {k for k, v in outcomes.items() if any(o.startswith("FAILED") for o in v)}
        per_key: dict[str, int] = {}
        total = 0
        for sid in shard_ids:
            with psycopg.connect(dsns[sid]) as conn:
                per_key.update(
                    dict(
                        conn.execute(
                            "SELECT idempotency_key::text, count(*) FROM ledger_entries GROUP BY idempotency_key"
                        ).fetchall()
                    )
                )
                total += conn.execute("SELECT coalesce(sum(balance), 0) FROM accounts").fetchone()[0]
                assert (
                    conn.execute(
                        "SELECT count(*) FROM idempotency_record WHERE state <> 'completed'"
                    ).fetchone()[0]
                    == 0
                )
        duplicates_applied = sum(n - 1 for n in per_key.values() if n > 1)
        lost = [k for k in ok if per_key.get(k, 0) != 1]
        print(
            f"\nfaults: {dict(faults)}; operations {len(outcomes)}, duplicates sent {counts['duplicates sent']}, "
            f"attempts {counts['attempts']}, transient answers { {k: v for k, v in counts.items() if k.isupper()} }; "
            f"completed {len(ok)}, reported failed {len(failed)}; duplicates applied {duplicates_applied}; "
            f"operations lost {len(lost)}"
        )
        assert duplicates_applied == 0
        assert not lost
        assert all(per_key.get(k, 0) <= 1 for k in failed)
        assert total == sum(amounts[k] for k in per_key if k in amounts)
        assert len(ok) > 50
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
