"""Who may do what: the authorization policy, in the format of gRPC's gRFC A43, plus an account match.

A policy is a JSON document:

    {"name": "payments",
     "deny_policies":  [{"name": "...", "source": {"principals": [...]},
                         "request": {"paths": [...], "accounts": [...]}}],
     "allow_policies": [{"name": "...", "source": {...}, "request": {...}}]}

A call is denied if any deny policy matches it; else allowed if any allow policy matches it; else
denied (gRFC A43). Within one policy every field given must match: `principals` (any of its patterns
matches the caller identity), `paths` (any matches the gRPC method path, "/pkg.Service/Method"),
`accounts` (any matches the call's account: the request field the RPC declares as its routing field,
`core.rpcs`); a field left out matches anything. A policy with `accounts` never matches a call that
has no account. A pattern is exact (`team-a`), a prefix (`team-a-*`), a suffix (`*-eu`) or `*` (anything).

The document is validated strictly: unknown keys, wrong types, empty names or lists, duplicate policy
names and A43 fields not supported here (`headers`) are refused with an error naming the place
(`allow_policies[1].request.accounts[0]: ...`). The model only; the shard daemon enforces it
(`authorization.py`, beside this module).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

__all__ = [
    "ALLOW_ALL_DOCUMENT",
    "MAX_PATTERNS",
    "MAX_POLICIES",
    "MAX_POLICY_BYTES",
    "AuthzPolicy",
    "AuthzPolicyError",
    "Decision",
    "Pattern",
    "Rule",
    "load_policy_file",
    "parse_policy",
    "parse_policy_text",
]

#: Largest policy file read (bytes): a policy is a few KiB; anything far larger is a mistake or an attack.
MAX_POLICY_BYTES = 1024 * 1024
#: Most policies (deny and allow together) and most patterns in one list.
MAX_POLICIES = 10_000
MAX_PATTERNS = 10_000
#: Longest name or pattern (characters).
MAX_TEXT = 1024
#: A document that allows every call (tests, a deliberate open shard).
ALLOW_ALL_DOCUMENT = '{"name": "allow-all", "allow_policies": [{"name": "all"}]}'

_TOP_KEYS = frozenset({"name", "deny_policies", "allow_policies"})
_RULE_KEYS = frozenset({"name", "source", "request"})
_SOURCE_KEYS = frozenset({"principals"})
_REQUEST_KEYS = frozenset({"paths", "accounts"})
#: gRFC A43 fields this implementation does not support: refused rather than silently ignored.
_UNSUPPORTED = {"headers": "header matches are not supported (only paths and accounts)"}


class AuthzPolicyError(ValueError):
    """A policy document that cannot be used; the message names the place."""


class _Kind(Enum):
    ANY = "any"
    EXACT = "exact"
    PREFIX = "prefix"
    SUFFIX = "suffix"


@dataclass(frozen=True, slots=True)
class Pattern:
    """One A43 string match: exact, `prefix*`, `*suffix` or `*`."""

    text: str
    kind: _Kind
    stem: str

    @classmethod
    def parse(cls, text: str, where: str) -> Pattern:
        """The pattern `text`; AuthzPolicyError (naming `where`) if it is no pattern."""
        if not text:
            raise AuthzPolicyError(f"{where}: an empty pattern matches nothing; use '*' for anything")
        if len(text) > MAX_TEXT:
            raise AuthzPolicyError(f"{where}: pattern longer than {MAX_TEXT} characters")
        if text == "*":
            return cls(text, _Kind.ANY, "")
        stars = text.count("*")
        if stars == 0:
            return cls(text, _Kind.EXACT, text)
        if stars == 1 and text.endswith("*"):
            return cls(text, _Kind.PREFIX, text[:-1])
        if stars == 1 and text.startswith("*"):
            return cls(text, _Kind.SUFFIX, text[1:])
        raise AuthzPolicyError(
            f"{where}: {text!r} is no pattern: '*' may only stand alone, end a prefix or start a suffix"
        )

    def matches(self, value: str) -> bool:
        """Whether `value` matches."""
        if self.kind is _Kind.ANY:
            return True
        if self.kind is _Kind.EXACT:
            return value == self.stem
        if self.kind is _Kind.PREFIX:
            return value.startswith(self.stem)
        return value.endswith(self.stem)


def _any_matches(patterns: tuple[Pattern, ...] | None, value: str | None) -> bool:
    if patterns is None:
        return True
    if value is None:
        return False
    return any(p.matches(value) for p in patterns)


@dataclass(frozen=True, slots=True)
class Rule:
    """One named deny or allow policy; None fields match anything."""

    name: str
    principals: tuple[Pattern, ...] | None = None
    paths: tuple[Pattern, ...] | None = None
    accounts: tuple[Pattern, ...] | None = None

    def matches(self, principal: str, path: str, account: str | None) -> bool:
        """Whether every field given matches (an account rule never matches a call without account)."""
        return (
            _any_matches(self.principals, principal)
            and _any_matches(self.paths, path)
            and _any_matches(self.accounts, account or None)
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy says about one call, and which policy decided it (None: no allow matched)."""

    allowed: bool
    rule: str | None


@dataclass(frozen=True, slots=True)
class AuthzPolicy:
    """A loaded policy: deny policies, allow policies, and the hash of the document it came from."""

    name: str
    deny: tuple[Rule, ...]
    allow: tuple[Rule, ...]
    #: First 16 hex digits of the SHA-256 of the document's bytes (which file is in force).
    digest: str = ""

    @property
    def uses_accounts(self) -> bool:
        """Whether any policy matches on accounts (else a call's request need not be decoded)."""
        return any(r.accounts is not None for r in (*self.deny, *self.allow))

    def decide(self, principal: str, path: str, account: str | None) -> Decision:
        """Deny if a deny policy matches; else allow if an allow policy matches; else deny."""
        for rule in self.deny:
            if rule.matches(principal, path, account):
                return Decision(False, rule.name)
        for rule in self.allow:
            if rule.matches(principal, path, account):
                return Decision(True, rule.name)
        return Decision(False, None)


def _object(value: object, where: str, keys: frozenset[str]) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise AuthzPolicyError(f"{where}: expected an object, got {type(value).__name__}")
    for key in value:
        if key in _UNSUPPORTED:
            raise AuthzPolicyError(f"{where}.{key}: {_UNSUPPORTED[key]}")
        if key not in keys:
            raise AuthzPolicyError(f"{where}.{key}: unknown key (expected one of {', '.join(sorted(keys))})")
    return value


def _name(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise AuthzPolicyError(f"{where}: expected a string, got {type(value).__name__}")
    if not value.strip():
        raise AuthzPolicyError(f"{where}: must not be empty")
    if len(value) > MAX_TEXT:
        raise AuthzPolicyError(f"{where}: longer than {MAX_TEXT} characters")
    return value


def _list(value: object, where: str, most: int) -> Sequence[object]:
    if not isinstance(value, list):
        raise AuthzPolicyError(f"{where}: expected a list, got {type(value).__name__}")
    if len(value) > most:
        raise AuthzPolicyError(f"{where}: more than {most} entries")
    return value


def _patterns(container: Mapping[str, object], key: str, where: str) -> tuple[Pattern, ...] | None:
    if key not in container:
        return None
    here = f"{where}.{key}"
    items = _list(container[key], here, MAX_PATTERNS)
    if not items:
        raise AuthzPolicyError(f"{here}: an empty list; leave the field out to match anything")
    out: list[Pattern] = []
    for i, item in enumerate(items):
        spot = f"{here}[{i}]"
        if not isinstance(item, str):
            raise AuthzPolicyError(f"{spot}: expected a string pattern, got {type(item).__name__}")
        pattern = Pattern.parse(item, spot)
        if key == "paths" and pattern.kind in (_Kind.EXACT, _Kind.PREFIX) and not item.startswith("/"):
            raise AuthzPolicyError(
                f'{spot}: a path starts with \'/\' ("/pkg.Service/Method", "/pkg.Service/*")'
            )
        out.append(pattern)
    return tuple(out)


def _rule(value: object, where: str) -> Rule:
    body = _object(value, where, _RULE_KEYS)
    if "name" not in body:
        raise AuthzPolicyError(f"{where}.name: missing")
    name = _name(body["name"], f"{where}.name")
    source = _object(body.get("source", {}), f"{where}.source", _SOURCE_KEYS)
    request = _object(body.get("request", {}), f"{where}.request", _REQUEST_KEYS)
    return Rule(
        name=name,
        principals=_patterns(source, "principals", f"{where}.source"),
        paths=_patterns(request, "paths", f"{where}.request"),
        accounts=_patterns(request, "accounts", f"{where}.request"),
    )


def _rules(document: Mapping[str, object], key: str, seen: set[str]) -> tuple[Rule, ...]:
    if key not in document:
        return ()
    out: list[Rule] = []
    for i, item in enumerate(_list(document[key], key, MAX_POLICIES)):
        rule = _rule(item, f"{key}[{i}]")
        if rule.name in seen:
            raise AuthzPolicyError(f"{key}[{i}].name: {rule.name!r} is the name of another policy")
        seen.add(rule.name)
        out.append(rule)
    return tuple(out)


def parse_policy(document: object, digest: str = "") -> AuthzPolicy:
    """The policy of a decoded JSON document; AuthzPolicyError naming the first bad place."""
    top = _object(document, "policy", _TOP_KEYS)
    if "name" not in top:
        raise AuthzPolicyError("name: missing (the policy's name)")
    name = _name(top["name"], "name")
    if "allow_policies" not in top:
        raise AuthzPolicyError("allow_policies: missing (a list; a call no allow policy matches is denied)")
    seen: set[str] = set()
    deny = _rules(top, "deny_policies", seen)
    allow = _rules(top, "allow_policies", seen)
    if len(deny) + len(allow) > MAX_POLICIES:
        raise AuthzPolicyError(f"more than {MAX_POLICIES} policies")
    return AuthzPolicy(name=name, deny=deny, allow=allow, digest=digest)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise AuthzPolicyError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def parse_policy_text(data: bytes | str) -> AuthzPolicy:
    """The policy in a JSON document's bytes or text; AuthzPolicyError if it is too large, not JSON,
    nested too deep, or no valid policy."""
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > MAX_POLICY_BYTES:
        raise AuthzPolicyError(f"the policy is {len(raw)} bytes, more than the {MAX_POLICY_BYTES} allowed")
    digest = hashlib.sha256(raw).hexdigest()[:16]
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError as exc:
        raise AuthzPolicyError(f"the policy is not UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise AuthzPolicyError(f"the policy is not JSON: {exc}") from None
    except RecursionError:
        raise AuthzPolicyError("the policy is nested too deeply to be one") from None
    except AuthzPolicyError:
        raise  # a key twice in one object
    except ValueError as exc:  # a number of more digits than Python converts
        raise AuthzPolicyError(f"the policy cannot be read: {exc}") from None
    return parse_policy(document, digest)


def load_policy_file(path: str | Path) -> AuthzPolicy:
    """The policy in a file; AuthzPolicyError (with the path) if it cannot be read or used."""
    where = Path(path)
    try:
        with where.open("rb") as f:
            raw = f.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise AuthzPolicyError(f"{where}: cannot read the policy file: {exc.strerror or exc}") from None
    try:
        return parse_policy_text(raw)
    except AuthzPolicyError as exc:
        raise AuthzPolicyError(f"{where}: {exc}") from None
