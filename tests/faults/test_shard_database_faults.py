"""Faults between a shard daemon (a real process) and its PostgreSQL, under steady keyed load with
duplicates: the connection cut and restored, PostgreSQL restarted (crash-like), the daemon killed -9.

Afterwards every operation either completed exactly once or was reported failed to its caller, and
nothing is left half-done. Figures are printed.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psycopg
import pytest

from localcluster.postgres import LocalPostgres
from shardrouter.keys import new_key
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.conftest import pg_data_dir
from tests.faults.tcp_proxy import TcpProxy
from tests.processes import shardd_process

TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
}


def _run(tmp_path: Path, seconds: float, seed: int) -> None:
    rng = random.Random(seed)
    pg = LocalPostgres(pg_data_dir())
    pg.start()
    proxy = TcpProxy("127.0.0.1", pg.port)
    dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?connect_timeout=3"
    shard = shardd_process(
        tmp_path,
        shard_id="shard-0",
        dsn=dsn,
        extra_env={"SHARDD_POOL_TIMEOUT_S": "1", "SHARDD_LOG_LEVEL": "WARNING"},
    )
    shard.start()
    channel = grpc.insecure_channel(shard.address)
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    outcomes: dict[str, list[str]] = {}
    amounts: dict[str, int] = {}
    counts = Counter()
    faults = Counter()
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
                account_id=f"acct-{n % 10}", amount=transfer_pb2.Money(amount_minor=amount, currency="EUR")
            )
            for _ in range(copies):
                give_up = time.monotonic() + 30
                while True:
                    counts["attempts"] += 1
                    try:
                        stub.Deposit(request, metadata=[("idempotency-key", key)], timeout=3)
                        outcomes[key].append("OK")
                        break
                    except grpc.RpcError as err:
                        if err.code() not in TRANSIENT or time.monotonic() > give_up:
                            outcomes[key].append(f"FAILED:{err.code().name}")
                            break
                        counts[err.code().name] += 1
                        time.sleep(0.05 + rng.random() * 0.1)

        def load() -> None:
            n = 0
            with ThreadPoolExecutor(8) as pool:
                while not stop.is_set():
                    pool.submit(operation, n)
                    n += 1
                    time.sleep(0.01)

        def chaos() -> None:
            plan = [("cut shard<->database", 1.0), ("restart PostgreSQL", 1.0), ("kill -9 shardd", 1.0)]
            start = time.monotonic()
            step = seconds / (len(plan) + 1)
            for i, (fault, _) in enumerate(plan):
                stop.wait(max(0.0, start + step * (i + 1) - time.monotonic()))
                faults[fault] += 1
                if fault.startswith("cut"):
                    proxy.cut()
                    time.sleep(1.0)
                    proxy.restore()
                elif fault.startswith("restart"):
                    pg.stop("immediate")
                    time.sleep(0.5)
                    pg.start()
                else:
                    shard.kill()
                    shard.start()

        loader = threading.Thread(target=load)
        loader.start()
        chaos()
        time.sleep(1.0)
        stop.set()
        loader.join()

        ok = {k for k, v in outcomes.items() if v and all(o == "OK" for o in v)}
        failed = {k for k, v in outcomes.items() if any(o.startswith("FAILED") for o in v)}
        with psycopg.connect(pg.dsn) as conn:
            per_key = dict(
                conn.execute(
                    "SELECT idempotency_key::text, count(*) FROM ledger_entries GROUP BY idempotency_key"
                ).fetchall()
            )
            balance = conn.execute("SELECT coalesce(sum(balance), 0) FROM accounts").fetchone()[0]
            stuck = conn.execute(
                "SELECT count(*) FROM idempotency_record WHERE state <> 'completed'"
            ).fetchone()[0]
            orphans = conn.execute(
                "SELECT count(*) FROM ledger_entries e WHERE NOT EXISTS (SELECT 1 FROM idempotency_record r"
                " WHERE r.key = e.idempotency_key AND r.state = 'completed')"
            ).fetchone()[0]
            empty = conn.execute(
                "SELECT count(*) FROM idempotency_record r WHERE r.status_code = 0 AND NOT EXISTS"
                " (SELECT 1 FROM ledger_entries e WHERE e.idempotency_key = r.key)"
            ).fetchone()[0]
        duplicates_applied = sum(n - 1 for n in per_key.values() if n > 1)
        lost = [k for k in ok if per_key.get(k, 0) != 1]
        applied_unreported = [k for k in outcomes if k not in ok and k not in failed and per_key.get(k)]
        print(
            f"\nfaults: {dict(faults)}; operations {len(outcomes)}, duplicates sent {counts['duplicates sent']}, "
            f"attempts {counts['attempts']}, transient answers { {k: v for k, v in counts.items() if k.isupper()} }; "
            f"completed {len(ok)}, reported failed {len(failed)}; duplicates applied {duplicates_applied}; "
            f"operations lost {len(lost)}"
        )
        assert duplicates_applied == 0
        assert not lost, f"{len(lost)} acknowledged operations have no single ledger entry"
        assert not applied_unreported
        assert stuck == 0 and orphans == 0 and empty == 0
        assert balance == sum(amounts[k] for k in per_key if k in amounts)
        assert sum(faults.values()) == 3
        assert len(ok) > 50
    finally:
        channel.close()
        shard.kill()
        proxy.close()
        pg.destroy()
        shutil.rmtree(pg.data_dir.parent, ignore_errors=True)


def test_faults_between_shard_and_database(tmp_path):
    _run(tmp_path, seconds=8.0, seed=3)


@pytest.mark.slow
def test_faults_between_shard_and_database_long(tmp_path):
    _run(tmp_path, seconds=60.0, seed=5)
