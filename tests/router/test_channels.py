"""Unit tests of the channel pool: one channel per shard address, retired when the address leaves."""

from __future__ import annotations

import time

import pytest

from router.channels import ChannelPool

SERVICE = "/shardrouter.v1.TransferService/"


def test_channel_pool_reuses_channels_and_retires_removed_addresses() -> None:
    pool = ChannelPool(retire_after_s=0.05)
    try:
        a = pool.get("127.0.0.1:1")
        assert pool.get("127.0.0.1:1") is a
        b = pool.get("127.0.0.1:2")
        assert b is not a
        assert pool.unary_bytes("127.0.0.1:2", SERVICE + "GetBalance") is pool.unary_bytes(
            "127.0.0.1:2", SERVICE + "GetBalance"
        )
        pool.retain(["127.0.0.1:2"])
        assert pool.addresses() == frozenset({"127.0.0.1:2"})
        assert pool.get("127.0.0.1:1") is not a  # a new channel if the address comes back
        time.sleep(0.3)  # the retired channel has been closed: using it fails
        with pytest.raises(ValueError, match="closed"):
            a.unary_unary("/x/y", request_serializer=None, response_deserializer=None)(b"", timeout=0.5)
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.get("127.0.0.1:3")


def test_a_call_in_flight_on_a_retired_channel_finishes() -> None:
    from tests.router.fakeshard import SeenCall, start_fake_shard

    fake = start_fake_shard()

    def slow(call: SeenCall, context: object) -> bytes:
        time.sleep(0.5)
        return call.request

    fake.reset(slow)  # type: ignore[arg-type]
    pool = ChannelPool(retire_after_s=3)
    try:
        future = pool.unary_bytes(fake.address, SERVICE + "GetBalance").future(b"\x0a\x01a", timeout=5)
        deadline = time.monotonic() + 5
        while not fake.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        pool.retain([])  # the address left the map while the call runs
        assert pool.addresses() == frozenset()
        assert future.result(timeout=5) == b"\x0a\x01a"
    finally:
        pool.close()
        fake.stop()
