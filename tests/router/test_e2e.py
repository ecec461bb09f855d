"""End to end through the router: two real `shardd` processes, each on its own PostgreSQL database.

The source document's verification (N parallel attempts with one key apply once; the rest are
verbatim replays or retryable conflicts; a later retry replays) is run through the router, for one
key and for many keys on both shards at once; and what a caller gets through the router is compared
with what it gets from the shard directly.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardrouter.core.errors import Reason
from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import ShardMap, even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.v1 import transfer_pb2
from tests.processes import ServiceProcess, router_process, shardd_process

SERVICE = "/shardrouter.v1.TransferService/"
SHARDS = ("shard-0", "shard-1")


@dataclass
class Cluster:
    shard_map: ShardMap
    router_map_path: Path
    shards: dict[str, ServiceProcess]
    dsns: dict[str, str]
    router: ServiceProcess
    router_channel: grpc.Channel
    shard_channels: dict[str, grpc.Channel]

    def via_router(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        return self.router_channel.unary_unary(
            SERVICE + method, request_serializer=None, response_deserializer=None
        )

    def direct(self, shard_id: str, method: str) -> grpc.UnaryUnaryMultiCallable:
        return self.shard_channels[shard_id].unary_unary(
            SERVICE + method, request_serializer=None, response_deserializer=None
        )

    def owner(self, account: str) -> str:
        return self.shard_map.shard_for(account).id

    def accounts_on(self, shard_id: str, count: int, prefix: str) -> list[str]:
        found: list[str] = []
        i = 0
        while len(found) < count:
            name = f"{prefix}-{i}"
            if self.owner(name) == shard_id:
                found.append(name)
            i += 1
        return found

    def scalar(self, shard_id: str, sql: str, params: tuple[object, ...] = ()) -> object:
        with psycopg.connect(self.dsns[shard_id], autocommit=True) as conn:
            row = conn.execute(sql, params).fetchone()  # type: ignore[arg-type]
        assert row is not None
        return row[0]

    def deposit(self, account: str, amount: int) -> None:
        request = transfer_pb2.DepositRequest(account_id=account, amount=_eur(amount))
        self.via_router("Deposit")(
            request.SerializeToString(), metadata=[("idempotency-key", str(new_key()))], timeout=10
        )

    def balance(self, account: str) -> int:
        raw = self.via_router("GetBalance")(
            transfer_pb2.GetBalanceRequest(account_id=account).SerializeToString(), timeout=10
        )
        return transfer_pb2.GetBalanceResponse.FromString(raw).balance.amount_minor


def _eur(amount: int) -> transfer_pb2.Money:
    return transfer_pb2.Money(amount_minor=amount, currency="EUR")


def _write_map(path: Path, shard_map: ShardMap) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    tmp.replace(path)


@pytest.fixture(scope="module")
def cluster(postgres: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router-e2e")
    ports = {shard_id: free_port() for shard_id in SHARDS}
    shard_map = even_shard_map({s: f"127.0.0.1:{p}" for s, p in ports.items()})
    shard_map_path = tmp / "shard-map.yaml"
    _write_map(shard_map_path, shard_map)
    router_map_path = tmp / "router-shard-map.yaml"
    _write_map(router_map_path, shard_map)
    dsns = {}
    for shard_id in SHARDS:
        name = f"router_e2e_{shard_id.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
        postgres.create_database(name)
        dsns[shard_id] = postgres.dsn_for(name)
    # The shards' production defaults for threads, pool and admission: a test of what users run.
    defaults = {"SHARDD_WORKERS": "64", "SHARDD_POOL_MAX": "16"}
    shards = {
        s: shardd_process(
            tmp, shard_id=s, dsn=dsns[s], shard_map=shard_map_path, port=ports[s], extra_env=defaults
        )
        for s in SHARDS
    }
    router = router_process(tmp, shard_map=router_map_path)
    started: list[ServiceProcess] = []
    try:
        with futures.ThreadPoolExecutor(3) as pool:  # start all three at once: start-up is most of the cost
            for process in [*shards.values(), router]:
                started.append(process)
            list(pool.map(lambda p: p.start(), started))
        channels = {s: grpc.insecure_channel(shards[s].address) for s in SHARDS}
        with grpc.insecure_channel(router.address) as router_channel:
            yield Cluster(shard_map, router_map_path, shards, dsns, router, router_channel, channels)
        for channel in channels.values():
            channel.close()
    finally:
        for process in started:
            process.kill()


def _attempt(call: grpc.UnaryUnaryMultiCallable, raw: bytes, key: str) -> tuple[str, object, object]:
    """One Transfer attempt: ("ok", response bytes, trailers) or ("error", code, the error)."""
    try:
        response, outcome = call.with_call(raw, metadata=[("idempotency-key", key)], timeout=15)
        return "ok", response, dict(outcome.trailing_metadata())
    except grpc.RpcError as error:
        return "error", error.code(), error


def _retry_info(error: grpc.RpcError) -> tuple[str, int] | None:
    """(ErrorInfo reason, RetryInfo delay ms) of an error, if it has RetryInfo."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return None
    reason, delay = "", None
    for detail in status.details:
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            reason = info.reason
        elif detail.Unpack(retry):
            delay = retry.retry_delay.ToMilliseconds()
    return (reason, delay) if delay is not None else None


def _check_attempts(results: list[tuple[str, object, object]]) -> bytes:
    """Every OK is the same bytes and exactly one is not a replay; every error is ABORTED + RetryInfo."""
    oks = [r for r in results if r[0] == "ok"]
    errors = [r for r in results if r[0] == "error"]
    assert oks, "no attempt succeeded"
    assert len({r[1] for r in oks}) == 1, "responses differ: not a verbatim replay"
    fresh = [r for r in oks if r[2].get("idempotency-replayed") != "true"]  # type: ignore[union-attr]
    assert len(fresh) == 1, f"{len(fresh)} attempts claim to have applied the transfer"
    for _, code, error in errors:
        assert code == grpc.StatusCode.ABORTED, f"unexpected {code}: {error}"
        retry = _retry_info(error)  # type: ignore[arg-type]
        assert retry is not None and retry[0] == Reason.IDEMPOTENCY_KEY_IN_FLIGHT and retry[1] > 0
    return oks[0][1]  # type: ignore[return-value]


@pytest.mark.parametrize("parallel", [20, 100])
def test_parallel_attempts_with_one_key_apply_once(cluster: Cluster, parallel: int) -> None:
    """The seed's check: 1 applied, every other attempt a verbatim replay or ABORTED with RetryInfo,
    and nothing else (no admission refusal: a duplicate costs the shard no database work)."""
    src, dst = cluster.accounts_on("shard-1", 2, f"one-key-{parallel}")
    owner = cluster.owner(src)
    cluster.deposit(src, 10_000)
    cluster.deposit(dst, 1)
    key = str(new_key())
    raw = transfer_pb2.TransferRequest(
        source_account_id=src, destination_account_id=dst, amount=_eur(250), reference="twenty"
    ).SerializeToString()
    call = cluster.via_router("Transfer")
    start = threading.Barrier(parallel)

    def attempt() -> tuple[str, object, object]:
        start.wait()
        return _attempt(call, raw, key)

    with futures.ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(lambda _: attempt(), range(parallel)))
    response = _check_attempts(results)
    replays = sum(1 for r in results if r[0] == "ok") - 1
    print(
        f"\n{parallel} same-key attempts through the router: 1 applied, {replays} replays, "
        f"{parallel - 1 - replays} ABORTED"
    )

    other = next(s for s in SHARDS if s != owner)
    entries_sql = "SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out' AND idempotency_key = %s"
    assert cluster.scalar(owner, entries_sql, (str(key),)) == 1
    assert cluster.scalar(other, entries_sql, (str(key),)) == 0
    assert (
        cluster.scalar(
            owner,
            "SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out' AND account_id = %s",
            (src,),
        )
        == 1
    )
    assert (
        cluster.scalar(
            owner,
            "SELECT count(*) FROM idempotency_record WHERE key = %s AND state = 'completed'",
            (str(key),),
        )
        == 1
    )
    assert cluster.balance(src) == 10_000 - 250
    assert cluster.balance(dst) == 1 + 250

    # A later retry replays the stored outcome, byte for byte.
    kind, later, trailers = _attempt(call, raw, key)
    assert kind == "ok" and later == response
    assert trailers["idempotency-replayed"] == "true"  # type: ignore[index]
    assert cluster.scalar(owner, entries_sql, (str(key),)) == 1


def test_many_keys_on_both_shards_each_apply_once(cluster: Cluster) -> None:
    sources = {s: cluster.accounts_on(s, 3, f"many-src-{s}") for s in SHARDS}
    destinations = {s: cluster.accounts_on(s, 1, f"many-dst-{s}")[0] for s in SHARDS}
    for s in SHARDS:
        for account in sources[s]:
            cluster.deposit(account, 100_000)
        cluster.deposit(destinations[s], 1)
    plan = []  # (key, source, destination, amount, raw request)
    for i in range(30):
        shard_id = SHARDS[i % 2]
        src, dst = sources[shard_id][(i // 2) % 3], destinations[shard_id]
        raw = transfer_pb2.TransferRequest(
            source_account_id=src, destination_account_id=dst, amount=_eur(i + 1), reference=f"many-{i}"
        ).SerializeToString()
        plan.append((str(new_key()), src, dst, i + 1, raw))
    assert {cluster.owner(src) for _, src, _, _, _ in plan} == set(SHARDS)
    assert all(cluster.owner(src) == cluster.owner(dst) for _, src, dst, _, _ in plan)

    attempts = [(key, raw) for key, _, _, _, raw in plan for _ in range(5)]
    random.Random(7).shuffle(attempts)
    call = cluster.via_router("Transfer")
    with futures.ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(lambda a: (a[0], _attempt(call, a[1], a[0])), attempts))
    by_key: dict[str, list[tuple[str, object, object]]] = {}
    for key, result in outcomes:
        by_key.setdefault(key, []).append(result)

    entries_sql = "SELECT count(*) FROM ledger_entries WHERE kind = 'transfer_out' AND idempotency_key = %s"
    for key, src, _dst, _amount, raw in plan:
        response = _check_attempts(by_key[key])
        owner = cluster.owner(src)
        assert cluster.scalar(owner, entries_sql, (str(key),)) == 1, f"key {key} applied other than once"
        assert cluster.scalar(next(s for s in SHARDS if s != owner), entries_sql, (str(key),)) == 0
        kind, later, trailers = _attempt(call, raw, key)
        assert kind == "ok" and later == response and trailers["idempotency-replayed"] == "true"  # type: ignore[index]
    for s in SHARDS:
        for account in sources[s]:
            spent = sum(amount for _, src, _, amount, _ in plan if src == account)
            assert cluster.balance(account) == 100_000 - spent
        received = sum(amount for _, _, dst, amount, _ in plan if dst == destinations[s])
        assert cluster.balance(destinations[s]) == 1 + received


def _outcome(call: grpc.UnaryUnaryMultiCallable, raw: bytes, metadata: list[tuple[str, str]]) -> tuple:
    """Everything a caller can observe of one call, in a comparable form."""
    try:
        response, done = call.with_call(raw, metadata=metadata, timeout=10)
        return ("OK", response, sorted(done.trailing_metadata()))
    except grpc.RpcError as error:
        return (error.code(), error.details(), sorted(error.trailing_metadata()))


def test_shard_answers_reach_the_caller_as_the_shard_sent_them(cluster: Cluster) -> None:
    (src,) = cluster.accounts_on("shard-0", 1, "transparent-src")
    (dst,) = cluster.accounts_on("shard-0", 1, "transparent-dst")
    cluster.deposit(src, 10)
    cluster.deposit(dst, 1)
    owner = cluster.owner(src)

    # A stored business failure: first applied directly, then replayed through the router and directly.
    key = str(new_key())
    md = [("idempotency-key", key)]
    poor = transfer_pb2.TransferRequest(
        source_account_id=src, destination_account_id=dst, amount=_eur(1_000)
    ).SerializeToString()
    first = _outcome(cluster.direct(owner, "Transfer"), poor, md)
    routed = _outcome(cluster.via_router("Transfer"), poor, md)
    direct = _outcome(cluster.direct(owner, "Transfer"), poor, md)
    assert first[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert routed == direct
    assert ("idempotency-replayed", "true") in routed[2]
    with pytest.raises(grpc.RpcError) as caught:
        cluster.via_router("Transfer")(poor, metadata=md, timeout=10)
    status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
    info = error_details_pb2.ErrorInfo()
    assert status is not None and status.details[0].Unpack(info)
    assert info.reason == Reason.INSUFFICIENT_FUNDS and info.metadata["account_id"] == src

    # A validation failure from the shard (not stored), an unknown transfer, and a success.
    bad_currency = transfer_pb2.TransferRequest(
        source_account_id=src,
        destination_account_id=dst,
        amount=transfer_pb2.Money(amount_minor=1, currency="eur"),
    ).SerializeToString()
    unknown = transfer_pb2.GetTransferRequest(
        source_account_id=src, transfer_id=str(uuid.uuid4())
    ).SerializeToString()
    balance = transfer_pb2.GetBalanceRequest(account_id=src).SerializeToString()
    cases = [("Transfer", bad_currency, md), ("GetTransfer", unknown, []), ("GetBalance", balance, [])]
    for method, raw, metadata in cases:
        routed = _outcome(cluster.via_router(method), raw, metadata)
        direct = _outcome(cluster.direct(owner, method), raw, metadata)
        assert routed == direct, method
    assert _outcome(cluster.via_router("Transfer"), bad_currency, md)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert _outcome(cluster.via_router("GetTransfer"), unknown, [])[0] == grpc.StatusCode.NOT_FOUND
    assert _outcome(cluster.via_router("GetBalance"), balance, [])[0] == "OK"


def test_shard_map_reload_reroutes_calls(cluster: Cluster) -> None:
    (account,) = cluster.accounts_on("shard-0", 1, "reroute")
    cluster.deposit(account, 5)
    swapped = even_shard_map(
        {"shard-0": cluster.shards["shard-1"].address, "shard-1": cluster.shards["shard-0"].address}
    )
    _write_map(cluster.router_map_path, swapped)
    try:
        # shard-1's daemon now gets shard-0's accounts; it refuses them with its own UNAVAILABLE,
        # which the router passes through as sent (not retried, not turned into SHARD_UNAVAILABLE).
        deadline = time.monotonic() + 5
        while True:
            outcome = _outcome(
                cluster.via_router("GetBalance"),
                transfer_pb2.GetBalanceRequest(account_id=account).SerializeToString(),
                [],
            )
            if outcome[0] != "OK" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert outcome[0] == grpc.StatusCode.UNAVAILABLE
        assert "belongs to shard-0, not to shard-1" in outcome[1]
    finally:
        _write_map(cluster.router_map_path, cluster.shard_map)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert cluster.balance(account) == 5
            break
        except grpc.RpcError:
            time.sleep(0.05)
    assert cluster.balance(account) == 5


def test_shard_down_is_unavailable_with_retry_info_then_recovers(cluster: Cluster) -> None:
    (down_account,) = cluster.accounts_on("shard-1", 1, "down")
    (up_account,) = cluster.accounts_on("shard-0", 1, "up")
    cluster.deposit(up_account, 3)
    key = str(new_key())
    raw = transfer_pb2.DepositRequest(account_id=down_account, amount=_eur(40)).SerializeToString()
    cluster.shards["shard-1"].kill()
    try:
        with pytest.raises(grpc.RpcError) as caught:
            cluster.via_router("Deposit")(raw, metadata=[("idempotency-key", key)], timeout=10)
        error = caught.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
        assert status is not None
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and status.details[1].Unpack(retry)
        assert info.reason == Reason.SHARD_UNAVAILABLE and info.metadata["shard_id"] == "shard-1"
        assert retry.retry_delay.ToMilliseconds() > 0
        assert cluster.balance(up_account) == 3  # the other shard is unaffected
    finally:
        cluster.shards["shard-1"].start()
    # The caller's retry with the same key succeeds once the shard is back, and applies once.
    deadline = time.monotonic() + 10
    while True:
        try:
            cluster.via_router("Deposit")(raw, metadata=[("idempotency-key", key)], timeout=10)
            break
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() < deadline, "the router never reached the restarted shard"
            time.sleep(0.1)
    assert cluster.balance(down_account) == 40
    assert (
        cluster.scalar(
            "shard-1",
            "SELECT count(*) FROM ledger_entries WHERE kind = 'deposit' AND idempotency_key = %s",
            (str(key),),
        )
        == 1
    )


def test_sigterm_stops_the_router_with_exit_code_zero(cluster: Cluster) -> None:
    started = time.monotonic()
    code = cluster.router.terminate(timeout_s=10)
    assert code == 0
    assert time.monotonic() - started < 2 + 1  # ROUTER_SHUTDOWN_GRACE_S=2 in router_process
    assert json.loads(cluster.router.log_text().strip().splitlines()[-1])["msg"] == "stopped"
