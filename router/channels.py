"""One gRPC channel per shard address, reused by every call and closed when the address leaves the map.

A channel multiplexes all calls to its shard over one HTTP/2 connection and reconnects by itself;
keepalive pings find a dead connection (a shard whose host vanished without a FIN) within seconds
instead of at the next call's deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import grpc

log = logging.getLogger(__name__)

#: Channel arguments of every channel to a shard.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # The shards' servers allow pings every 5 s without calls (`grpcserver.server_options`).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted shard is found again within about a second, not after grpc's default 20 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


class ChannelPool:
    """Channels by shard address; thread-safe."""

    def __init__(
        self,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 4 * 1024 * 1024,
        retire_after_s: float = 60.0,
    ) -> None:
        self._credentials = credentials
        self._options = [
            *CHANNEL_OPTIONS,
            ("grpc.max_send_message_length", max_message_bytes),
            # Responses (a transfer with its delivery history) may be larger than requests.
            ("grpc.max_receive_message_length", max(max_message_bytes, 4 * 1024 * 1024)),
        ]
        self._retire_after_s = retire_after_s
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._callables: dict[str, dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]]] = {}
        # Channels dropped from the map, each with the timer that will close it.
        self._retiring: dict[int, tuple[threading.Timer, grpc.Channel]] = {}
        self._closed = False

    def get(self, address: str) -> grpc.Channel:
        """The channel to `address`, created on first use."""
        channel = self._channels.get(address)  # lock-free fast path: dict reads are atomic
        if channel is not None:
            return channel
        with self._lock:
            if self._closed:
                raise RuntimeError("channel pool is closed")
            channel = self._channels.get(address)
            if channel is None:
                channel = self._new_channel(address)
                self._channels[address] = channel
                log.info("opened channel to %s", address)
            return channel

    def unary_bytes(self, address: str, method: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
        """A bytes-in, bytes-out callable for `method` on the channel to `address` (cached)."""
        callables = self._callables.get(address)
        callable_ = callables.get(method) if callables is not None else None
        if callable_ is not None:
            return callable_
        channel = self.get(address)
        # No (de)serialisers: the router forwards the caller's bytes and returns the shard's.
        callable_ = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        with self._lock:
            if self._channels.get(address) is channel:
                self._callables.setdefault(address, {})[method] = callable_
        return callable_

    def addresses(self) -> frozenset[str]:
        """Addresses with an open channel."""
        with self._lock:
            return frozenset(self._channels)

    def retain(self, addresses: Iterable[str]) -> None:
        """Drop the channels to every address not in `addresses`.

        A dropped channel is closed only after `retire_after_s`, so calls already in flight on it
        (forwarded under the old map) finish instead of being cancelled.
        """
        keep = set(addresses)
        with self._lock:
            gone = {a: c for a, c in self._channels.items() if a not in keep}
            for address, channel in gone.items():
                del self._channels[address]
                self._callables.pop(address, None)
                timer = threading.Timer(self._retire_after_s, self._close_retired, (address, channel))
                timer.daemon = True
                self._retiring[id(channel)] = (timer, channel)
                timer.start()
                log.info("retiring channel to %s: no longer in the shard map", address)

    def close(self) -> None:
        """Close every channel now, retiring ones included."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
            self._callables = {}
            retiring, self._retiring = list(self._retiring.values()), {}
        for timer, channel in retiring:
            timer.cancel()
            channels.append(channel)
        for channel in channels:
            channel.close()

    def _close_retired(self, address: str, channel: grpc.Channel) -> None:
        with self._lock:
            if self._retiring.pop(id(channel), None) is None:
                return  # `close` got there first
        channel.close()
        log.info("closed channel to %s", address)

    def _new_channel(self, address: str) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(address, self._credentials, options=self._options)
        return grpc.insecure_channel(address, options=self._options)
