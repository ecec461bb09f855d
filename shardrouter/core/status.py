"""Answering a call with an error of ours: the one place a `ShardRouterError` becomes a call's status.

`errors.to_grpc_status` builds the status (code, message, rich details, retry pushback); these abort
the call with it, on a thread-pool server's context or on an asyncio one (whose abort is a
coroutine). The shard's interceptors, the idempotency interceptor and the router's forwarder all
answer their refusals through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from shardrouter.core.errors import ShardRouterError, to_grpc_status

if TYPE_CHECKING:
    import grpc.aio


def abort_with_error(
    context: grpc.ServicerContext,
    error: ShardRouterError,
    extra_trailers: Sequence[tuple[str, str | bytes]] = (),
) -> NoReturn:
    """End the call with `error`'s status and details, plus `extra_trailers`."""
    context.abort_with_status(to_grpc_status(error, extra_trailers))
    raise AssertionError("abort_with_status returned")  # pragma: no cover - grpc's abort raises


async def abort_with_error_async(
    context: grpc.aio.ServicerContext[Any, Any],
    error: ShardRouterError,
    extra_trailers: Sequence[tuple[str, str | bytes]] = (),
) -> NoReturn:
    """`abort_with_error` on a `grpc.aio.ServicerContext`."""
    status = to_grpc_status(error, extra_trailers)
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("abort returned")  # pragma: no cover - grpc's abort raises


__all__ = ["abort_with_error", "abort_with_error_async"]
