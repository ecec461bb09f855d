"""The `router` command: `router serve` runs the gRPC front door until SIGTERM.

The router is asyncio (`grpc.aio`, measured faster than sync for forwarding: see `router.server`), so
`serve` runs one event loop under `asyncio.run`; SIGTERM and SIGINT are handled on that loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from shardrouter.core import tracing
from shardrouter.core.grpcserver import ListenError
from shardrouter.core.logs import configure_logging
from shardrouter.core.settings_source import read_command_line, unknown_environment
from shardrouter.core.shardmap import ShardMapError
from shardrouter.core.termination import aio_termination_event
from shardrouter.router.server import start_router
from shardrouter.router.settings import ENV_PREFIX, RouterSettings, parse_settings

log = logging.getLogger("router")

USAGE = """usage: router COMMAND [--flag value ...]

commands:
  serve                      forward TransferService calls to the shard that owns each account

Flags go before or after the command; each one is also a ROUTER_* environment variable.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `router` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    read = read_command_line(
        args,
        RouterSettings,
        prog="router",
        prefix=ENV_PREFIX,
        usage=USAGE,
        commands={("serve",): 0},
        parse=parse_settings,
    )
    if isinstance(read, int):
        return read
    settings = read[0]
    configure_logging("router", level=settings.log_level, fmt=settings.log_format)
    for problem in unknown_environment(RouterSettings, ENV_PREFIX):
        log.warning(problem)
    # Off unless the OTEL_* environment asks for it (docs/tracing.md).
    tracing.configure_tracing("router")
    try:
        return asyncio.run(serve(settings))
    finally:
        tracing.shutdown_tracing()  # flush the spans still queued


async def serve(settings: RouterSettings) -> int:
    """Serve until SIGTERM or SIGINT, then stop gracefully; the exit code."""
    stop = aio_termination_event()  # before start-up: a signal during it stops the router right after
    try:
        router = await start_router(settings)
    except ShardMapError as exc:
        # A start-up configuration error: one clear line, no traceback.
        print(f"router: cannot start: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a TLS file that cannot be read
        print(f"router: cannot start: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    await stop.wait()
    await router.stop()
    log.info("stopped")
    return 0


__all__ = [
    "USAGE",
    "main",
    "serve",
]


if __name__ == "__main__":
    sys.exit(main())
