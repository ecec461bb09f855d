"""Unit tests of the channel pool: one channel per shard address, retired when the address leaves.

The pool holds `grpc.aio` channels and belongs to an event loop, so each test runs on one.
"""

from __future__ import annotations

import asyncio
import time

import grpc.aio
import pytest

from shardrouter.router.channels import ChannelPool

SERVICE = "/shardrouter.v1.TransferService/"


def test_channel_pool_reuses_channels_and_retires_removed_addresses() -> None:
    async def scenario() -> None:
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
            await asyncio.sleep(0.3)  # the retired channel has been closed: using it fails
            with pytest.raises(grpc.aio.UsageError, match="closed"):
                await a.unary_unary("/x/y", None, None)(b"", timeout=0.5)
        finally:
            await pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            pool.get("127.0.0.1:3")

    asyncio.run(scenario())


def test_a_call_in_flight_on_a_retired_channel_finishes() -> None:
    from tests.router.fakeshard import SeenCall, start_fake_shard

    fake = start_fake_shard()

    def slow(call: SeenCall, context: object) -> bytes:
        time.sleep(0.5)
        return call.request

    fake.reset(slow)  # type: ignore[arg-type]

    async def scenario() -> None:
        pool = ChannelPool(retire_after_s=3)
        try:
            call = pool.unary_bytes(fake.address, SERVICE + "GetBalance")(b"\x0a\x01a", timeout=5)
            deadline = time.monotonic() + 5
            while not fake.calls and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            pool.retain([])  # the address left the map while the call runs
            assert pool.addresses() == frozenset()
            assert await asyncio.wait_for(call, timeout=5) == b"\x0a\x01a"
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        fake.stop()


def test_a_call_passes_over_a_channel_in_reconnect_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a shard restarts, one of its channels is connected again while another still waits out
    its reconnect backoff: every call goes out on the connected one instead of failing on the other."""
    from shardrouter.core import channels as core_channels
    from tests.router.fakeshard import start_fake_shard

    # A backoff far longer than the test, so that the channel that failed to connect stays failed.
    long_backoff = tuple(
        (name, 60_000 if "reconnect_backoff" in name else value)
        for name, value in core_channels.CHANNEL_OPTIONS
    )
    monkeypatch.setattr(core_channels, "CHANNEL_OPTIONS", long_backoff)
    first = start_fake_shard()
    port = first.port

    async def scenario() -> None:
        pool = ChannelPool(connections=2)
        address = f"127.0.0.1:{port}"
        waiting, connected = pool.channels(address)
        method = SERVICE + "GetBalance"
        for channel in (waiting, connected):
            await channel.unary_unary(method, None, None)(b"", timeout=5, wait_for_ready=True)
        first.stop()  # the shard goes away: its connections close
        for _ in range(100):  # `waiting` tries to connect while nothing listens: into its backoff
            try:
                await waiting.unary_unary(method, None, None)(b"", timeout=1)
            except grpc.aio.AioRpcError as error:
                assert error.code() is grpc.StatusCode.UNAVAILABLE
            if waiting.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                break
            await asyncio.sleep(0.01)
        assert waiting.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE
        second = start_fake_shard(port)  # the shard is back on its port
        try:
            await connected.unary_unary(method, None, None)(b"", timeout=5, wait_for_ready=True)
            assert waiting.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE
            answers = [await pool.unary_bytes(address, method)(b"\x0a\x01a", timeout=5) for _ in range(6)]
            assert answers == [b"\x0a\x01a"] * 6
        finally:
            await pool.close()
            second.stop()

    asyncio.run(scenario())
