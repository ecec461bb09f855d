"""The shapes of gRPC's wire every part names: a metadata entry, the rich-details trailer, and a
`grpc.Status` to abort a call with.

grpc's own types are generic only in its type stubs, and `grpc.Status` is an interface without a
constructor, so the router, the shard daemon, the caller library and the tracing helpers all need
these three; they are written here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

#: One metadata entry (or trailer) as grpc hands it over: a `-bin` key carries bytes, others text.
MetadataEntry = tuple[str, str | bytes]

#: The trailer that carries a serialised `google.rpc.Status` with the rich error details.
DETAILS_TRAILER = "grpc-status-details-bin"


@dataclass(frozen=True)
class StatusAnswer(grpc.Status):
    """A status for `context.abort_with_status`: code, message and trailers (details included)."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[MetadataEntry, ...]


__all__ = [
    "DETAILS_TRAILER",
    "MetadataEntry",
    "StatusAnswer",
]
