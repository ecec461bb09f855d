"""`grpc.aio` channels per shard address, reused by every call and closed when the address leaves the map.

A channel multiplexes calls to its shard over one HTTP/2 connection and reconnects by itself;
keepalive pings find a dead connection (a shard whose host vanished without a FIN) within seconds
instead of at the next call's deadline. With `connections` > 1 each address gets that many channels,
each on its own TCP connection, and calls take them in turn: a shard served by several processes on
one port (SO_REUSEPORT) receives connections spread over its processes by the kernel, so one router
does not pin a whole shard's traffic to one of them. A call's turn passes over a channel in reconnect
backoff (its last connection attempt failed) while another is not: after a shard restarts, its
channels reconnect one by one, each on its own backoff.

The pool belongs to the router's event loop: every method is called on the loop's thread (the
forwarder's coroutines, and the shard map listener, which hops onto the loop), so it needs no lock.
Its channel options, TLS credentials and how long a replaced channel lives are those of every client
of the shards (`core.channels`, shared with the outbox relay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from shardrouter.core.channels import (
    CHANNEL_OPTIONS,
    DEFAULT_MAX_MESSAGE_BYTES,
    channel_options,
    new_aio_channel,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    #: A bytes-in, bytes-out callable of one method on one shard's channel.
    BytesCallable = grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]


class ChannelPool:
    """Channels by shard address; used from the router's event loop only."""

    def __init__(
        self,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retire_after_s: float = 60.0,
        connections: int = 1,
    ) -> None:
        if connections < 1:
            raise ValueError("connections must be at least 1")
        self._credentials = credentials
        self._connections = connections
        self._options = channel_options(max_message_bytes=max_message_bytes, connections=connections)
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
        return choices[self._reachable_turn(self._channels[address], self._turn)]

    @staticmethod
    def _reachable_turn(channels: tuple[grpc.aio.Channel, ...], turn: int) -> int:
        """The channel of `turn`, or the next one after it whose last connection attempt did not
        fail. A channel in reconnect backoff fails a call at once; after a shard restarts, its
        channels come back one by one, up to a second apart, and a call should not fail on one still
        waiting while another is connected again."""
        for step in range(len(channels)):
            index = (turn + step) % len(channels)
            if (
                channels[index].get_state(try_to_connect=False)
                is not grpc.ChannelConnectivity.TRANSIENT_FAILURE
            ):
                return index
        return turn % len(channels)

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
        return new_aio_channel(address, self._credentials, self._options)


__all__ = [
    "CHANNEL_OPTIONS",
    "ChannelPool",
]
