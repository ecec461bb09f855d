"""Idempotency keys: what a caller may send, how the shard reads it, and the UUIDv7 keys we make.

A key is one of two kinds (`parse_key`, the shard's authority on it):

* a UUID (RFC 9562) in canonical 8-4-4-4-12 hex form, in either case: canonicalised to lower case,
  so `0192D1A8-...` and `0192d1a8-...` are one key. A UUIDv7 (version 7, RFC variant) carries its
  creation time in its first 48 bits: the shard dates its record by that time (its partition), and
  so can refuse a late retry after the retention window as expired, and a key from the future.
  Every other UUID (v4 as the source document's client sends, v1, ...) is dated by its first
  receipt, except the nil UUID (all zeros), which is refused: it is what an unset UUID field
  serialises to, so every caller with that bug would share one key and replay each other's answer.
* an opaque key: 1-255 visible ASCII characters (0x21-0x7E), taken exactly as sent (case and all).
  A text that resembles a UUID but is not in canonical form (braces, no hyphens, a `urn:uuid:`
  prefix) is an opaque key too, so `{0192d1a8-...}` and `0192d1a8-...` are two keys.

Only UUIDv7 keys date themselves; the others are dated by the shard when it first receives them
(`IdempotencyKey.dated_at` is None). Python 3.11 has no `uuid.uuid7`, hence `new_key`.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from uuid import UUID

from shardrouter.core.errors import InvalidArgument, Reason
from shardrouter.core.wire_names import KEY_METADATA

#: The longest key accepted (an opaque key; a UUID has 36 characters).
MAX_KEY_LENGTH = 255
KEY_FORMAT_HINT = (
    "the idempotency-key metadata entry must be a UUID (RFC 9562) in canonical 8-4-4-4-12 form - "
    "best a UUIDv7, for example 0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b, whose own time dates the key - "
    f"or an opaque key of 1-{MAX_KEY_LENGTH} visible ASCII characters (0x21-0x7E: no spaces, no control "
    "or non-ASCII characters), generated once per business operation and sent unchanged on every retry"
)
_CANONICAL = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
# Far enough for any real clock, and leaves room for "time + retention" inside datetime's range.
_LAST_MS = int(datetime(9000, 1, 1, tzinfo=UTC).timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class IdempotencyKey:
    """A key as the shard knows it: its canonical text, its UUID if it is one, its own date if any."""

    #: The key: a UUID's canonical lower-case text, or an opaque key exactly as sent.
    text: str
    #: The UUID, when the key is one in canonical form (any version); None for an opaque key.
    uuid: UUID | None
    #: The creation time a UUIDv7 carries (its record's partition); None: dated by first receipt.
    dated_at: datetime | None

    @property
    def is_uuidv7(self) -> bool:
        """Whether the key dates itself (a UUIDv7): expiry and clock skew can be checked from it."""
        return self.dated_at is not None

    def describe(self) -> str:
        """What kind of key this is, for messages: "a UUIDv7", "a version 4 UUID", "an opaque key"."""
        if self.uuid is None:
            return "an opaque key"
        if self.dated_at is not None:
            return "a UUIDv7"
        if self.uuid.variant != uuid.RFC_4122:
            return "a UUID of a non-RFC 9562 variant"
        return f"a version {self.uuid.version} UUID"


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


def parse_key(text: str) -> IdempotencyKey:
    """The key in `text`, or InvalidArgument saying what a key may be.

    Only the canonical 8-4-4-4-12 form is read as a UUID (and folded to lower case); any other
    valid text is an opaque key, taken as sent.
    """
    if len(text) == 36 and _CANONICAL.fullmatch(text):
        key = uuid.UUID(text)
        if key.int == 0:
            raise InvalidArgument(
                f"invalid idempotency-key: the nil UUID ({key}) is almost always a client bug (a key "
                "field left unset, sent as zeros), and every call with it would replay the first one's "
                "answer; generate a new key per business operation, best a UUIDv7",
                reason=Reason.IDEMPOTENCY_KEY_INVALID,
            )
        if key.version == 7 and key.variant == uuid.RFC_4122:
            ms = key.int >> 80
            if ms > _LAST_MS:
                raise InvalidArgument(
                    "invalid idempotency-key: its UUIDv7 time lies in the far future (after the year 9000); "
                    "generate keys from the current time",
                    reason=Reason.IDEMPOTENCY_KEY_FROM_FUTURE,
                )
            return IdempotencyKey(str(key), key, datetime.fromtimestamp(ms / 1000, tz=UTC))
        return IdempotencyKey(str(key), key, None)
    if not text:
        raise _invalid("got 0 characters")
    if len(text) > MAX_KEY_LENGTH:
        raise _invalid(f"got {len(text)} characters, at most {MAX_KEY_LENGTH} are allowed")
    if not _VISIBLE_ASCII.fullmatch(text):
        position, char = next((i, c) for i, c in enumerate(text) if not "\x21" <= c <= "\x7e")
        raise _invalid(f"character {position + 1} is {_describe(char)}; only visible ASCII is allowed")
    return IdempotencyKey(text, None, None)


def key_time(key: uuid.UUID) -> datetime:
    """The creation time a UUIDv7 carries, to the millisecond, in UTC."""
    return datetime.fromtimestamp((key.int >> 80) / 1000, tz=UTC)


def _describe(char: str) -> str:
    if char == " ":
        return "a space"
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"a control character (U+{ord(char):04X})"
    return f"a non-ASCII character (U+{ord(char):04X})"


def _invalid(problem: str) -> InvalidArgument:
    return InvalidArgument(
        f"invalid idempotency-key ({problem}): {KEY_FORMAT_HINT}",
        reason=Reason.IDEMPOTENCY_KEY_INVALID,
    )


__all__ = [
    "KEY_FORMAT_HINT",
    "KEY_METADATA",
    "MAX_KEY_LENGTH",
    "IdempotencyKey",
    "derived_key",
    "key_time",
    "new_key",
    "parse_key",
]
