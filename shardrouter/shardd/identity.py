"""Who is calling: the identity that goes into every idempotency key's scope.

With mTLS, the caller is the verified client certificate's common name; a trusted proxy (the router)
may speak for the caller it authenticated through the `x-caller-id` entry. Without TLS the entry is
believed only in dev mode. Two callers therefore never share, nor read, each other's keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from shardrouter.core.callers import CALLER_METADATA, peer_common_name
from shardrouter.core.errors import InvalidArgument, Reason, Unauthenticated

ANONYMOUS = "anonymous"
_CALLER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}")


@dataclass(frozen=True)
class IdentityPolicy:
    """Where caller identities may come from."""

    dev_mode: bool
    trusted_proxies: frozenset[str] = frozenset()

    def caller_of(self, context: grpc.ServicerContext, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The caller identity for this call, or an error if none may be believed."""
        claimed = _claimed_caller(metadata)
        peer = peer_common_name(context)
        if peer is not None:
            if claimed is not None and peer in self.trusted_proxies:
                return claimed
            return peer
        if not self.dev_mode:
            raise Unauthenticated(
                "this shard requires a verified client certificate (mTLS); the caller has none",
                reason=Reason.UNAUTHENTICATED,
            )
        return claimed or ANONYMOUS


def _claimed_caller(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    values = [v for k, v in metadata if k == CALLER_METADATA]
    if not values:
        return None
    if len(values) > 1:
        raise InvalidArgument(
            f"the {CALLER_METADATA} metadata entry was sent {len(values)} times; send it once",
            reason=Reason.INVALID_CALLER,
        )
    value = values[0]
    if not isinstance(value, str) or _CALLER.fullmatch(value) is None:
        raise InvalidArgument(
            f"the {CALLER_METADATA} metadata entry must be 1-128 characters of letters, digits and _.:@/-",
            reason=Reason.INVALID_CALLER,
        )
    return value


__all__ = [
    "ANONYMOUS",
    "IdentityPolicy",
]
