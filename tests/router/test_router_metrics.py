"""The router's /metrics endpoint counts every answered call by method, status code and shard."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from shardrouter.core.shardmap import ShardMap, even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, money
from tests.metrics import samples, scrape_text
from tests.processes import router_process
from tests.router.fakeshard import SeenCall, start_fake_shard


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_router_counts_answers_by_method_and_code(shard, tmp_path) -> None:
    path = tmp_path / "shard-map.yaml"
    path.write_text(yaml.safe_dump(shard_map_document(even_shard_map({"s0": f"127.0.0.1:{shard.port}"}))))
    router = start_router_thread(
        RouterSettings(listen="127.0.0.1:0", shard_map=str(path), dev_mode=True, metrics_port=free_port())
    )
    try:
        port = router.router.metrics_port
        assert port > 0
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            md = key_metadata()
            request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5))
            stub.Deposit(request, metadata=md)
            stub.Deposit(request, metadata=md)  # a replay is an OK answer too
            with pytest.raises(grpc.RpcError) as refused:
                stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(0)), metadata=md)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as not_found:
                stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id="nobody"))
            assert not_found.value.code() is grpc.StatusCode.NOT_FOUND
        # The router counts a call as its answer goes out, so the last one may land a moment after
        # the caller has it.
        deadline = time.monotonic() + 5
        text = scrape_text(port)
        while _value(text, 'router_requests_total{code="NOT_FOUND",method="GetBalance",protocol="grpc",shard="s0"}') < 1 and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
            text = scrape_text(port)
    finally:
        router.stop(0.5)
    # the shard answered every one (the zero amount too): all under its id
    assert _value(text, 'router_requests_total{code="OK",method="Deposit",protocol="grpc",shard="s0"}') == 2.0, text
    invalid = 'router_requests_total{code="INVALID_ARGUMENT",method="Deposit",protocol="grpc",shard="s0"}'
    assert _value(text, invalid) == 1.0, text
    assert _value(text, 'router_requests_total{code="NOT_FOUND",method="GetBalance",protocol="grpc",shard="s0"}') == 1.0, text
    timed = 'router_request_duration_seconds_count{code="OK",method="Deposit",protocol="grpc",shard="s0"}'
    assert _value(text, timed) == 2.0, text


# --- the shard label -------------------------------------------------------------------------------

#: How long the slow fake shard takes to answer (s): past the 0.25 s bucket, within the 0.5 s one.
SLOW_S = 0.3


def _account_on(shard_map: ShardMap, shard_id: str, prefix: str) -> str:
    return next(a for a in (f"{prefix}-{i}" for i in range(10_000)) if shard_map.shard_for(a).id == shard_id)


def _balance(call: SeenCall, context: grpc.ServicerContext) -> bytes:
    account = transfer_pb2.GetBalanceRequest.FromString(call.request).account_id
    return transfer_pb2.GetBalanceResponse(account_id=account, balance=money(5)).SerializeToString()


def _slow_balance(call: SeenCall, context: grpc.ServicerContext) -> bytes:
    time.sleep(SLOW_S)
    return _balance(call, context)


def test_a_call_counts_under_the_shard_it_was_forwarded_to(tmp_path: Path) -> None:
    """A real router process over three shards from its map: shard-0 fast, shard-1 slow (0.3 s),
    shard-2 unreachable. Each call counts, with its latency, under the shard it was forwarded to and
    under no other; one the router refuses before choosing a shard counts under shard="none". The
    HTTP front's calls count the same way."""
    fast, slow = start_fake_shard(), start_fake_shard()
    fast.reset(_balance)
    slow.reset(_slow_balance)
    shard_map = even_shard_map(
        {"shard-0": fast.address, "shard-1": slow.address, "shard-2": f"127.0.0.1:{free_port()}"}
    )
    on = {s: _account_on(shard_map, s, "acct") for s in ("shard-0", "shard-1", "shard-2")}
    path = tmp_path / "shard-map.yaml"
    path.write_text(yaml.safe_dump(shard_map_document(shard_map)))
    metrics_port, http_port = free_port(), free_port()
    router = router_process(
        tmp_path,
        shard_map=path,
        extra_env={"ROUTER_METRICS_PORT": str(metrics_port), "ROUTER_HTTP_LISTEN": f"127.0.0.1:{http_port}"},
    )
    router.start()
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            for _ in range(3):
                stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=on["shard-1"]), timeout=10)
            for _ in range(2):
                stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=on["shard-0"]), timeout=10)
            with pytest.raises(grpc.RpcError) as unreachable:
                stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=on["shard-2"]), timeout=10)
            assert unreachable.value.code() is grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as malformed:  # no routing account: no shard chosen
                stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=""), timeout=10)
            assert malformed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        url = f"http://127.0.0.1:{http_port}/v1/accounts/{on['shard-1']}/balance"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200
        deadline = time.monotonic() + 5
        while True:
            text = scrape_text(metrics_port)
            counts = samples(text, "router_requests_total")
            if sum(counts.values()) >= 8 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        router.kill()
        fast.stop()
        slow.stop()

    def series(code: str, shard: str, protocol: str = "grpc") -> tuple[tuple[str, str], ...]:
        return (("code", code), ("method", "GetBalance"), ("protocol", protocol), ("shard", shard))

    assert counts == {
        series("OK", "shard-1"): 3.0,  # three over gRPC
        series("OK", "shard-1", "http"): 1.0,  # one over HTTP
        series("OK", "shard-0"): 2.0,
        series("UNAVAILABLE", "shard-2"): 1.0,  # the router's SHARD_UNAVAILABLE names the shard it tried
        series("INVALID_ARGUMENT", "none"): 1.0,
    }, text
    assert (len(fast.calls), len(slow.calls)) == (2, 4)
    buckets = samples(text, "router_request_duration_seconds_bucket")
    # shard-1's slowness shows on shard-1 alone: none of its calls within 0.25 s, all within 0.5 s
    for protocol, calls in (("grpc", 3.0), ("http", 1.0)):
        assert buckets[tuple(sorted((*series("OK", "shard-1", protocol), ("le", "0.25"))))] == 0.0, text
        assert buckets[tuple(sorted((*series("OK", "shard-1", protocol), ("le", "0.5"))))] == calls, text
    assert buckets[tuple(sorted((*series("OK", "shard-0"), ("le", "0.25"))))] == 2.0, text
    durations = samples(text, "router_request_duration_seconds_count")
    assert durations == counts, text
