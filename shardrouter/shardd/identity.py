"""Who is calling: the identity that goes into every idempotency key's scope.

With mTLS, the caller is the verified client certificate's identity (its SPIFFE ID, else its common
name, `core.callers.peer_identity`); a trusted proxy (the router)
may speak for the caller it authenticated through the `x-caller-id` entry. Without TLS the entry is
believed only in dev mode (`core.callers.CallerRule`, the rule admission and the router follow too).
Two callers therefore never share, nor read, each other's keys.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from shardrouter.core.callers import CallerRule, claimed_caller, peer_identity
from shardrouter.core.errors import Reason, Unauthenticated
from shardrouter.core.wire import MetadataEntry

ANONYMOUS = "anonymous"


class IdentityPolicy(CallerRule):
    """Where caller identities may come from, as the scope of a key needs one."""

    def caller_of(self, context: grpc.ServicerContext, metadata: Iterable[MetadataEntry]) -> str:
        """The caller identity for this call, or an error if none may be believed."""
        claimed = claimed_caller(metadata)  # a malformed entry is refused, believed or not
        caller = self.caller(peer_identity(context), claimed)
        if caller is not None:
            return caller
        if not self.dev_mode:
            raise Unauthenticated(
                "this shard requires a verified client certificate (mTLS); the caller has none",
                reason=Reason.UNAUTHENTICATED,
            )
        return ANONYMOUS


__all__ = [
    "ANONYMOUS",
    "IdentityPolicy",
]
