"""The router ages out callers' connections (GOAWAY after ROUTER_MAX_CONNECTION_AGE_S), so long-lived
callers spread over new router pods; calls running on an aged connection still finish."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import grpc
import pytest

from shardrouter.v1 import transfer_pb2
from tests.connections import connection_drops
from tests.processes import router_process
from tests.router.fakeshard import FakeShard, SeenCall, single_shard_map, start_fake_shard

GET_BALANCE = "/shardrouter.v1.TransferService/GetBalance"
PROBE = transfer_pb2.GetBalanceRequest(account_id="probe").SerializeToString()


@pytest.fixture
def fake() -> Iterator[FakeShard]:
    shard = start_fake_shard()
    try:
        yield shard
    finally:
        shard.stop()


def test_connections_are_aged_out_and_running_calls_finish(tmp_path, fake: FakeShard) -> None:
    shard_map = tmp_path / "shard-map.json"
    shard_map.write_text(json.dumps(single_shard_map(fake.address)))
    router = router_process(
        tmp_path,
        shard_map=shard_map,
        extra_env={"ROUTER_MAX_CONNECTION_AGE_S": "1", "ROUTER_MAX_CONNECTION_AGE_GRACE_S": "5"},
    )
    router.start()
    try:
        # A call that outlives its connection's age: it must finish within the grace, not be cut.
        released = threading.Event()

        def slow(call: SeenCall, context: grpc.ServicerContext) -> bytes:
            released.wait(2.5)
            return call.request

        fake.reset(slow)
        with grpc.insecure_channel(router.address) as channel:
            future = channel.unary_unary(GET_BALANCE).future(PROBE, timeout=10)
            assert future.result(timeout=10) == PROBE
        fake.reset()
        assert connection_drops(router.address, GET_BALANCE, PROBE, watch_s=3.5) >= 2
    finally:
        router.kill()


def test_without_an_age_connections_stay(tmp_path, fake: FakeShard) -> None:
    """The control: the same caller on a router with ageing off keeps its one connection."""
    shard_map = tmp_path / "shard-map.json"
    shard_map.write_text(json.dumps(single_shard_map(fake.address)))
    router = router_process(tmp_path, shard_map=shard_map, extra_env={"ROUTER_MAX_CONNECTION_AGE_S": "0"})
    router.start()
    try:
        assert connection_drops(router.address, GET_BALANCE, PROBE, watch_s=3.5) == 0
    finally:
        router.kill()
