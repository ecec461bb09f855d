"""A gRPC request over the router's message limit, over a real router on loopback: refused by the
router itself (RESOURCE_EXHAUSTED naming the limit, ErrorInfo REQUEST_TOO_LARGE), counted in
`router_requests_total`, never forwarded; one under the limit goes through."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from shardrouter.localcluster.postgres import free_port
from shardrouter.router.message_limit import grpc_receive_cap
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings
from shardrouter.v1 import transfer_pb2
from tests.helpers import error_info
from tests.metrics import Labels, scrape
from tests.router.fakeshard import single_shard_map, start_fake_shard

GET_BALANCE = "/shardrouter.v1.TransferService/GetBalance"
LIMIT = 64 * 1024



def _counts(port: int) -> dict[Labels, float]:
    return scrape(port, "router_requests_total")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def _request(size: int) -> bytes:
    """A valid GetBalance request of `size` bytes: padded with an unknown field (number 999), which
    protobuf keeps and the router's validation ignores."""
    valid = transfer_pb2.GetBalanceRequest(account_id="acct-1").SerializeToString()
    tag = _varint(999 << 3 | 2)
    padding = size - len(valid) - len(tag) - 3  # its length's varint: 3 bytes from 16 KiB to 2 MiB
    request = valid + tag + _varint(padding) + b"x" * padding
    assert len(request) == size, (len(request), size)
    return request


def test_an_oversized_request_is_refused_and_counted_by_the_router(tmp_path: Path) -> None:
    fake = start_fake_shard()
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(single_shard_map(fake.address)))
    metrics_port = free_port()
    router = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0",
            shard_map=str(map_path),
            dev_mode=True,
            metrics_port=metrics_port,
            max_message_bytes=LIMIT,
        )
    )
    try:
        options = [("grpc.max_send_message_length", 8 * 1024 * 1024)]
        with grpc.insecure_channel(f"127.0.0.1:{router.port}", options=options) as channel:
            call = channel.unary_unary(GET_BALANCE, request_serializer=None, response_deserializer=None)
            small = _request(LIMIT - 100)
            assert call(small, timeout=5) == small  # the fake shard echoes it
            before = _counts(metrics_port)
            oversized = _request(LIMIT + 10)
            with pytest.raises(grpc.RpcError) as caught:
                call(oversized, timeout=5)
            after = _counts(metrics_port)

            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"{len(oversized)} bytes" in str(caught.value.details())
            assert f"limit of {LIMIT} bytes" in str(caught.value.details())
            info, _ = error_info(caught.value)
            assert info.reason == "REQUEST_TOO_LARGE"
            assert len(fake.calls) == 1  # only the small one was forwarded
            delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
            assert delta == {
                (
                    ("code", "RESOURCE_EXHAUSTED"),
                    ("method", "GetBalance"),
                    ("protocol", "grpc"),
                    ("shard", "none"),
                ): 1.0
            }

            # Over grpc-core's hard cap the refusal is grpc-core's own: no ErrorInfo, not counted.
            with pytest.raises(grpc.RpcError) as caught:
                call(_request(grpc_receive_cap(LIMIT) + 10), timeout=5)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "grpc-status-details-bin" not in dict(caught.value.trailing_metadata() or ())
            assert len(fake.calls) == 1
    finally:
        router.stop(0.5)
        fake.stop()
