"""Load shedding: a retry storm is answered at once instead of queueing behind the database pool."""

from __future__ import annotations

import threading
import time

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardrouter.core.errors import Reason, ShardRouterError
from shardrouter.shardd.admission import AdmissionLimits
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import deposit, key_metadata, make_settings, money
from tests.processes import shardd_process


def _retry_info(err: grpc.RpcError) -> error_details_pb2.RetryInfo | None:
    for detail in rpc_status.from_call(err).details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info
    return None


def _blocked_calls(stub, database, callers):
    """Start one Deposit per caller that blocks on a held account lock; returns (holder, threads, errors)."""
    holder = psycopg.connect(database)
    holder.execute("SELECT 1 FROM accounts WHERE id = 'hot' FOR UPDATE")
    errors: list[grpc.RpcError] = []

    def call(caller):
        try:
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id="hot", amount=money(1)),
                metadata=key_metadata(caller=caller),
                timeout=20,
            )
        except grpc.RpcError as err:
            errors.append(err)

    threads = [threading.Thread(target=call, args=(c,)) for c in callers]
    for t in threads:
        t.start()
    return holder, threads, errors


def _wait_for_lock_waiters(db, n):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        waiting = db.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'shardd' AND wait_event_type = 'Lock'"
        ).fetchone()[0]
        if waiting >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"expected {n} calls waiting on the lock")


def _one_more_call_while_blocked(stub, database, db, callers, *, caller):
    """Block one Deposit per `callers` on a held lock, then send one more (expected to be refused).

    Returns (the refusal, seconds it took, errors of the blocked calls once released)."""
    holder, threads, errors = _blocked_calls(stub, database, callers)
    try:
        _wait_for_lock_waiters(db, len(callers))
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id="cold", amount=money(1)),
                metadata=key_metadata(caller=caller),
                timeout=20,
            )
        elapsed = time.monotonic() - started
    finally:
        holder.rollback()
        holder.close()
        for t in threads:
            t.join()
    return info, elapsed, errors


@pytest.mark.parametrize(
    ("overrides", "callers", "caller", "code", "reason"),
    [
        # Saturated, and the caller already holds its fair share (2 of 2 with one caller).
        (
            {"max_in_flight": 2, "max_waiting": 4},
            ["storm", "storm"],
            "storm",
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "RATE_LIMITED",
        ),
        # Past max_in_flight + max_waiting, whoever asks.
        (
            {"max_in_flight": 2, "max_waiting": 0},
            ["a", "b"],
            "c",
            grpc.StatusCode.UNAVAILABLE,
            "SHARD_SATURATED",
        ),
    ],
)
def test_calls_beyond_the_limits_are_shed_at_once(database, db, overrides, callers, caller, code, reason):
    daemon = start_shard(make_settings(database, **overrides))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            deposit(stub, "hot", 1)
            info, elapsed, errors = _one_more_call_while_blocked(stub, database, db, callers, caller=caller)
        assert info.value.code() == code
        assert reason in str(rpc_status.from_call(info.value))
        assert _retry_info(info.value) is not None
        assert elapsed < 0.5, f"shedding took {elapsed:.2f} s"
        assert not errors, "the admitted calls must complete"
        assert db.execute("SELECT count(*) FROM accounts WHERE id = 'cold'").fetchone()[0] == 0
    finally:
        daemon.stop(0.2)


def test_a_caller_under_its_share_is_admitted_while_the_shard_is_saturated(database, db):
    """Two calls of "storm" saturate the shard (max_in_flight 2): a third of storm's is shed, and a
    call of "quiet" is still admitted and completes."""
    daemon = start_shard(make_settings(database, max_in_flight=2, max_waiting=2))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            deposit(stub, "hot", 1)
            holder, threads, errors = _blocked_calls(stub, database, ["storm", "storm"])
            try:
                _wait_for_lock_waiters(db, 2)
                with pytest.raises(grpc.RpcError) as shed:
                    stub.Deposit(
                        transfer_pb2.DepositRequest(account_id="cold", amount=money(1)),
                        metadata=key_metadata(caller="storm"),
                        timeout=5,
                    )
                stub.Deposit(
                    transfer_pb2.DepositRequest(account_id="quiet", amount=money(7)),
                    metadata=key_metadata(caller="quiet"),
                    timeout=5,
                )
            finally:
                holder.rollback()
                holder.close()
                for t in threads:
                    t.join()
        assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "fair share" in shed.value.details()
        assert not errors
        assert db.execute("SELECT balance FROM accounts WHERE id = 'quiet'").fetchone()[0] == 7
    finally:
        daemon.stop(0.2)


def test_fair_share_rule() -> None:
    limits = AdmissionLimits(max_in_flight=4, max_waiting=2)
    for _ in range(4):
        limits.acquire("flood")  # below saturation anyone is admitted, however many it sends
    with pytest.raises(ShardRouterError) as refused:
        limits.acquire("flood")  # saturated and holding all 4: over its share
    assert refused.value.reason == Reason.RATE_LIMITED
    limits.acquire("quiet")  # share 4 // 2 = 2, holds 0
    limits.acquire("quiet")  # holds 1 < 2
    with pytest.raises(ShardRouterError) as full:
        limits.acquire("third")  # 6 in flight = 4 + 2: nobody is admitted
    assert full.value.reason == Reason.SHARD_SATURATED
    limits.release("flood")
    with pytest.raises(ShardRouterError):
        limits.acquire("flood")  # still saturated (5) and 3 >= its share 2
    limits.acquire("third")  # share 4 // 3 = 1, holds 0
    assert limits.in_flight == 6
    for caller in ["flood"] * 3 + ["quiet"] * 2 + ["third"]:
        limits.release(caller)
    assert limits.in_flight == 0
    for _ in range(4):
        limits.acquire("flood")  # nobody left: the whole shard is the flooder's again


def test_pool_exhaustion_answers_unavailable_quickly(database, db):
    daemon = start_shard(make_settings(database, pool_min=1, pool_max=2, pool_timeout_s=0.3))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            deposit(stub, "hot", 1)
            info, elapsed, errors = _one_more_call_while_blocked(stub, database, db, ["a", "b"], caller="c")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "connections are all busy" in info.value.details()
        assert _retry_info(info.value) is not None
        assert elapsed < 1.5
        assert not errors
    finally:
        daemon.stop(0.2)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_a_flooding_caller_is_refused_and_modest_callers_are_not(database, tmp_path, shard_processes):
    """One caller floods a shard process (48 calls at once, more than its 16 connections serve) while
    three others send one call every 50 ms: the others see no refusal and a bounded p99; the flooder
    is the one refused."""
    process = shardd_process(
        tmp_path,
        shard_id="shard-0",
        dsn=database,
        extra_env={
            "SHARDD_WORKERS": "64",
            "SHARDD_POOL_MAX": "16",
            "SHARDD_MAX_IN_FLIGHT": "16",
            "SHARDD_MAX_WAITING": "8",
            "SHARDD_LOG_LEVEL": "WARNING",
        },
    )
    shard_processes.append(process)
    process.start()
    seconds, flood_threads = 4.0, 48
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    flood: dict[str, int] = {}
    quiet: dict[str, list[float]] = {"latency": [], "errors": []}  # type: ignore[dict-item]

    with grpc.insecure_channel(process.address) as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)

        def flooder(n: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                i += 1
                try:
                    stub.Deposit(
                        transfer_pb2.DepositRequest(account_id=f"flood-{n}-{i % 4}", amount=money(1)),
                        metadata=key_metadata(caller="flooder"),
                        timeout=10,
                    )
                    outcome = "OK"
                except grpc.RpcError as err:
                    outcome = err.code().name
                with lock:
                    flood[outcome] = flood.get(outcome, 0) + 1

        def modest(name: str) -> None:
            while time.monotonic() < stop_at:
                started = time.monotonic()
                try:
                    stub.Deposit(
                        transfer_pb2.DepositRequest(account_id=name, amount=money(1)),
                        metadata=key_metadata(caller=name),
                        timeout=10,
                    )
                    with lock:
                        quiet["latency"].append(time.monotonic() - started)
                except grpc.RpcError as err:
                    with lock:
                        quiet["errors"].append(err.code().name)  # type: ignore[arg-type]
                time.sleep(0.05)

        threads = [threading.Thread(target=flooder, args=(n,)) for n in range(flood_threads)]
        threads += [threading.Thread(target=modest, args=(f"modest-{n}",)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    latency = quiet["latency"]
    p50, p99 = _percentile(latency, 0.5), _percentile(latency, 0.99)
    print(
        f"\nflood test ({seconds:.0f} s): flooder {flood}; 3 modest callers {len(latency)} ok, "
        f"{len(quiet['errors'])} refused, p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    )
    assert not quiet["errors"], f"modest callers were refused: {quiet['errors'][:5]}"
    assert len(latency) >= 30, "the modest callers barely got through"
    assert p99 < 1.0, f"modest callers' p99 {p99:.3f} s"
    assert flood.get("RESOURCE_EXHAUSTED", 0) > 0, f"the flooder was never refused: {flood}"
    assert set(flood) <= {"OK", "RESOURCE_EXHAUSTED"}, flood


def test_a_busy_client_is_not_throttled_while_the_shard_has_room(database, tmp_path, shard_processes):
    """One ordinary client sending 32 calls at once to a shard with the production defaults: nothing
    is refused (before, the per-caller limit of 8 refused 63% of them)."""
    process = shardd_process(
        tmp_path,
        shard_id="shard-0",
        dsn=database,
        extra_env={"SHARDD_WORKERS": "64", "SHARDD_POOL_MAX": "16", "SHARDD_LOG_LEVEL": "WARNING"},
    )
    shard_processes.append(process)
    process.start()
    stop_at = time.monotonic() + 2.0
    outcomes: list[str] = []
    lock = threading.Lock()
    with grpc.insecure_channel(process.address) as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)

        def client(n: int) -> None:
            while time.monotonic() < stop_at:
                try:
                    stub.Deposit(
                        transfer_pb2.DepositRequest(account_id=f"busy-{n}", amount=money(1)),
                        metadata=key_metadata(),
                        timeout=10,
                    )
                    outcome = "OK"
                except grpc.RpcError as err:
                    outcome = err.code().name
                with lock:
                    outcomes.append(outcome)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    print(f"\none client, 32 calls at once for 2 s: {counts}")
    assert set(counts) == {"OK"}, counts
