"""Who is calling, as the wire carries it: the `x-caller-id` metadata entry and the common name of a
verified client certificate.

The shard scopes every idempotency key by the caller; the router overwrites the entry with the name it
verified; admission counts calls per caller. All of them read the identity through these two names.
"""

from __future__ import annotations

from typing import Any

#: The metadata entry through which a trusted proxy (the router, a shard's relay) names its caller.
CALLER_METADATA = "x-caller-id"


def peer_common_name(context: Any) -> str | None:
    """The common name of the peer's verified client certificate, if any.

    `context` is a sync or asyncio servicer context: both have the same `auth_context()`.
    """
    names = context.auth_context().get("x509_common_name")
    if not names:
        return None
    first = names if isinstance(names, bytes) else next(iter(names))
    return str(first.decode("utf-8", "replace"))


__all__ = ["CALLER_METADATA", "peer_common_name"]
