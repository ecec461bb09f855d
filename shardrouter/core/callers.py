"""Who is calling: the `x-caller-id` metadata entry, the identity of a verified client certificate
(`peer_identity`: its SPIFFE ID, else its common name), and the one rule for which of the two to
believe (`CallerRule`).

The shard scopes every idempotency key by the caller (`shardd.identity`); the router overwrites the
entry with the name it verified (`router.metadata`); admission counts calls per caller
(`shardd.admission`). All three read the identity through the names here and decide by the same rule:
a verified certificate's name is the caller, unless that name is a trusted proxy's (the router's, a
shard's relay), which may name its own caller in `x-caller-id`; without a verified name the entry is
believed only in dev mode. Admission used to believe it from any unverified peer, so outside dev mode
a caller on a connection without a client certificate could be counted as another.

A certificate's identity (`certificate_identity`) is its SPIFFE ID, the one `spiffe://` URI SAN
(`spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>` as cert-manager, Istio or SPIRE issue
it), when it has one: X.509 practice deprecates the common name for identity, and a CA policy (such as
cert-manager's approver-policy) can bind a URI SAN to the requester's service account, which it cannot
do for a free-text common name. Without a `spiffe://` URI SAN it is the common name, as before. A
certificate with several `spiffe://` URI SANs, or one that is no valid SPIFFE ID, has no identity at
all (never its common name: it names someone else, and `CN=router` must not make a trusted proxy of a
certificate that says it is another service). Trusted proxies are named the same way: by URI where
their certificates carry one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardrouter.core.errors import InvalidArgument, Reason
from shardrouter.core.wire import MetadataEntry
from shardrouter.core.wire_names import CALLER_METADATA

#: Longest caller name. SPIFFE allows IDs of up to 2048 bytes, but every key's scope (`method|caller`)
#: is stored in each idempotency record and its primary key, and travels in every forwarded call's
#: metadata: 512 holds any Kubernetes SPIFFE ID of a sensible trust domain
#: (`spiffe://<td>/ns/<63>/sa/<up to 253>`), while a longer name is far more likely a mistake or abuse.
MAX_CALLER_LENGTH = 512
#: What a caller name may be: 1-512 characters of letters, digits and _.:@/- (not starting with one of
#: the punctuation marks); SPIFFE IDs are such names.
CALLER_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:@/-]{{0,{MAX_CALLER_LENGTH - 1}}}")
#: The scheme of a SPIFFE ID's URI.
SPIFFE_SCHEME = "spiffe://"
#: A valid SPIFFE ID (SPIFFE-ID spec, section 2): a lower-case trust domain, then path segments of
#: letters, digits and ._- (neither "." nor ".."), no query, fragment, port or user info.
_SPIFFE_ID = re.compile(r"spiffe://[a-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")


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
            f"the {CALLER_METADATA} metadata entry must be 1-{MAX_CALLER_LENGTH} characters of "
            "letters, digits and _.:@/-",
            reason=Reason.INVALID_CALLER,
        )
    return value


def peer_common_name(context: Any) -> str | None:
    """The common name of the peer's verified client certificate, if any.

    `context` is a sync or asyncio servicer context: both have the same `auth_context()`.
    """
    names = context.auth_context().get("x509_common_name")
    if not names:
        return None
    first = names if isinstance(names, bytes) else next(iter(names))
    return str(first.decode("utf-8", "replace"))


def is_spiffe_id(uri: str) -> bool:
    """Whether `uri` is a valid SPIFFE ID (within the caller name's length)."""
    if len(uri) > MAX_CALLER_LENGTH or _SPIFFE_ID.fullmatch(uri) is None:
        return False
    return all(segment not in (".", "..") for segment in uri[len(SPIFFE_SCHEME) :].split("/")[1:])


def certificate_identity(common_name: str | None, uris: Iterable[str]) -> str | None:
    """The identity of a verified certificate with this common name and these URI SANs: its one
    `spiffe://` URI, else (no `spiffe://` URI at all) its common name. None when it has several
    `spiffe://` URIs or one that is no valid SPIFFE ID: such a certificate names no one we can tell."""
    spiffe = [uri for uri in uris if uri[: len(SPIFFE_SCHEME)].lower() == SPIFFE_SCHEME]
    if not spiffe:
        return common_name
    if len(spiffe) == 1 and is_spiffe_id(spiffe[0]):
        return spiffe[0]
    return None


def peer_uris(context: Any) -> tuple[str, ...]:
    """The URI SANs of the peer's verified client certificate (gRPC's `peer_uri` property)."""
    uris = context.auth_context().get("peer_uri") or ()
    if isinstance(uris, bytes):
        uris = (uris,)
    return tuple(uri.decode("utf-8", "replace") for uri in uris)


def peer_identity(context: Any) -> str | None:
    """Who the peer's verified client certificate says it is (`certificate_identity`): its SPIFFE ID,
    else its common name; None without a verified certificate (or with an ambiguous one).

    Every decision about who is calling is to read this, not `peer_common_name` (the router's does;
    the shard's key scope and admission, `shardd.identity` and `shardd.admission`, still read the
    common name until they switch). `context` is a sync or asyncio servicer context, or anything with
    the same `auth_context()` (the HTTP front's calls).
    """
    return certificate_identity(peer_common_name(context), peer_uris(context))


__all__ = [
    "CALLER_METADATA",
    "CALLER_PATTERN",
    "MAX_CALLER_LENGTH",
    "SPIFFE_SCHEME",
    "CallerRule",
    "certificate_identity",
    "claimed_caller",
    "is_spiffe_id",
    "peer_common_name",
    "peer_identity",
    "peer_uris",
]
