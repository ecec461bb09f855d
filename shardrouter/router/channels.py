"""`grpc.aio` channels per shard address, reused by every call and closed when the address leaves the map.

A channel multiplexes calls to its shard over one HTTP/2 connection and reconnects by itself;
keepalive pings find a dead connection (a shard whose host vanished without a FIN) within seconds
instead of at the next call's deadline. With `connections` > 1 each address gets that many channels,
each on its own TCP connection, and calls take them in turn: a shard served by several processes on
one port (SO_REUSEPORT) receives connections spread over its processes by the kernel, so one router
does not pin a whole shard's traffic to one of them.

The pool belongs to the router's event loop: every method is called on the loop's thread (the
forwarder's coroutines, and the shard map listener, which hops onto the loop), so it needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc
import grpc.aio

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

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    #: A bytes-in, bytes-out callable of one method on one shard's channel.
    BytesCallable = grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]


class ChannelPool:
    """Channels by shard address; used from the router's event loop only."""

    def __init__(
        self,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 4 * 1024 * 1024,
        retire_after_s: float = 60.0,
        connections: int = 1,
    ) -> None:
        if connections < 1:
            raise ValueError("connections must be at least 1")
        self._credentials = credentials
        self._connections = connections
        self._options = [
            *CHANNEL_OPTIONS,
            ("grpc.max_send_message_length", max_message_bytes),
            # Responses (a transfer with its delivery history) may be larger than requests.
            ("grpc.max_receive_message_length", max(max_message_bytes, 4 * 1024 * 1024)),
            # Without it, channels with equal arguments share one connection (grpc's global pool).
            *((("grpc.use_local_subchannel_pool", 1),) if connections > 1 else ()),
        ]
        self._retire_after_s = retire_after_s
        self._channels: dict[str, tuple[grpc.aio.Channel, ...]] = {}
        self._callables: dict[str, dict[str, tuple[BytesCallable, ...]]] = {}
        self._turn = 0
        # Channels dropped from the map, each with the timer that will close it.
        self._retiring: dict[int, tuple[asyncio.TimerHandle, grpc.aio.Channel]] = {}
        # Closes in progress, referenced so that they are not garbage-collected half way.
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    def get(self, address: str) -> grpc.aio.Channel:
        """The (first) channel to `address`, created on first use."""
        return self.channels(address)[0]

    def channels(self, address: str) -> tuple[grpc.aio.Channel, ...]:
        """The `connections` channels to `address`, created on first use."""
        channels = self._channels.get(address)
        if channels is None:
            if self._closed:
                raise RuntimeError("channel pool is closed")
            channels = self._channels[address] = tuple(
                self._new_channel(address) for _ in range(self._connections)
            )
            log.info("opened %d channel(s) to %s", len(channels), address)
        return channels

    def unary_bytes(self, address: str, method: str) -> BytesCallable:
        """A bytes-in, bytes-out callable for `method` to `address` (cached), on the channels in turn."""
        callables = self._callables.get(address)
        choices = callables.get(method) if callables is not None else None
        if choices is None:
            # No (de)serialisers: the router forwards the caller's bytes and returns the shard's.
            choices = tuple(channel.unary_unary(method, None, None) for channel in self.channels(address))
            self._callables.setdefault(address, {})[method] = choices
        if len(choices) == 1:
            return choices[0]
        self._turn += 1
        return choices[self._turn % len(choices)]

    def addresses(self) -> frozenset[str]:
        """Addresses with an open channel."""
        return frozenset(self._channels)

    def retain(self, addresses: Iterable[str]) -> None:
        """Drop the channels to every address not in `addresses` (call on the event loop).

        A dropped channel is closed only after `retire_after_s`, so calls already in flight on it
        (forwarded under the old map) finish instead of being cancelled.
        """
        keep = set(addresses)
        loop = asyncio.get_running_loop()
        for address in [a for a in self._channels if a not in keep]:
            self._callables.pop(address, None)
            for channel in self._channels.pop(address):
                timer = loop.call_later(self._retire_after_s, self._close_retired, address, channel)
                self._retiring[id(channel)] = (timer, channel)
            log.info("retiring channels to %s: no longer in the shard map", address)

    def replace_credentials(self, credentials: grpc.ChannelCredentials) -> None:
        """Use `credentials` for every channel from now on (a rotated client certificate).

        The current channels are retired like addresses that left the map: calls in flight on them
        finish, new calls get new channels that handshake with the new certificate.
        """
        self._credentials = credentials
        addresses = list(self._channels)
        self.retain(())
        log.info("client certificate rotated: new channels to %d shard(s)", len(addresses))

    async def close(self) -> None:
        """Close every channel now, retiring ones included."""
        self._closed = True
        channels = [channel for group in self._channels.values() for channel in group]
        self._channels, self._callables = {}, {}
        for timer, channel in self._retiring.values():
            timer.cancel()
            channels.append(channel)
        self._retiring = {}
        await asyncio.gather(*(channel.close(None) for channel in channels), *self._closing)

    def _close_retired(self, address: str, channel: grpc.aio.Channel) -> None:
        if self._retiring.pop(id(channel), None) is None:
            return  # `close` got there first
        task = asyncio.get_running_loop().create_task(channel.close(None))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        log.info("closed channel to %s", address)

    def _new_channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is not None:
            return grpc.aio.secure_channel(address, self._credentials, options=self._options)
        return grpc.aio.insecure_channel(address, options=self._options)


__all__ = [
    "CHANNEL_OPTIONS",
    "ChannelPool",
]
