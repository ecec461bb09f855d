"""Reading the HTTP `Idempotency-Key` request header into the key string, or a precise refusal.

The IETF Idempotency-Key draft defines the header as an RFC 8941 structured-field Item of type String
(`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`); Stripe-style clients and the source
document send the bare token form (`Idempotency-Key: 8e03978e-...`). Both are accepted, one key per
request, whichever form:

* the string form: the value starts with `"`; the quotes are not part of the key, `\\"` and `\\\\` are
  the only escapes (RFC 8941 section 3.3.3), and nothing may follow the closing quote (no parameters,
  no second list member);
* the bare form: the whole value is the key.

A key is 1-255 visible ASCII characters (0x21-0x7E): no space, no control character, nothing outside
ASCII. A bare value holding a comma is refused as a comma-joined list of several keys (what a proxy
that folds repeated headers produces), and so are two headers. Surrounding spaces and tabs are not
part of the value (HTTP trims them). Every refusal is an `IdempotencyKeyHeaderError` subclass whose
message says what is wrong and what to send; `to_error()` turns it into the `InvalidArgument` (reason
`IDEMPOTENCY_KEY_MISSING` or `IDEMPOTENCY_KEY_INVALID`) that the HTTP front answers with 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from shardrouter.core.errors import FieldViolation, InvalidArgument, Reason
from shardrouter.core.keys import MAX_KEY_LENGTH
from shardrouter.core.wire_names import IDEMPOTENCY_KEY_HEADER

__all__ = [
    "IDEMPOTENCY_KEY_HEADER",
    "MAX_KEY_LENGTH",
    "IdempotencyKeyBadCharacter",
    "IdempotencyKeyBadEscape",
    "IdempotencyKeyEmpty",
    "IdempotencyKeyHeaderError",
    "IdempotencyKeyMissing",
    "IdempotencyKeyRepeated",
    "IdempotencyKeyTooLong",
    "IdempotencyKeyTrailingText",
    "IdempotencyKeyUnterminated",
    "parse_idempotency_key",
]

_HINT = (
    f"send exactly one {IDEMPOTENCY_KEY_HEADER} header holding 1-{MAX_KEY_LENGTH} visible ASCII characters, "
    "as a quoted string "
    '("0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b") or bare (0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b), '
    "generated once per operation and sent unchanged on every retry"
)
_OWS = " \t"


class IdempotencyKeyHeaderError(ValueError):
    """The `Idempotency-Key` header is missing or malformed; `message` says how, for a person."""

    reason: ClassVar[str] = Reason.IDEMPOTENCY_KEY_INVALID

    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.message = f"{IDEMPOTENCY_KEY_HEADER} header: {problem}; {_HINT}"
        super().__init__(self.message)

    def to_error(self) -> InvalidArgument:
        """The refusal as our error type (INVALID_ARGUMENT, HTTP 400) with its reason and field."""
        return InvalidArgument(
            self.message,
            reason=self.reason,
            field_violations=[FieldViolation(IDEMPOTENCY_KEY_HEADER, self.problem)],
        )


class IdempotencyKeyMissing(IdempotencyKeyHeaderError):
    """No `Idempotency-Key` header on a keyed operation."""

    reason: ClassVar[str] = Reason.IDEMPOTENCY_KEY_MISSING


class IdempotencyKeyRepeated(IdempotencyKeyHeaderError):
    """Several headers, or one header holding a comma-joined list: which key is meant is unclear."""


class IdempotencyKeyEmpty(IdempotencyKeyHeaderError):
    """The header is present but its key has no characters (`Idempotency-Key:` or `""`)."""


class IdempotencyKeyTooLong(IdempotencyKeyHeaderError):
    """The key has more than 255 characters."""


class IdempotencyKeyBadCharacter(IdempotencyKeyHeaderError):
    """The key holds a space, a control character or a non-ASCII character."""


class IdempotencyKeyUnterminated(IdempotencyKeyHeaderError):
    """A quoted key without its closing quote."""


class IdempotencyKeyBadEscape(IdempotencyKeyHeaderError):
    """A backslash in a quoted key followed by something other than `"` or `\\`."""


class IdempotencyKeyTrailingText(IdempotencyKeyHeaderError):
    """Text after a quoted key's closing quote (parameters, or a second value)."""


def parse_idempotency_key(values: str | Sequence[str] | None) -> str:
    """The key carried by the `Idempotency-Key` header value(s), or an `IdempotencyKeyHeaderError`.

    `values` is every value of the header in the request (Starlette: `request.headers.getlist(...)`),
    a single value, or None when absent. Exactly one value is accepted.
    """
    if values is None:
        raise IdempotencyKeyMissing("the header is missing")
    if isinstance(values, str):
        values = [values]
    if not values:
        raise IdempotencyKeyMissing("the header is missing")
    if len(values) > 1:
        raise IdempotencyKeyRepeated(f"the request has {len(values)} such headers")
    value = values[0].strip(_OWS)
    key = _parse_string(value) if value.startswith('"') else _parse_bare(value)
    if not key:
        raise IdempotencyKeyEmpty("the key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise IdempotencyKeyTooLong(
            f"the key has {len(key)} characters, at most {MAX_KEY_LENGTH} are allowed"
        )
    return key


def _describe(char: str) -> str:
    if char == " ":
        return "a space"
    if char == "\t":
        return "a tab (U+0009)"
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"a control character (U+{ord(char):04X})"
    return f"a non-ASCII character (U+{ord(char):04X})"


def _check_char(char: str, position: int) -> None:
    if not "\x21" <= char <= "\x7e":
        raise IdempotencyKeyBadCharacter(
            f"character {position + 1} of the key is {_describe(char)}; only visible ASCII (0x21-0x7E) is allowed"
        )


def _parse_bare(value: str) -> str:
    for position, char in enumerate(value):
        _check_char(char, position)
    if "," in value:
        raise IdempotencyKeyRepeated(
            "the value is a comma-separated list of keys (several headers joined); "
            'a key holding a comma must be sent quoted, as "a,b"'
        )
    return value


def _parse_string(value: str) -> str:
    """RFC 8941 section 4.2.5 (Parsing a String), for a value that starts with `"`."""
    key: list[str] = []
    index = 1
    while index < len(value):
        char = value[index]
        if char == "\\":
            if index + 1 >= len(value):
                raise IdempotencyKeyUnterminated(
                    "the quoted key ends in a backslash, without its closing quote"
                )
            escaped = value[index + 1]
            if escaped not in '"\\':
                raise IdempotencyKeyBadEscape(
                    f'the quoted key has a backslash before {escaped!r}; only \\" and \\\\ are escapes'
                )
            key.append(escaped)
            index += 2
            continue
        if char == '"':
            rest = value[index + 1 :].strip(_OWS)
            if rest.startswith(","):
                raise IdempotencyKeyRepeated(
                    "the value is a comma-separated list of keys (several headers joined)"
                )
            if rest:
                raise IdempotencyKeyTrailingText(
                    f"text follows the quoted key's closing quote ({rest[:20]!r}); send the key alone"
                )
            return "".join(key)
        _check_char(char, len(key))
        key.append(char)
        index += 1
    raise IdempotencyKeyUnterminated("the quoted key has no closing quote")
