"""The router: a stateless gRPC front door that forwards each call to the shard owning its account."""

from router.server import Router, start_router
from router.settings import RouterSettings, parse_settings

__all__ = ["Router", "RouterSettings", "parse_settings", "start_router"]
