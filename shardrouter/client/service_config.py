"""The gRPC service config for callers that use the bare generated stubs, made from the RPC declarations.

Every keyed RPC of the public API (Transfer, Deposit, ...: `keyed` in its proto declaration) retries
ABORTED (the same key is in flight on the shard) and UNAVAILABLE, up to 5 attempts with exponential
backoff. That is safe only because the caller sends the same `idempotency-key` on every attempt - gRPC
resends the call's metadata unchanged - and gRPC honours the shard's `grpc-retry-pushback-ms` trailer
as the delay before the next attempt. DEADLINE_EXCEEDED is not listed: a gRPC deadline covers all
attempts, so there is no time left to retry in. Reads get no retry policy, a timeout and
wait-for-ready; a read that can wait on the server (a `wait_for_completion_ms` field, as GetTransfer
has) gets that wait's longest allowed value on top of its timeout.

    channel = grpc.insecure_channel(target, options=[
        ("grpc.service_config", load_service_config()), ("grpc.enable_retries", 1)])

The config is built from the declarations (`shardrouter.core.rpcs`) when asked for, so an RPC declared
in the proto is in it with no edit. `service_config.json` beside this module is the same config as a
file, for clients in other languages; a test fails when it is stale, and
`.venv/bin/python scripts/generate_service_config.py` rewrites it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shardrouter.core.rpcs import PUBLIC_SERVICE, RPCS, RpcDeclaration
from shardrouter.core.validation import MAX_WAIT_MS

__all__ = [
    "KEYED_RETRY_POLICY",
    "KEYED_TIMEOUT_S",
    "READ_TIMEOUT_S",
    "SERVICE_CONFIG_RESOURCE",
    "WAIT_FIELD",
    "channel_options",
    "load_service_config",
    "retryable_codes",
    "service_config",
    "write_service_config",
]

#: The shipped copy of the config, a file in this package (for clients in other languages).
SERVICE_CONFIG_RESOURCE = "service_config.json"

#: The retry policy of every keyed call; its codes are `retryable_codes` of a keyed declaration.
KEYED_RETRY_POLICY: Mapping[str, Any] = MappingProxyType(
    {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "2s", "backoffMultiplier": 2}
)
#: The deadline of a keyed call, all its attempts together.
KEYED_TIMEOUT_S = 10
#: The deadline of a read that does not wait on the server.
READ_TIMEOUT_S = 5
#: The request field with which a read asks the server to wait (milliseconds, at most MAX_WAIT_MS).
WAIT_FIELD = "wait_for_completion_ms"
_THROTTLING = {"maxTokens": 100, "tokenRatio": 0.1}


def retryable_codes(declaration: RpcDeclaration) -> tuple[str, ...]:
    """The status codes gRPC may retry a call of `declaration` on: a keyed call is safe to resend
    with its key (ABORTED: the key is in flight; UNAVAILABLE: not reached); a read is not retried."""
    return ("ABORTED", "UNAVAILABLE") if declaration.keyed else ()


def _timeout_s(declaration: RpcDeclaration) -> int:
    if declaration.keyed:
        return KEYED_TIMEOUT_S
    waits = WAIT_FIELD in declaration.request_type.DESCRIPTOR.fields_by_name
    return READ_TIMEOUT_S + (MAX_WAIT_MS // 1000 if waits else 0)


def _method_config(declarations: list[RpcDeclaration]) -> dict[str, Any]:
    first = declarations[0]
    config: dict[str, Any] = {
        "name": [{"service": d.service, "method": d.name} for d in declarations],
        "timeout": f"{_timeout_s(first)}s",
    }
    codes = retryable_codes(first)
    if codes:
        config["retryPolicy"] = {**KEYED_RETRY_POLICY, "retryableStatusCodes": list(codes)}
    else:
        config["waitForReady"] = True
    return config


def service_config(
    declarations: Iterable[RpcDeclaration] = RPCS, service: str = PUBLIC_SERVICE
) -> dict[str, Any]:
    """The service config of `service`'s methods among `declarations`, as a JSON-ready dict.

    Methods that get the same policy share one `methodConfig` entry, in declaration order.
    """
    groups: dict[tuple[tuple[str, ...], int], list[RpcDeclaration]] = {}
    for declaration in declarations:
        if declaration.service == service:
            key = (retryable_codes(declaration), _timeout_s(declaration))
            groups.setdefault(key, []).append(declaration)
    return {
        "methodConfig": [_method_config(group) for group in groups.values()],
        "retryThrottling": dict(_THROTTLING),
    }


def load_service_config() -> str:
    """The service config as JSON text (what `grpc.service_config` takes); the shipped file's text."""
    return json.dumps(service_config(), indent=2) + "\n"


def channel_options() -> list[tuple[str, str | int]]:
    """Channel options that install the service config and enable gRPC retries."""
    return [("grpc.service_config", load_service_config()), ("grpc.enable_retries", 1)]


def write_service_config(path: Path | None = None) -> Path:
    """Write the config to `path` (default: the shipped file in this package's source) and return it."""
    target = path or Path(__file__).with_name(SERVICE_CONFIG_RESOURCE)
    target.write_text(load_service_config(), encoding="utf-8")
    return target
