"""How every client of the shard daemons reaches them: one channel policy, one certificate rotation
rule, one "this daemon was not reached" rule.

Two parts call the shards: the router (`router.channels.ChannelPool`, `grpc.aio`, on its event loop)
and the outbox relay (`shardd.relay.ShardClients`, sync channels, from worker threads). They share what
is decided here and differ only where grpc's two APIs do (channel constructors, how a retired channel
is closed: an event-loop timer or a sweep at the next call).

Where the two used to differ, the better behaviour was kept for both:

- Keepalive: a ping every 30 s, also without calls in flight, and a connection is dead after 10 s
  without the answer (the router's). The relay pinged only during calls, so an idle relay found a
  vanished shard host (no FIN) only at its next delivery's deadline; the shards' servers allow pings
  every 5 s without calls (`grpcserver.server_options`), so idle pings are never answered GOAWAY.
- Reconnect backoff: first retry after 100 ms, at most 1 s apart (the router's); the relay waited
  200 ms up to 5 s, so a restarted shard was found again up to 5 s late, and every credit waited.
  A dead address costs one failed connect a second: nothing.
- grpc's own retries stay on (the router's): there is no retry policy in any service config, so
  grpc only retries transparently a call that never left the client - harmless, as nothing was
  sent. The relay switched them off ("the outbox is the retry loop") and got an UNAVAILABLE for a
  stream refused before it started, which cost it an outbox backoff round.
- Not reached: a daemon counts as not reached only on an UNAVAILABLE without our ErrorInfo in its
  details trailer - made by the transport (connection refused, reset, TLS failure), never by a shard
  (the router's rule). The relay treated every UNAVAILABLE as not reached and sent the call on to
  the shard's next daemon; but a shard's own UNAVAILABLE (its database down, saturated, the account
  moving) is an answer, with a reason the relay records, and its other daemons share its database:
  sending on at once only adds load where it hurts. The outbox backs off and retries instead.
- Certificate rotation: the client certificate files are looked at no more often than an interval
  (`CertificateRotation`); after a renewal new calls go out on new channels, and the replaced
  channels are closed only once every call that may still run on them has reached its (capped)
  deadline, plus a second (`retire_after_s`): both did this, in two copies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from shardrouter.core import tls
from shardrouter.core.errors import ERROR_DOMAIN
from shardrouter.core.wire import DETAILS_TRAILER, MetadataEntry

#: Channel arguments of every channel to a shard daemon.
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
#: grpc's default largest message, the least a channel to a shard accepts.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: How often, at most, client certificate files are looked at for a rotation (s), by default.
CERT_POLL_S = 1.0


def channel_options(
    *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, connections: int = 1
) -> list[tuple[str, int]]:
    """The arguments of a channel to a shard daemon; `connections` channels per address, each on
    its own TCP connection when more than one."""
    return [
        *CHANNEL_OPTIONS,
        ("grpc.max_send_message_length", max_message_bytes),
        # Responses (a transfer with its delivery history) may be larger than requests.
        ("grpc.max_receive_message_length", max(max_message_bytes, DEFAULT_MAX_MESSAGE_BYTES)),
        # Without it, channels with equal arguments share one connection (grpc's global pool).
        *((("grpc.use_local_subchannel_pool", 1),) if connections > 1 else ()),
    ]


def retire_after_s(call_timeout_s: float) -> float:
    """How long a replaced channel stays open: a call started on it just before may run this long."""
    return call_timeout_s + 1.0


def new_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: Iterable[tuple[str, int]]
) -> grpc.Channel:
    """A sync channel to `address`: TLS with `credentials`, plaintext without."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=list(options))
    return grpc.insecure_channel(address, options=list(options))


def new_aio_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: Iterable[tuple[str, int]]
) -> grpc.aio.Channel:
    """A `grpc.aio` channel to `address`: TLS with `credentials`, plaintext without."""
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=list(options))
    return grpc.aio.insecure_channel(address, options=list(options))


class CertificateRotation:
    """A client certificate on disk (or none: plaintext), looked at for a renewal at most every
    `interval_s`.

    `renewed()` is cheap while the interval runs; once it has passed it asks the files and returns
    new credentials after a complete renewal (a half-written set is skipped: the last good
    certificate stays in use). Not thread-safe: the relay calls it under its lock, the router from
    one task.
    """

    def __init__(
        self,
        files: tls.ClientCertificateFiles | None,
        interval_s: float = CERT_POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._files = files
        self._interval_s = interval_s
        self._clock = clock
        self._next_look = clock() + interval_s

    @property
    def credentials(self) -> grpc.ChannelCredentials | None:
        """The credentials of the certificate in use (None without TLS)."""
        return self._files.credentials if self._files is not None else None

    def wait_s(self) -> float:
        """How long until the files are looked at again (a polling task sleeps this long)."""
        return max(0.0, self._next_look - self._clock())

    def renewed(self) -> grpc.ChannelCredentials | None:
        """New credentials if the interval has passed and the files were renewed since, else None."""
        now = self._clock()
        if self._files is None or now < self._next_look:
            return None
        self._next_look = now + self._interval_s
        return self._files.changed()


def unreached(code: grpc.StatusCode, trailers: Iterable[MetadataEntry]) -> bool:
    """Whether a failed call never got an answer from the daemon (the channel could not reach it).

    Every status a shard sends carries `google.rpc.ErrorInfo` of our domain in the details trailer,
    an UNAVAILABLE of its own (database down) included - that one must reach the caller as sent.
    An UNAVAILABLE without it was made by the transport: connection refused, reset, or TLS failure.
    """
    if code is not grpc.StatusCode.UNAVAILABLE:
        return False
    return not has_our_error_info(trailers)


def has_our_error_info(trailers: Iterable[MetadataEntry]) -> bool:
    """Whether the trailers hold a `google.rpc.Status` with an ErrorInfo of the shardrouter domain."""
    return our_error_info(trailers) is not None


def our_error_info(trailers: Iterable[MetadataEntry]) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo of the shardrouter domain in the trailers' `google.rpc.Status`, if any."""
    for key, value in trailers:
        if key != DETAILS_TRAILER or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            continue
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                return info
    return None


__all__ = [
    "CERT_POLL_S",
    "CHANNEL_OPTIONS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "CertificateRotation",
    "channel_options",
    "has_our_error_info",
    "new_aio_channel",
    "new_channel",
    "our_error_info",
    "retire_after_s",
    "unreached",
]
