"""The router's /metrics endpoint counts every answered call by method and status code."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
import yaml

from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, money


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


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
        text = _scrape(port)
        while _value(text, 'router_requests_total{code="NOT_FOUND",method="GetBalance"}') < 1 and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
            text = _scrape(port)
    finally:
        router.stop(0.5)
    assert _value(text, 'router_requests_total{code="OK",method="Deposit"}') == 2.0, text
    assert _value(text, 'router_requests_total{code="INVALID_ARGUMENT",method="Deposit"}') == 1.0, text
    assert _value(text, 'router_requests_total{code="NOT_FOUND",method="GetBalance"}') == 1.0, text
    assert _value(text, 'router_request_duration_seconds_count{code="OK",method="Deposit"}') == 2.0, text
