"""Reading the HTTP `Prefer: wait=N` request preference (RFC 7240), and writing `Preference-Applied`.

A keyed call that finds an earlier attempt with its key still in flight is answered 409 with
`Retry-After` at once. A client that prefers to wait for that attempt's outcome sends
`Prefer: wait=N` (seconds); the front forwards it to the shard as the `idempotency-wait-ms` metadata
entry, and the shard waits for the original at most the least of N, the call's deadline and its own
maximum, then answers with the original's stored outcome (a replay) or, past that bound, the 409.
`Preference-Applied: wait=M` on the answer says the preference was honoured and the wait granted
(M seconds, N capped at the shard's maximum).

Parsing: preferences are comma-separated, in one header or several, each `token[=word]` with
`;`-parameters (ignored here), names in any letter case; other preferences are left alone, and only
the first `wait` counts (RFC 7240, section 2). A `wait` value that is not a whole number of seconds
(negative, a fraction, text) is refused 400 rather than ignored: a client asking to wait and
silently not waiting would retry against 409s it did not expect. A very large one is capped (the
shard caps it at its maximum anyway), and `Preference-Applied` says what was granted.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardrouter.core.errors import FieldViolation, InvalidArgument, Reason

#: Request header (standard, RFC 7240): the client's preferences; `wait=N` is the one the front reads.
PREFER_HEADER = "Prefer"
#: Response header (standard, RFC 7240): the preferences honoured; `wait=M`, the wait granted.
PREFERENCE_APPLIED_HEADER = "Preference-Applied"
#: A `wait` longer than this (s) is capped to it before forwarding (the shard caps it far lower).
MAX_FORWARDED_WAIT_S = 86_400

__all__ = [
    "MAX_FORWARDED_WAIT_S",
    "PREFERENCE_APPLIED_HEADER",
    "PREFER_HEADER",
    "PreferWaitError",
    "parse_prefer_wait",
    "preference_applied",
]


class PreferWaitError(ValueError):
    """A `wait` preference whose value is not a whole number of seconds."""

    def __init__(self, value: str) -> None:
        self.problem = f"wait={value[:40]} is not a whole number of seconds, 0 or more"
        super().__init__(
            f"{PREFER_HEADER} header: {self.problem}; send {PREFER_HEADER}: wait=N to let a duplicate "
            "of a request still in progress wait up to N seconds for its outcome"
        )

    def to_error(self) -> InvalidArgument:
        """The refusal as our error type (INVALID_ARGUMENT, HTTP 400)."""
        return InvalidArgument(
            str(self),
            reason=Reason.INVALID_REQUEST,
            field_violations=[FieldViolation(PREFER_HEADER, self.problem)],
        )


def parse_prefer_wait(values: Sequence[str]) -> int | None:
    """The seconds of the first `wait` preference among the `Prefer` header values, or None."""
    for preference in _split(",".join(values)):
        head = preference.split(";", 1)[0]
        name, sep, value = head.partition("=")
        if name.strip().lower() != "wait":
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        if not sep or not value.isascii() or not value.isdigit():
            raise PreferWaitError(value)
        return MAX_FORWARDED_WAIT_S if len(value) > 6 else min(int(value), MAX_FORWARDED_WAIT_S)
    return None


def preference_applied(granted_ms: str | None) -> str | None:
    """The `Preference-Applied` value for the shard's granted wait (ms, from its trailer), if any."""
    if granted_ms is None or not granted_ms.isdigit():
        return None
    return f"wait={int(granted_ms) // 1000}"


def _split(header: str) -> list[str]:
    """The comma-separated members of a header value, commas inside quoted strings kept."""
    members: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in header:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            members.append("".join(current))
            current = []
            continue
        current.append(char)
    members.append("".join(current))
    return [m.strip() for m in members if m.strip()]
