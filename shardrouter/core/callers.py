"""Who is calling: the `x-caller-id` metadata entry, the common name of a verified client
certificate, and the one rule for which of the two to believe (`CallerRule`).

The shard scopes every idempotency key by the caller (`shardd.identity`); the router overwrites the
entry with the name it verified (`router.metadata`); admission counts calls per caller
(`shardd.admission`). All three read the identity through the names here and decide by the same rule:
a verified certificate's name is the caller, unless that name is a trusted proxy's (the router's, a
shard's relay), which may name its own caller in `x-caller-id`; without a verified name the entry is
believed only in dev mode. Admission used to believe it from any unverified peer, so outside dev mode
a caller on a connection without a client certificate could be counted as another.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardrouter.core.errors import InvalidArgument, Reason
from shardrouter.core.wire import MetadataEntry

#: The metadata entry through which a trusted proxy (the router, a shard's relay) names its caller.
CALLER_METADATA = "x-caller-id"
#: What a caller name may be: 1-128 characters of letters, digits and _.:@/- (not starting with one of
#: the punctuation marks).
CALLER_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}")


@dataclass(frozen=True)
class CallerRule:
    """Where a caller identity may come from: a verified name, or a claim where one is believed."""

    #: Local development: an unverified peer's `x-caller-id` is believed.
    dev_mode: bool
    #: Verified names whose `x-caller-id` names the caller they speak for.
    trusted_proxies: frozenset[str] = frozenset()

    def believes_claim(self, verified: str | None) -> bool:
        """Whether an `x-caller-id` from a peer with this verified name (None: none) is believed."""
        if verified is not None:
            return verified in self.trusted_proxies
        return self.dev_mode

    def caller(self, verified: str | None, claimed: str | None) -> str | None:
        """The caller: the claim where it is believed, else the verified name; None when there is
        neither (nothing claimed, or an unverified peer's claim outside dev mode)."""
        if claimed is not None and self.believes_claim(verified):
            return claimed
        return verified


def claimed_caller(metadata: Iterable[MetadataEntry]) -> str | None:
    """The caller named by the one `x-caller-id` entry, if any; InvalidArgument if it is sent more
    than once or is no caller name."""
    values = [v for k, v in metadata if k == CALLER_METADATA]
    if not values:
        return None
    if len(values) > 1:
        raise InvalidArgument(
            f"the {CALLER_METADATA} metadata entry was sent {len(values)} times; send it once",
            reason=Reason.INVALID_CALLER,
        )
    value = values[0]
    if not isinstance(value, str) or CALLER_PATTERN.fullmatch(value) is None:
        raise InvalidArgument(
            f"the {CALLER_METADATA} metadata entry must be 1-128 characters of letters, digits and _.:@/-",
            reason=Reason.INVALID_CALLER,
        )
    return value


def is_plaintext(context: Any) -> bool:
    """Whether the call came over a connection without TLS (a sync or asyncio servicer context)."""
    return b"ssl" not in context.auth_context().get("transport_security_type", ())


def peer_common_name(context: Any) -> str | None:
    """The common name of the peer's verified client certificate, if any.

    `context` is a sync or asyncio servicer context: both have the same `auth_context()`.
    """
    names = context.auth_context().get("x509_common_name")
    if not names:
        return None
    first = names if isinstance(names, bytes) else next(iter(names))
    return str(first.decode("utf-8", "replace"))


__all__ = [
    "CALLER_METADATA",
    "CALLER_PATTERN",
    "CallerRule",
    "claimed_caller",
    "is_plaintext",
    "peer_common_name",
]
