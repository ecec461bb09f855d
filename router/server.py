"""Assembles the router: shard map holder, channel pool, forwarder, health, reflection, TLS."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from router.channels import ChannelPool
from router.forwarding import Forwarder
from router.metadata import CallerPolicy
from router.routing import SERVICE, ShardMapHolder
from router.settings import RouterSettings
from shardrouter import grpcserver
from shardrouter.shardmap import ShardMap

log = logging.getLogger(__name__)


@dataclass
class Router:
    """A running router (what `start_router` returns)."""

    settings: RouterSettings
    server: grpc.Server
    port: int
    health: health.HealthServicer
    shard_maps: ShardMapHolder
    pool: ChannelPool

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: health NOT_SERVING, drain in-flight calls, then close the shard channels."""
        grpcserver.graceful_stop(
            self.server, self.health, self.settings.shutdown_grace_s if grace_s is None else grace_s
        )
        self.shard_maps.stop()
        self.pool.close()


def start_router(settings: RouterSettings) -> Router:
    """Load the shard map (ShardMapError if it is unusable), then serve."""
    pool = ChannelPool(
        credentials=(
            grpcserver.channel_credentials(
                settings.shard_tls_cert, settings.shard_tls_key, settings.shard_tls_ca
            )
            if settings.shard_tls_enabled
            else None
        ),
        max_message_bytes=settings.max_message_bytes,
        # In-flight calls on a channel dropped from the map may run until their (capped) deadline.
        retire_after_s=settings.max_deadline_s + 1,
    )

    def on_change(_old: ShardMap, new: ShardMap) -> None:
        pool.retain(shard.address for shard in new.shards)

    shard_maps = ShardMapHolder(
        settings.shard_map, interval_s=settings.reload_interval_s, on_change=on_change
    )
    forwarder = Forwarder(
        shard_maps=shard_maps,
        pool=pool,
        callers=CallerPolicy(verifies_callers=settings.verifies_callers, dev_mode=settings.dev_mode),
        forward_retries=settings.forward_retries,
        max_deadline_s=settings.max_deadline_s,
    )
    server = grpcserver.new_server(
        workers=settings.workers,
        interceptors=[],
        options=grpcserver.server_options(
            max_message_bytes=settings.max_message_bytes,
            max_metadata_bytes=settings.max_metadata_bytes,
            max_streams=settings.workers * 4,
        ),
    )
    server.add_generic_rpc_handlers((forwarder,))
    health_servicer = grpcserver.add_health_and_reflection(server, [SERVICE])
    credentials = (
        grpcserver.server_credentials(settings.tls_cert, settings.tls_key, settings.tls_ca)
        if settings.tls_enabled
        else None
    )
    try:
        port = grpcserver.bind(server, settings.listen, credentials)
    except RuntimeError as exc:  # grpcio >= 1.5x raises instead of returning port 0
        raise SystemExit(f"cannot listen on {settings.listen}: {exc}") from None
    server.start()
    shard_maps.start()
    grpcserver.mark_serving(health_servicer, [SERVICE])
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
    return Router(settings, server, port, health_servicer, shard_maps, pool)
