"""Idempotency keys: UUIDv7 (RFC 9562), whose first 48 bits are the creation time in Unix milliseconds.

The shard stores that time with each record (`key_time`) and partitions its key table by it, so the
key alone says which partition holds it and whether it is older than the retention window (a late
retry is then refused as expired instead of being applied again). Python 3.11 has no `uuid.uuid7`,
hence `new_key`.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from datetime import UTC, datetime

from shardrouter.core.errors import InvalidArgument, Reason

KEY_METADATA = "idempotency-key"
KEY_FORMAT_HINT = (
    "the idempotency-key metadata entry must be a UUIDv7 (RFC 9562) in canonical form, "
    "for example 0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b, generated once per business operation "
    "and sent unchanged on every retry"
)
_CANONICAL_LENGTH = 36
# Far enough for any real clock, and leaves room for "time + retention" inside datetime's range.
_LAST_MS = int(datetime(9000, 1, 1, tzinfo=UTC).timestamp() * 1000)


def new_key(now_ms: int | None = None) -> uuid.UUID:
    """A fresh UUIDv7 for the current time (or `now_ms`), with 74 random bits."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    if not 0 <= ms < 1 << 48:
        raise ValueError("UUIDv7 time must fit in 48 bits of Unix milliseconds")
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return uuid.UUID(int=value)


def derived_key(base: uuid.UUID, purpose: str) -> uuid.UUID:
    """A UUIDv7 with `base`'s time and bits derived from (base, purpose): same inputs, same key.

    Used for follow-up operations of a transfer (its cross-shard credit, its refund) so that every
    redelivery of one follow-up carries one key, and the key expires together with the transfer's.
    """
    digest = int.from_bytes(hashlib.sha256(base.bytes + purpose.encode()).digest()[:10], "big")
    ms = base.int >> 80
    value = (
        (ms << 80) | (0x7 << 76) | ((digest >> 62) & 0xFFF) << 64 | (0b10 << 62) | (digest & ((1 << 62) - 1))
    )
    return uuid.UUID(int=value)


def parse_key(text: str) -> uuid.UUID:
    """The key in `text`, or InvalidArgument saying what a key must be."""
    if len(text) != _CANONICAL_LENGTH:
        raise _invalid(f"got {len(text)} characters, expected 36")
    try:
        key = uuid.UUID(text)
    except ValueError:
        raise _invalid("not a UUID") from None
    if str(key) != text.lower():
        raise _invalid("not in canonical 8-4-4-4-12 hex form")
    if key.variant != uuid.RFC_4122 or key.version != 7:
        raise _invalid(
            f"a version {key.version} UUID, not version 7"
            if key.version
            else "not an RFC 9562 UUID, so not version 7"
        )
    if (key.int >> 80) > _LAST_MS:
        raise InvalidArgument(
            "invalid idempotency-key: its UUIDv7 time lies in the far future (after the year 9000); "
            "generate keys from the current time",
            reason=Reason.IDEMPOTENCY_KEY_FROM_FUTURE,
        )
    return key


def key_time(key: uuid.UUID) -> datetime:
    """The creation time a UUIDv7 carries, to the millisecond, in UTC."""
    return datetime.fromtimestamp((key.int >> 80) / 1000, tz=UTC)


def _invalid(problem: str) -> InvalidArgument:
    return InvalidArgument(
        f"invalid idempotency-key ({problem}): {KEY_FORMAT_HINT}",
        reason=Reason.IDEMPOTENCY_KEY_INVALID,
    )


__all__ = [
    "KEY_FORMAT_HINT",
    "KEY_METADATA",
    "derived_key",
    "key_time",
    "new_key",
    "parse_key",
]
