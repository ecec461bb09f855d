"""Assembles the router: shard map holder (the file, and the ConfigMap's watch when one is named),
channel pool, forwarder, health, reflection, TLS.

The router is a `grpc.aio` server forwarding over `grpc.aio` channels, because asyncio forwards faster
than a sync server here, measured: `python -m bench.forwarding 5 3`
(unary GetBalance through the router to a loopback echo shard, 32 calls in flight, each part in its
own process) gave ~1,100 rps for the previous sync `grpc.server` router and ~1,550 rps for an asyncio
forwarder (+40%); the benchmark now runs this router against a minimal sync forwarder kept in the
benchmark script. A forwarder spends its time waiting on the shard, which asyncio does without a
thread per call and without the thread pool's hand-offs.

`start_router` is a coroutine: it serves on the running event loop (`router serve` runs it under
`asyncio.run`). `start_router_thread` serves on an event loop of its own in a daemon thread, for
synchronous code such as tests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from opentelemetry import trace

from shardrouter.core import grpcserver, tls, tracing
from shardrouter.core.channels import CertificateRotation, retire_after_s
from shardrouter.core.metrics import MetricsServer, start_metrics_server
from shardrouter.core.shardmap import ShardMap
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.core.shardmap_watch import ConfigMapMapWatch, watch_shard_map_configmap
from shardrouter.router.channels import ChannelPool
from shardrouter.router.forwarding import Forwarder
from shardrouter.router.http.front import HttpFront, HttpServer, start_http_server
from shardrouter.router.message_limit import MessageLimit, grpc_receive_cap
from shardrouter.router.metadata import CallerPolicy
from shardrouter.router.metrics import GRPC, NO_SHARD, UNKNOWN_METHOD, RouterMetrics
from shardrouter.router.routing import SERVICE
from shardrouter.router.settings import RouterSettings

log = logging.getLogger(__name__)


@dataclass
class Router:
    """A running router (what `start_router` returns); lives on the event loop that started it."""

    settings: RouterSettings
    server: grpc.aio.Server
    port: int
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    shard_maps: ShardMapFile
    pool: ChannelPool
    #: The router's metrics and their /metrics endpoint (None when metrics_port is 0).
    metrics: RouterMetrics | None = None
    metrics_server: MetricsServer | None = None
    #: Tasks that live as long as the router (certificate rotation watch).
    background: list[asyncio.Task[None]] = field(default_factory=list)
    #: The HTTP/JSON front (None when `http_listen` is empty).
    http: HttpServer | None = None
    #: The watch of the shard map's ConfigMap (None when `shard_map_configmap` is empty).
    map_watch: ConfigMapMapWatch | None = None

    @property
    def http_port(self) -> int:
        """The bound HTTP port (0 without an HTTP front)."""
        return self.http.port if self.http is not None else 0

    @property
    def metrics_port(self) -> int:
        """The bound /metrics port (0 when metrics are off)."""
        return self.metrics_server.port if self.metrics_server is not None else 0

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: health NOT_SERVING, drain in-flight calls, then close the shard channels."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        for task in self.background:
            task.cancel()
        await self.health.enter_graceful_shutdown()
        # Both fronts drain at once: refuse new calls, let running ones finish; calls still running
        # after `grace` are cancelled (and with them their shard calls).
        await asyncio.gather(
            self.server.stop(grace), *([self.http.stop(grace)] if self.http is not None else [])
        )
        if self.map_watch is not None:
            await asyncio.to_thread(self.map_watch.stop)
        await asyncio.to_thread(self.shard_maps.stop)
        await self.pool.close()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
        if self.metrics is not None:
            self.metrics.shutdown()


async def start_router(
    settings: RouterSettings, *, tracer_provider: trace.TracerProvider | None = None
) -> Router:
    """Load the shard map (ShardMapError if it is unusable), then serve on the running event loop.

    Tracing: spans go to `tracer_provider` when given (tests), else to the global provider that
    `tracing.configure_tracing` installed; with neither, no tracing interceptor or span is made.

    Raises grpcserver.ListenError if the listen address cannot be bound, OSError if a TLS file cannot be read.
    """
    loop = asyncio.get_running_loop()
    traced = tracing.tracing_active(tracer_provider)
    metrics = RouterMetrics() if settings.metrics_port > 0 else None
    shard_certificates = (
        tls.ClientCertificateFiles(settings.shard_tls_cert, settings.shard_tls_key, settings.shard_tls_ca)
        if settings.shard_tls_enabled
        else None
    )
    pool = ChannelPool(
        credentials=shard_certificates.credentials if shard_certificates else None,
        max_message_bytes=settings.max_message_bytes,
        # In-flight calls on a channel dropped from the map may run until their (capped) deadline.
        retire_after_s=retire_after_s(settings.max_deadline_s),
        connections=settings.shard_connections,
    )

    def on_change(_old: ShardMap, new: ShardMap) -> None:
        # Called on the shard map's polling thread; the pool belongs to the event loop.
        addresses = new.addresses()
        loop.call_soon_threadsafe(pool.retain, addresses)

    shard_maps = ShardMapFile(settings.shard_map, interval_s=settings.reload_interval_s, on_change=on_change)
    if metrics is not None:
        metrics.follow_shard_map(shard_maps)
    forwarder = Forwarder(
        shard_maps=shard_maps,
        pool=pool,
        callers=CallerPolicy(verifies_callers=settings.verifies_callers, dev_mode=settings.dev_mode),
        forward_retries=settings.forward_retries,
        max_deadline_s=settings.max_deadline_s,
        move_wait_s=settings.move_wait_s,
        hedge_after_s=settings.hedge_after_ms / 1000,
        hedge_budget=settings.hedge_budget_percent / 100,
        tracer_provider=tracer_provider,
        traced=traced,
        metrics=metrics,
    )
    # The size limit first: grpc-core only enforces a larger hard cap, so that an oversized request
    # is refused (and counted) by the router (`message_limit`).
    interceptors: list[Any] = [MessageLimit(settings.max_message_bytes, metrics)]
    if traced:
        interceptors.append(tracing.aio_server_interceptor(tracer_provider))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=grpcserver.server_options(
            max_message_bytes=grpc_receive_cap(settings.max_message_bytes),
            max_metadata_bytes=settings.max_metadata_bytes,
            max_streams=settings.max_calls,
            max_connection_age_s=settings.max_connection_age_s,
            max_connection_age_grace_s=settings.max_connection_age_grace_s,
        ),
        maximum_concurrent_rpcs=settings.max_calls,
    )
    server.add_generic_rpc_handlers((forwarder,))
    health_servicer = await grpcserver.add_aio_health_and_reflection(server, [SERVICE])
    if metrics is not None:  # last: asked only for a method no other handler serves
        server.add_generic_rpc_handlers((UnknownMethods(metrics),))
    credentials = (
        tls.server_credentials(settings.tls_cert, settings.tls_key, settings.tls_ca)
        if settings.tls_enabled
        else None
    )
    port = grpcserver.bind(server, settings.listen, credentials)
    await server.start()
    shard_maps.start()
    map_watch: ConfigMapMapWatch | None = None
    http: HttpServer | None = None
    try:
        # Off the loop: loading the Kubernetes credentials reads files.
        map_watch = await asyncio.to_thread(
            watch_shard_map_configmap, settings.shard_map_configmap, shard_maps
        )
        if settings.http_listen:  # serving before health says SERVING, like the gRPC port
            front = HttpFront(
                forwarder, settings, tracer_provider=tracer_provider, traced=traced, metrics=metrics
            )
            http = await start_http_server(front, settings)
    except BaseException:
        await server.stop(0)
        if map_watch is not None:
            await asyncio.to_thread(map_watch.stop)
        await asyncio.to_thread(shard_maps.stop)
        await pool.close()
        raise
    await grpcserver.aio_mark_serving(health_servicer, [SERVICE])
    if not settings.verifies_callers and not settings.dev_mode:
        log.warning(
            "callers are not verified (no ROUTER_TLS_CA) and not in dev mode: every call will be refused"
        )
    log.info(
        "router serving on port %d with %d shards",
        port,
        len(shard_maps.current.shards),
        extra={"shard_map": str(shard_maps.path)},
    )
    metrics_server = (
        start_metrics_server(
            settings.metrics_port, metrics.registry, host=grpcserver.listen_host(settings.listen)
        )
        if metrics is not None
        else None
    )
    router = Router(
        settings,
        server,
        port,
        health_servicer,
        shard_maps,
        pool,
        metrics,
        metrics_server,
        http=http,
        map_watch=map_watch,
    )
    if shard_certificates is not None:
        router.background.append(
            loop.create_task(
                _follow_rotation(CertificateRotation(shard_certificates, settings.reload_interval_s), pool)
            )
        )
    return router


class UnknownMethods(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # not subscriptable at run time
    """The last handler the gRPC server asks: it serves nothing, so the server answers UNIMPLEMENTED
    as before, and counts the call (method "unknown", never the path a caller sent)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        """Count the call (in `router_requests_total` alone: it has no duration to speak of)."""
        self._metrics.observe(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED, shard=NO_SHARD, protocol=GRPC)


async def _follow_rotation(rotation: CertificateRotation, pool: ChannelPool) -> None:
    """Poll the router's client certificate files; on a rotation, new channels use the new ones."""
    while True:
        await asyncio.sleep(rotation.wait_s())
        # Off the loop: a stalled volume must not hold calls.
        credentials = await asyncio.to_thread(rotation.renewed)
        if credentials is not None:
            pool.replace_credentials(credentials)


class RouterThread:
    """A router serving on an event loop of its own, in a daemon thread, for synchronous callers."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        start_timeout_s: float = 30.0,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        try:
            self.router = asyncio.run_coroutine_threadsafe(
                start_router(settings, tracer_provider=tracer_provider), self._loop
            ).result(start_timeout_s)
        except BaseException:
            self._close_loop()
            raise

    @property
    def port(self) -> int:
        """The bound gRPC port."""
        return self.router.port

    @property
    def http_port(self) -> int:
        """The bound HTTP port (0 without an HTTP front)."""
        return self.router.http_port

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the router gracefully (see `Router.stop`), then its event loop."""
        grace = self.router.settings.shutdown_grace_s if grace_s is None else grace_s
        try:
            asyncio.run_coroutine_threadsafe(self.router.stop(grace), self._loop).result(grace + 15)
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


def start_router_thread(
    settings: RouterSettings, *, tracer_provider: trace.TracerProvider | None = None
) -> RouterThread:
    """Serve `settings` on a background event loop; `.port` and `.stop()` work from any thread."""
    return RouterThread(settings, tracer_provider=tracer_provider)


__all__ = [
    "Router",
    "RouterThread",
    "UnknownMethods",
    "start_router",
    "start_router_thread",
]
