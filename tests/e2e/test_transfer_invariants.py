"""The invariant test of cross-shard transfers: 3 shard daemons as processes, random transfers sent
several times (some concurrently), shard daemons (and their relays) killed and restarted at random, one
destination stopped for a while. Afterwards money is conserved and every transfer took effect once.

The short variant always runs; `--run-slow` runs the long one. Both are bounded in count and time.
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

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.processes import ServiceProcess, shardd_process

FINAL_CODES = {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}
START_BALANCE = 1_000_000


def _run(postgres: LocalPostgres, tmp_path: Path, transfers: int, seconds_budget: float, seed: int) -> None:
    rng = random.Random(seed)
    shard_ids = ["shard-0", "shard-1", "shard-2"]
    ports = {sid: free_port() for sid in shard_ids}
    shard_map = even_shard_map({sid: f"127.0.0.1:{p}" for sid, p in ports.items()})
    map_path = tmp_path / "shard-map.yaml"
    map_path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    dsns = {}
    for sid in shard_ids:
        name = f"inv_{sid.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
        postgres.create_database(name)
        dsns[sid] = postgres.dsn_for(name)
    procs: dict[str, ServiceProcess] = {
        sid: shardd_process(
            tmp_path,
            shard_id=sid,
            dsn=dsns[sid],
            shard_map=map_path,
            port=ports[sid],
            extra_env={"SHARDD_RELAY_WORKERS": "2", "SHARDD_LOG_LEVEL": "WARNING"},
        )
        for sid in shard_ids
    }
    for p in procs.values():
        p.start()
    channels = {sid: grpc.insecure_channel(f"127.0.0.1:{ports[sid]}") for sid in shard_ids}
    stubs = {sid: transfer_pb2_grpc.TransferServiceStub(ch) for sid, ch in channels.items()}
    try:
        accounts = [f"acct-{i}" for i in range(30)]
        ghosts = [f"ghost-{i}" for i in range(6)]  # never opened: transfers to them fail for good
        for account in accounts:
            stubs[shard_map.shard_for(account).id].Deposit(
                transfer_pb2.DepositRequest(
                    account_id=account, amount=transfer_pb2.Money(amount_minor=START_BALANCE, currency="EUR")
                ),
                metadata=[("idempotency-key", str(new_key()))],
                timeout=10,
            )
        plan = []
        for _ in range(transfers):
            src = rng.choice(accounts)
            dst = rng.choice(
                [a for a in accounts if a != src] + ([rng.choice(ghosts)] if rng.random() < 0.05 else [])
            )
            plan.append((str(new_key()), src, dst, rng.randint(1, 500), rng.choice([1, 2, 3, 4])))
        results: dict[str, list[tuple[str, str]]] = {key: [] for key, *_ in plan}
        sends = Counter()
        deadline = time.monotonic() + seconds_budget
        stop_chaos = threading.Event()
        faults = Counter()

        def send(key: str, src: str, dst: str, amount: int) -> None:
            stub = stubs[shard_map.shard_for(src).id]
            request = transfer_pb2.TransferRequest(
                source_account_id=src,
                destination_account_id=dst,
                amount=transfer_pb2.Money(amount_minor=amount, currency="EUR"),
            )
            delay = 0.02
            while time.monotonic() < deadline + 60:
                sends["attempts"] += 1
                try:
                    reply = stub.Transfer(request, metadata=[("idempotency-key", key)], timeout=5)
                    results[key].append(("OK", reply.transfer.transfer_id))
                    return
                except grpc.RpcError as err:
                    if err.code() in FINAL_CODES:
                        results[key].append((err.code().name, ""))
                        return
                    sends[err.code().name] += 1
                time.sleep(delay + rng.random() * delay)
                delay = min(delay * 2, 0.5)
            results[key].append(("GAVE_UP", ""))

        def chaos() -> None:
            crng = random.Random(seed + 1)
            while not stop_chaos.wait(crng.uniform(0.7, 1.5)):
                sid = crng.choice(shard_ids)
                if crng.random() < 0.25 and faults["outage"] == 0:
                    procs[sid].kill()
                    faults["outage"] += 1
                    stop_chaos.wait(3.0)  # a destination (and source) down for a while
                else:
                    procs[sid].kill()  # kill -9: mid-transaction, mid-relay-batch
                    faults["kill -9"] += 1
                procs[sid].start()

        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()
        jobs = []
        for key, src, dst, amount, copies in plan:
            jobs.extend([(key, src, dst, amount)] * copies)
            sends["duplicates sent"] += copies - 1
        rng.shuffle(jobs)  # copies of one key land at different times, some at the same time
        with ThreadPoolExecutor(24) as pool:
            list(pool.map(lambda job: send(*job), jobs))
        stop_chaos.set()
        chaos_thread.join()
        for p in procs.values():
            if p.proc is None or p.proc.poll() is not None:
                p.start()

        # Let the relays drain every outbox.
        drained = False
        drain_deadline = time.monotonic() + 90
        while time.monotonic() < drain_deadline and not drained:
            pending = 0
            for sid in shard_ids:
                with psycopg.connect(dsns[sid]) as conn:
                    pending += conn.execute(
                        "SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL"
                    ).fetchone()[0]
                    pending += conn.execute(
                        "SELECT count(*) FROM dead_letters WHERE refunded_at IS NULL"
                    ).fetchone()[0]
            drained = pending == 0
            time.sleep(0.3)
        assert drained, "outboxes did not drain within 90 s"

        # --- the invariants ---
        outcome_kinds = Counter()
        duplicates_applied = 0
        for key, outcomes in results.items():
            kinds = {o[0] for o in outcomes}
            assert "GAVE_UP" not in kinds, f"{key} never got a final answer"
            assert len(kinds) == 1, f"{key}: copies saw different outcomes {outcomes}"
            ids = {o[1] for o in outcomes}
            if len(ids) > 1:
                duplicates_applied += len(ids) - 1
            outcome_kinds[outcomes[0][0]] += 1
        assert duplicates_applied == 0

        ok = {key: outcomes[0][1] for key, outcomes in results.items() if outcomes[0][0] == "OK"}
        by_id = {uuid.UUID(tid): next(p for p in plan if p[0] == key) for key, tid in ok.items()}
        entries: dict[str, dict[tuple[uuid.UUID, str], int]] = {}
        total = 0
        dead = 0
        outbox_rows = 0
        for sid in shard_ids:
            with psycopg.connect(dsns[sid]) as conn:
                total += conn.execute("SELECT coalesce(sum(balance), 0) FROM accounts").fetchone()[0]
                entries[sid] = {
                    (tid, kind): n
                    for tid, kind, n in conn.execute(
                        "SELECT transfer_id, kind, count(*) FROM ledger_entries WHERE transfer_id IS NOT NULL"
                        " GROUP BY transfer_id, kind"
                    )
                }
                dead += conn.execute("SELECT count(*) FROM dead_letters").fetchone()[0]
                outbox_rows += conn.execute("SELECT count(*) FROM outbox").fetchone()[0]
                assert (
                    conn.execute(
                        "SELECT count(*) FROM idempotency_record WHERE state <> 'completed'"
                    ).fetchone()[0]
                    == 0
                ), "a key was left claimed"
                assert (
                    conn.execute(
                        "SELECT count(*) FROM ledger_entries e WHERE NOT EXISTS (SELECT 1 FROM idempotency_record r"
                        " WHERE r.key = e.idempotency_key AND r.state = 'completed')"
                    ).fetchone()[0]
                    == 0
                ), "a ledger entry without a completed key record"
                assert (
                    conn.execute(
                        "SELECT count(*) FROM idempotency_record r WHERE r.status_code = 0"
                        " AND r.method LIKE '%%/Transfer' AND NOT EXISTS (SELECT 1 FROM ledger_entries e"
                        " WHERE e.idempotency_key = r.key AND e.kind = 'transfer_out')"
                    ).fetchone()[0]
                    == 0
                ), "a completed Transfer record without its debit"
        money_lost = len(accounts) * START_BALANCE - total
        assert money_lost == 0
        cross = 0
        expected_dead = 0
        for tid, (_, src, dst, _amount, _) in by_id.items():
            s_src, s_dst = shard_map.shard_for(src).id, shard_map.shard_for(dst).id
            assert entries[s_src].get((tid, "transfer_out")) == 1, "debited not exactly once"
            credited = entries[s_dst].get((tid, "transfer_in"), 0)
            refunded = entries[s_src].get((tid, "refund"), 0)
            assert credited + refunded == 1, f"transfer {tid}: credited {credited}, refunded {refunded}"
            if s_src != s_dst:
                cross += 1
                expected_dead += dst.startswith("ghost-")
            else:
                assert not dst.startswith("ghost-")
        assert outbox_rows == cross, "an outbox row was lost or duplicated"
        assert dead == expected_dead, "the dead letters are not exactly the permanently failed credits"
        print(
            f"\ninvariants: {transfers} transfers ({cross} across shards), {sends['duplicates sent']} duplicates sent, "
            f"{sends['attempts']} attempts; faults {dict(faults)}; transient answers "
            f"{ {k: v for k, v in sends.items() if k.isupper()} }; outcomes {dict(outcome_kinds)}; "
            f"dead letters {dead} (refunded); duplicates applied {duplicates_applied}; money lost {money_lost}"
        )
    finally:
        for ch in channels.values():
            ch.close()
        for p in procs.values():
            p.kill()


def test_cross_shard_invariants_under_kills_and_outage(postgres, tmp_path):
    _run(postgres, tmp_path, transfers=600, seconds_budget=60, seed=7)


@pytest.mark.slow
def test_cross_shard_invariants_long(postgres, tmp_path):
    _run(postgres, tmp_path, transfers=5000, seconds_budget=600, seed=11)
