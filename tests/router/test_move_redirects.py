"""The router follows a move at once: a call a shard refuses as not served there (ACCOUNT_MOVED, or
SLOT_RANGE_MOVING while a cut-over runs) reaches the account's owner on the same call, without
waiting for the router's next shard map poll.

Real shard daemons (gRPC on loopback, each over its own real PostgreSQL database) behind an in-process
router; every map poll interval is 60 s, so only an on-demand re-read of a map file, or the refusing
daemon's word, can explain where a call lands. The redirect cap runs against fake shards (real gRPC
servers on loopback) that claim ever newer maps.
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psycopg
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shardrouter.core.errors import Reason, Unavailable, to_grpc_status
from shardrouter.core.ownership import RangeOwner
from shardrouter.core.shardmap import (
    DEFAULT_SLOTS,
    ShardMap,
    even_shard_map,
    parse_shard_map,
    write_shard_map,
)
from shardrouter.core.tracing import new_tracer_provider
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.router.forwarding import MAX_REDIRECTS
from shardrouter.router.server import RouterThread, start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.shardd import fences
from shardrouter.shardd.fences import SlotFence
from shardrouter.shardd.ownership import record_owner
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import error_info, key_metadata, make_settings, money
from tests.metrics import scrape_text
from tests.router.fakeshard import SeenCall, start_fake_shard

SLOW_POLL_S = 60.0  # no poll happens during a test: what a call learns, it learns on demand
SHARDS = ("shard-a", "shard-b")


def _halves(version: int, ports: dict[str, int], lower: str) -> ShardMap:
    """Shard `lower` owns slots 0..8191, the other shard 8192..16383."""
    upper = next(s for s in SHARDS if s != lower)
    return parse_shard_map(
        {
            "version": version,
            "shards": [
                {"id": lower, "address": f"127.0.0.1:{ports[lower]}", "slot_ranges": [[0, 8191]]},
                {"id": upper, "address": f"127.0.0.1:{ports[upper]}", "slot_ranges": [[8192, 16383]]},
            ],
        },
        source=f"v{version}",
    )


def _account_in_lower_half(prefix: str) -> str:
    return next(
        a for a in (f"{prefix}-{i}" for i in range(10_000)) if zlib.crc32(a.encode()) % DEFAULT_SLOTS < 8192
    )


@dataclass
class Cluster:
    """Two real shard daemons, each on its own database, and a router, all started by the test."""

    postgres: LocalPostgres
    tmp: Path
    ports: dict[str, int] = field(default_factory=lambda: {s: free_port() for s in SHARDS})
    dsns: dict[str, str] = field(default_factory=dict)
    daemons: dict[str, ShardDaemon] = field(default_factory=dict)
    router: RouterThread | None = None
    channels: list[grpc.Channel] = field(default_factory=list)

    def start_shard(self, shard_id: str, map_path: Path, reload_s: float = SLOW_POLL_S) -> ShardDaemon:
        name = f"mv{uuid.uuid4().hex[:10]}"
        self.postgres.create_database(name)
        self.dsns[shard_id] = self.postgres.dsn_for(name)
        daemon = start_shard(
            make_settings(
                self.dsns[shard_id],
                shard_id=shard_id,
                listen=f"127.0.0.1:{self.ports[shard_id]}",
                shard_map=str(map_path),
                shard_map_reload_s=reload_s,
            )
        )
        self.daemons[shard_id] = daemon
        return daemon

    def start_router(self, map_path: Path, **settings: object) -> transfer_pb2_grpc.TransferServiceStub:
        values: dict[str, object] = {
            "listen": "127.0.0.1:0",
            "shard_map": str(map_path),
            "dev_mode": True,
            "metrics_port": 0,
            "reload_interval_s": SLOW_POLL_S,
        }
        values.update(settings)
        tracer_provider = values.pop("tracer_provider", None)
        self.router = start_router_thread(RouterSettings(**values), tracer_provider=tracer_provider)  # type: ignore[arg-type]
        channel = grpc.insecure_channel(f"127.0.0.1:{self.router.port}")
        self.channels.append(channel)
        return transfer_pb2_grpc.TransferServiceStub(channel)

    def scalar(self, shard_id: str, sql: str, params: tuple[object, ...] = ()) -> object:
        with psycopg.connect(self.dsns[shard_id], autocommit=True) as conn:
            row = conn.execute(sql, params).fetchone()  # type: ignore[arg-type]
        return None if row is None else row[0]

    def balance(self, shard_id: str, account: str) -> object:
        return self.scalar(shard_id, "SELECT balance FROM accounts WHERE id = %s", (account,))

    def records_of(self, shard_id: str, key: str) -> object:
        return self.scalar(shard_id, "SELECT count(*) FROM idempotency_record WHERE key = %s", (str(key),))

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        if self.router is not None:
            self.router.stop(0.2)
        for daemon in self.daemons.values():
            daemon.stop(0.2)


@pytest.fixture
def cluster(postgres: LocalPostgres, tmp_path: Path) -> Iterator[Cluster]:
    built = Cluster(postgres, tmp_path)
    try:
        yield built
    finally:
        built.stop()


def _deposit(
    stub: transfer_pb2_grpc.TransferServiceStub,
    account: str,
    metadata: list[tuple[str, str]],
    timeout: float = 10,
) -> tuple[transfer_pb2.DepositResponse, grpc.Call]:
    request = transfer_pb2.DepositRequest(account_id=account, amount=money(7))
    return stub.Deposit.with_call(request, metadata=metadata, timeout=timeout)  # type: ignore[no-any-return]


def _series(text: str, series: str) -> float:
    return next(
        (float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")), 0.0
    )


# --- ACCOUNT_MOVED ----------------------------------------------------------------------------------


def test_a_call_the_old_owner_refuses_reaches_the_new_owner_on_the_same_call(cluster: Cluster) -> None:
    """The map file moves the account to shard-b; the router (60 s poll) still sends it to shard-a,
    which refuses ACCOUNT_MOVED; the router re-reads the file and delivers the call to shard-b."""
    map_path = cluster.tmp / "shard-map.yaml"
    write_shard_map(map_path, _halves(1, cluster.ports, lower="shard-a"))
    account = _account_in_lower_half("moved")
    old_owner = cluster.start_shard("shard-a", map_path, reload_s=0.05)  # follows the move at once
    new_owner = cluster.start_shard("shard-b", map_path)  # 60 s: must re-read the file on demand
    exporter = InMemorySpanExporter()
    provider = new_tracer_provider("router/test", [exporter], batch=False)
    stub = cluster.start_router(map_path, metrics_port=free_port(), tracer_provider=provider)
    assert cluster.router is not None
    router = cluster.router.router
    try:
        _deposit(stub, account, key_metadata())
        assert cluster.balance("shard-a", account) == 7

        write_shard_map(map_path, _halves(2, cluster.ports, lower="shard-b"))
        deadline = time.monotonic() + 5
        while (
            old_owner.shard_map is not None
            and old_owner.shard_map.version != 2
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert old_owner.shard_map is not None and old_owner.shard_map.version == 2
        assert router.shard_maps.version == 1 and new_owner.shard_map is not None
        assert new_owner.shard_map.version == 1

        metadata = key_metadata()
        response, _ = _deposit(stub, account, metadata)
        assert response.balance.amount_minor == 7  # a new account on shard-b: the moved data is not there
        assert cluster.balance("shard-b", account) == 7
        assert cluster.balance("shard-a", account) == 7  # untouched on the old owner
        assert cluster.records_of("shard-a", metadata[0][1]) == 0
        assert router.shard_maps.version == 2  # re-read on the refusal, not polled
        assert new_owner.shard_map.version == 2  # re-read before it would have refused

        # A retry with the same key goes straight to the new owner and replays there.
        again, retry = _deposit(stub, account, metadata)
        assert again == response
        assert dict(retry.trailing_metadata())["idempotency-replayed"] == "true"
        assert cluster.balance("shard-b", account) == 7

        text = scrape_text(router.metrics_port)
        # the redirect under the shard that refused; each call under the shard that answered it (the
        # first deposit, before the move, under shard-a)
        assert _series(text, 'router_redirects_total{reason="ACCOUNT_MOVED",shard="shard-a"}') == 1.0, text
        assert _series(text, 'router_requests_total{code="OK",method="Deposit",protocol="grpc",shard="shard-b"}') == 2.0, text
        assert _series(text, 'router_requests_total{code="OK",method="Deposit",protocol="grpc",shard="shard-a"}') == 1.0, text
        redirected = [
            s
            for s in exporter.get_finished_spans()
            if (s.attributes or {}).get("router.move.redirect") is True
        ]
        assert len(redirected) == 1
        attributes = dict(redirected[0].attributes or {})
        assert attributes["router.move.reason"] == Reason.ACCOUNT_MOVED
        assert attributes["router.move.refused_by"] == "shard-a"
        assert attributes["shard.id"] == "shard-b"
    finally:
        provider.shutdown()


def test_the_router_follows_a_daemon_whose_map_is_newer_than_its_own(cluster: Cluster) -> None:
    """The router's own file still says version 1 (a lagging ConfigMap copy); the daemons' says 2, and
    the old owner's database keeps the moved slot fenced, as after a move. The old owner's refusal
    names the new owner and its map version: the router follows it, for the first call and its retry."""
    router_map = cluster.tmp / "router-map.yaml"
    shard_map = cluster.tmp / "shard-map.yaml"
    write_shard_map(router_map, _halves(1, cluster.ports, lower="shard-a"))
    write_shard_map(shard_map, _halves(2, cluster.ports, lower="shard-b"))
    account = _account_in_lower_half("hinted")
    cluster.start_shard("shard-a", shard_map)
    cluster.start_shard("shard-b", shard_map)
    with psycopg.connect(cluster.dsns["shard-a"], autocommit=True) as conn:
        fences.raise_fence(conn, _fence(account))
        with conn.transaction():  # what a move's commit records beside the fence
            fence = _fence(account)
            record_owner(conn, fence.move_id, RangeOwner(fence.slots, fence.first_slot, fence.last_slot, "shard-b", 2))
    stub = cluster.start_router(router_map, move_wait_s=0.0)  # no waiting: the answer must name the owner
    assert cluster.router is not None

    metadata = key_metadata()
    response, _ = _deposit(stub, account, metadata)
    assert response.balance.amount_minor == 7
    assert cluster.balance("shard-b", account) == 7
    assert cluster.records_of("shard-a", metadata[0][1]) == 0
    again, retry = _deposit(stub, account, metadata)
    assert again == response
    assert dict(retry.trailing_metadata())["idempotency-replayed"] == "true"
    assert cluster.router.router.shard_maps.version == 1  # its own file never changed


def test_daemons_whose_maps_disagree_end_with_the_shards_answer(cluster: Cluster) -> None:
    """Each daemon's map (same version) says the other one owns the account: the call ends with a
    refusal after one redirect, it does not bounce between them."""
    router_map = cluster.tmp / "router-map.yaml"
    write_shard_map(router_map, _halves(1, cluster.ports, lower="shard-a"))
    for shard_id in SHARDS:
        other = next(s for s in SHARDS if s != shard_id)
        own_map = cluster.tmp / f"{shard_id}-map.yaml"
        write_shard_map(own_map, _halves(2, cluster.ports, lower=other))
        cluster.start_shard(shard_id, own_map)
    account = _account_in_lower_half("contested")
    stub = cluster.start_router(router_map, metrics_port=free_port())
    assert cluster.router is not None

    metadata = key_metadata()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        _deposit(stub, account, metadata)
    assert time.monotonic() - started < 2
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    info, retry = error_info(refused.value)
    assert info.reason == Reason.ACCOUNT_MOVED and retry
    assert info.metadata["owner_shard_id"] == "shard-a"  # shard-b's word, passed through as it said it
    assert info.metadata["map_version"] == "2"
    for shard_id in SHARDS:
        assert cluster.records_of(shard_id, metadata[0][1]) == 0
        assert cluster.balance(shard_id, account) is None
    text = scrape_text(cluster.router.router.metrics_port)
    assert _series(text, 'router_redirects_total{reason="ACCOUNT_MOVED",shard="shard-a"}') == 1.0, text
    # the caller got shard-b's refusal: the call counts there
    refusal = 'router_requests_total{code="UNAVAILABLE",method="Deposit",protocol="grpc",shard="shard-b"}'
    assert _series(text, refusal) == 1.0, text


def test_redirects_per_call_are_capped() -> None:
    """Two shards that each name the other as owner with an ever newer map: the router gives up after
    MAX_REDIRECTS redirects and answers the last refusal."""
    versions = iter(range(2, 1000))
    lock = threading.Lock()
    fakes = [start_fake_shard(), start_fake_shard()]
    ids = ["shard-a", "shard-b"]

    def refuse_naming(other: str):  # type: ignore[no-untyped-def]
        def behave(call: SeenCall, context: grpc.ServicerContext) -> bytes:
            with lock:
                version = next(versions)
            refusal = Unavailable(
                f"account belongs to {other}",
                reason=Reason.ACCOUNT_MOVED,
                retry_after_ms=500,
                metadata={"owner_shard_id": other, "map_version": str(version)},
            )
            context.abort_with_status(to_grpc_status(refusal))
            raise AssertionError("abort_with_status returns only by raising")

        return behave

    fakes[0].reset(refuse_naming("shard-b"))
    fakes[1].reset(refuse_naming("shard-a"))
    path = Path(f"/tmp/move-cap-{uuid.uuid4().hex}.yaml")
    write_shard_map(path, even_shard_map({ids[0]: fakes[0].address, ids[1]: fakes[1].address}, version=1))
    router = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0", shard_map=str(path), dev_mode=True, metrics_port=0, reload_interval_s=60
        )
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                _deposit(stub, _account_in_lower_half("bounced"), key_metadata())
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert error_info(refused.value)[0].reason == Reason.ACCOUNT_MOVED
        assert len(fakes[0].calls) + len(fakes[1].calls) == MAX_REDIRECTS + 1
        # The same key and bytes every time.
        keys = {dict(c.metadata)["idempotency-key"] for f in fakes for c in f.calls}
        assert len(keys) == 1
        assert len({c.request for f in fakes for c in f.calls}) == 1
    finally:
        router.stop(0.2)
        for fake in fakes:
            fake.stop()
        path.unlink(missing_ok=True)


# --- SLOT_RANGE_MOVING ------------------------------------------------------------------------------


def _fence(account: str, move_id: str = "move-test") -> SlotFence:
    slot = zlib.crc32(account.encode()) % DEFAULT_SLOTS
    return SlotFence(move_id, DEFAULT_SLOTS, slot, slot)


def _lower_later(dsn: str, move_id: str, after_s: float) -> threading.Thread:
    def lower() -> None:
        time.sleep(after_s)
        with psycopg.connect(dsn, autocommit=True) as conn:
            fences.lower_fence(conn, move_id)

    thread = threading.Thread(target=lower, daemon=True)
    thread.start()
    return thread


def _one_shard_cluster(cluster: Cluster, **router_settings: object) -> transfer_pb2_grpc.TransferServiceStub:
    map_path = cluster.tmp / "shard-map.yaml"
    write_shard_map(map_path, _halves(1, cluster.ports, lower="shard-a"))
    cluster.start_shard("shard-a", map_path)
    cluster.start_shard("shard-b", map_path)
    return cluster.start_router(map_path, **router_settings)


def test_a_call_waits_out_a_cut_over_that_ends(cluster: Cluster) -> None:
    """The owner's database refuses the slot (fence up); the fence comes down after 0.3 s (a move
    called off): the router's call lands then, once, and the caller never sees the refusal."""
    stub = _one_shard_cluster(cluster, move_wait_s=5.0)
    account = _account_in_lower_half("fenced")
    with psycopg.connect(cluster.dsns["shard-a"], autocommit=True) as conn:
        fences.raise_fence(conn, _fence(account))
    lowering = _lower_later(cluster.dsns["shard-a"], "move-test", 0.3)
    started = time.monotonic()
    response, _ = _deposit(stub, account, key_metadata())
    took = time.monotonic() - started
    lowering.join(5)
    assert took >= 0.3
    assert response.balance.amount_minor == 7
    assert cluster.balance("shard-a", account) == 7


def test_a_call_waiting_on_a_cut_over_goes_to_the_new_owner_when_the_map_commits(cluster: Cluster) -> None:
    """The fence stays (the move commits): when the map file names the new owner, the waiting call is
    sent there, though the router's poll is 60 s away."""
    map_path = cluster.tmp / "shard-map.yaml"
    write_shard_map(map_path, _halves(1, cluster.ports, lower="shard-a"))
    cluster.start_shard("shard-a", map_path)
    cluster.start_shard("shard-b", map_path)
    stub = cluster.start_router(map_path, move_wait_s=5.0, metrics_port=free_port())
    assert cluster.router is not None
    account = _account_in_lower_half("committed")
    with psycopg.connect(cluster.dsns["shard-a"], autocommit=True) as conn:
        fences.raise_fence(conn, _fence(account))
    commit = threading.Timer(0.3, write_shard_map, (map_path, _halves(2, cluster.ports, lower="shard-b")))
    commit.start()
    try:
        response, _ = _deposit(stub, account, key_metadata())
    finally:
        commit.join(5)
    assert response.balance.amount_minor == 7
    assert cluster.balance("shard-b", account) == 7
    assert cluster.balance("shard-a", account) is None
    text = scrape_text(cluster.router.router.metrics_port)
    assert _series(text, 'router_redirects_total{reason="SLOT_RANGE_MOVING",shard="shard-a"}') == 1.0, text
    assert _series(text, 'router_requests_total{code="OK",method="Deposit",protocol="grpc",shard="shard-b"}') == 1.0, text


def test_a_cut_over_that_outlasts_the_wait_is_answered_retryably_with_nothing_applied(
    cluster: Cluster,
) -> None:
    stub = _one_shard_cluster(cluster, move_wait_s=0.3)
    account = _account_in_lower_half("stuck")
    with psycopg.connect(cluster.dsns["shard-a"], autocommit=True) as conn:
        fences.raise_fence(conn, _fence(account))
    metadata = key_metadata()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        _deposit(stub, account, metadata)
    took = time.monotonic() - started
    assert 0.3 <= took < 2.0
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    info, retry = error_info(refused.value)
    assert info.reason == Reason.SLOT_RANGE_MOVING and retry
    assert cluster.records_of("shard-a", metadata[0][1]) == 0
    assert cluster.balance("shard-a", account) is None


def test_the_wait_for_a_cut_over_ends_before_the_callers_deadline(cluster: Cluster) -> None:
    """A long move wait does not turn the shard's retryable answer into the caller's DEADLINE_EXCEEDED."""
    stub = _one_shard_cluster(cluster, move_wait_s=30.0)
    account = _account_in_lower_half("impatient")
    with psycopg.connect(cluster.dsns["shard-a"], autocommit=True) as conn:
        fences.raise_fence(conn, _fence(account))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        _deposit(stub, account, key_metadata(), timeout=0.6)
    assert time.monotonic() - started < 0.6
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert error_info(refused.value)[0].reason == Reason.SLOT_RANGE_MOVING
