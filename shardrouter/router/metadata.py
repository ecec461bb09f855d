"""What metadata the router passes on: everything the caller sent, minus transport headers, with the
caller's identity made trustworthy.

The shards believe the router's `x-caller-id` (the router's client certificate is a trusted proxy to
them), so the router must never relay a caller's unverified claim outside dev mode: with mTLS from
callers it overwrites the entry with the verified certificate's identity (`core.callers.peer_identity`:
its SPIFFE ID, else its common name). Which to believe is the
rule every part follows (`core.callers.CallerRule`); no proxy in front of the router is trusted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc.aio

from shardrouter.core.callers import CALLER_METADATA, CallerRule, peer_identity
from shardrouter.core.errors import Reason, Unauthenticated
from shardrouter.core.wire import MetadataEntry

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    ServicerContext = grpc.aio.ServicerContext[bytes, bytes]

# Connection-level headers: gRPC sets its own on the router's outgoing call (a deadline travels as
# the call's timeout, not as a copied `grpc-timeout`), and HTTP/2 pseudo-headers (":authority") may
# not be set by an application at all.
_TRANSPORT_HEADERS = frozenset(
    {
        "user-agent",
        "host",
        "content-type",
        "te",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
        "grpc-timeout",
        "grpc-encoding",
        "grpc-accept-encoding",
        "grpc-status",
        "grpc-message",
        "grpc-previous-rpc-attempts",
    }
)


class CallContext(Protocol):
    """What forwarding needs of a call, whichever front received it: a `grpc.aio` servicer context, or
    the HTTP front's account of an HTTP request."""

    def invocation_metadata(self) -> Iterable[MetadataEntry] | None:
        """The call's metadata, as received."""
        ...

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        """The peer's verified certificate names (`x509_common_name`, `peer_uri`), as gRPC reports them."""
        ...

    def time_remaining(self) -> float | None:
        """Seconds left before the call's deadline (None: no deadline)."""
        ...


def forwardable(metadata: Iterable[MetadataEntry]) -> list[MetadataEntry]:
    """The entries to pass on, in order: all but pseudo-headers and transport headers."""
    return [(k, v) for k, v in metadata if not k.startswith(":") and k not in _TRANSPORT_HEADERS]


@dataclass(frozen=True)
class CallerPolicy:
    """Where the forwarded caller identity comes from."""

    #: The router's server requires client certificates: the verified identity (SPIFFE ID, else common
    #: name) is the caller.
    verifies_callers: bool
    #: Without verified callers, believe a caller-sent `x-caller-id` (local development only).
    dev_mode: bool

    @property
    def rule(self) -> CallerRule:
        """The caller rule at the router: with verified callers, their certificates' names only."""
        return CallerRule(dev_mode=self.dev_mode and not self.verifies_callers)

    def outgoing(self, context: CallContext) -> list[MetadataEntry]:
        """The metadata to send to the shard for this call."""
        metadata = forwardable(context.invocation_metadata() or ())
        verified = peer_identity(context) if self.verifies_callers else None
        if self.rule.believes_claim(verified):  # dev mode: the claim goes on as sent, the shard checks it
            return metadata
        if verified is not None:
            return [(k, v) for k, v in metadata if k != CALLER_METADATA] + [(CALLER_METADATA, verified)]
        if self.verifies_callers:  # with require_client_auth: a certificate with several SPIFFE IDs
            raise Unauthenticated(
                "the router requires a verified client certificate (mTLS) naming one caller (one "
                "spiffe:// URI SAN, or none and a common name); the caller has none",
                reason=Reason.UNAUTHENTICATED,
            )
        raise Unauthenticated(
            "the router requires callers to present a client certificate (mTLS) so that it can tell "
            "the shards who is calling; configure ROUTER_TLS_CA, or ROUTER_DEV_MODE for local runs",
            reason=Reason.UNAUTHENTICATED,
        )


__all__ = [
    "CallContext",
    "CallerPolicy",
    "MetadataEntry",
    "forwardable",
]
