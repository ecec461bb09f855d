"""The router: a stateless gRPC front door that forwards each call to the shard owning its account."""

from shardrouter.router.server import Router, RouterThread, start_router, start_router_thread
from shardrouter.router.settings import RouterSettings, parse_settings

__all__ = [
    "Router",
    "RouterSettings",
    "RouterThread",
    "parse_settings",
    "start_router",
    "start_router_thread",
]
