"""What every gRPC server of ours does alike, for the thread-pool server (the shard daemon) and the
asyncio server (the router): channel options, binding a port, health and reflection, graceful stop.

The two concurrency models differ only where grpc's APIs do (the asyncio health servicer's methods
are coroutines); everything else is one function used by both.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import _async as health_aio  # = grpc_health.v1.health.aio; not in the type stubs
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardrouter.core.interceptors import ServerInterceptorBase

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ListenError(RuntimeError):
    """The listen address cannot be bound (in use, or invalid)."""


def server_options(
    *,
    max_message_bytes: int,
    max_metadata_bytes: int,
    max_streams: int,
    share_port: bool = False,
    max_connection_age_s: float = 0.0,
    max_connection_age_grace_s: float = 0.0,
) -> list[tuple[str, int]]:
    """Channel arguments every server of ours uses; `share_port`: one of several serving processes
    of one daemon on one port (SO_REUSEPORT, the kernel spreads connections among them);
    `max_connection_age_s` (0: none): connections older than that get GOAWAY, their running calls
    `max_connection_age_grace_s` more to finish."""
    aging = (
        [
            ("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000)),
        ]
        if max_connection_age_s > 0
        else []
    )
    return [
        *aging,
        # grpcio sets SO_REUSEPORT by default: a second server on a busy port would silently share it.
        ("grpc.so_reuseport", 1 if share_port else 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max(max_message_bytes, 4 * 1024 * 1024)),
        ("grpc.max_metadata_size", max_metadata_bytes),
        ("grpc.max_concurrent_streams", max_streams),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def new_server(
    *,
    workers: int,
    max_calls: int,
    interceptors: Sequence[ServerInterceptorBase],
    options: list[tuple[str, int]],
) -> grpc.Server:
    """A thread-pool gRPC server (see README: sync measured faster than asyncio for the shard)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
        interceptors=list(interceptors),
        options=options,
        maximum_concurrent_rpcs=max_calls,
    )


def bind(
    server: grpc.Server | grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind `address` on either kind of server; the bound port. ListenError if it cannot be bound."""
    try:
        port = (
            server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        )
    except RuntimeError as exc:  # recent grpcio raises instead of returning port 0
        raise ListenError(f"cannot listen on {address}: the address is in use or invalid ({exc})") from None
    if port == 0:
        raise ListenError(f"cannot listen on {address}: the address is in use or invalid")
    return port


def _enable_reflection(server: grpc.Server | grpc.aio.Server, service_names: Sequence[str]) -> None:
    # enable_server_reflection registers the asyncio servicer on a grpc.aio server by itself.
    reflection.enable_server_reflection((*service_names, HEALTH_SERVICE, reflection.SERVICE_NAME), server)


def add_health_and_reflection(server: grpc.Server, service_names: Sequence[str]) -> health.HealthServicer:
    """Register gRPC health (every service NOT_SERVING until `mark_serving`) and reflection."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        servicer.set(name, _NOT_SERVING)
    _enable_reflection(server, service_names)
    return servicer


def mark_serving(servicer: health.HealthServicer, service_names: Sequence[str]) -> None:
    """Report every service SERVING."""
    for name in ("", *service_names):
        servicer.set(name, _SERVING)


def graceful_stop(server: grpc.Server, servicer: health.HealthServicer, grace_s: float) -> None:
    """Stop accepting calls (health NOT_SERVING first), let in-flight calls finish within `grace_s`."""
    servicer.enter_graceful_shutdown()
    server.stop(grace_s).wait(grace_s + 1)


async def add_aio_health_and_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> Any:
    """`add_health_and_reflection` for a grpc.aio server; returns its asyncio health servicer."""
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        await servicer.set(name, _NOT_SERVING)
    _enable_reflection(server, service_names)
    return servicer


async def aio_mark_serving(servicer: Any, service_names: Sequence[str]) -> None:
    """`mark_serving` for the asyncio health servicer."""
    for name in ("", *service_names):
        await servicer.set(name, _SERVING)


def listen_host(listen: str) -> str:
    """The host part of a gRPC listen address ("[::]:50061" -> "::", "0.0.0.0:50061" -> "0.0.0.0").

    Side endpoints (/metrics) bind the same host, so a loopback daemon exposes them on loopback only.
    """
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return host.strip("[]") or "0.0.0.0"  # noqa: S104 - an empty host means every interface


__all__ = [
    "HEALTH_SERVICE",
    "ListenError",
    "add_aio_health_and_reflection",
    "add_health_and_reflection",
    "aio_mark_serving",
    "bind",
    "graceful_stop",
    "listen_host",
    "mark_serving",
    "new_server",
    "server_options",
]
