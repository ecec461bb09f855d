"""The gRPC service config for callers that use the bare generated stubs.

Transfer and Deposit retry ABORTED (the same key is in flight on the shard) and UNAVAILABLE, up to 5
attempts with exponential backoff. That is safe only because the caller sends the same
`idempotency-key` on every attempt - gRPC resends the call's metadata unchanged - and gRPC honours the
shard's `grpc-retry-pushback-ms` trailer as the delay before the next attempt. DEADLINE_EXCEEDED is
not listed: a gRPC deadline covers all attempts, so there is no time left to retry in. Reads get a
timeout (GetTransfer's covers its longest server-side wait of 30 s) and wait-for-ready.

    channel = grpc.insecure_channel(target, options=[
        ("grpc.service_config", load_service_config()), ("grpc.enable_retries", 1)])
"""

from __future__ import annotations

from importlib import resources

__all__ = ["SERVICE_CONFIG_RESOURCE", "channel_options", "load_service_config"]

SERVICE_CONFIG_RESOURCE = "service_config.json"


def load_service_config() -> str:
    """The service config JSON text shipped with this package."""
    return resources.files("shardrouter.client").joinpath(SERVICE_CONFIG_RESOURCE).read_text(encoding="utf-8")


def channel_options() -> list[tuple[str, str | int]]:
    """Channel options that install the service config and enable gRPC retries."""
    return [("grpc.service_config", load_service_config()), ("grpc.enable_retries", 1)]
