"""Watching a caller's gRPC connection: how often it was replaced while the caller kept calling."""

from __future__ import annotations

import threading
import time

import grpc


def connection_drops(address: str, method: str, request: bytes, watch_s: float) -> int:
    """How often a caller's channel lost its READY connection while it kept calling for `watch_s`."""
    drops = 0
    last: list[grpc.ChannelConnectivity] = []
    lock = threading.Lock()

    def on_change(state: grpc.ChannelConnectivity) -> None:
        nonlocal drops
        with lock:
            if last and last[-1] is grpc.ChannelConnectivity.READY and state is not state.READY:
                drops += 1
            last.append(state)

    with grpc.insecure_channel(address) as channel:
        channel.subscribe(on_change, try_to_connect=True)
        call = channel.unary_unary(method)
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            call(request, timeout=5)  # every call succeeds: an aged connection is replaced at once
            time.sleep(0.05)
        channel.unsubscribe(on_change)
    return drops
