"""The file naming each shard's database (shard id -> DSN): what the tools that work on several
shards' databases at once (moves, reconciliation) read, and what the local cluster writes
(`databases.yaml` in its data directory); and the same pairs given one by one as `SHARD=DSN`.

A DSN may hold a password, so no message here repeats one, nor a line of the file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

__all__ = ["parse_shard_dsn_pairs", "read_shard_dsns"]


def read_shard_dsns(path: Path, flag: str = "--databases") -> dict[str, str]:
    """Shard id -> DSN from a YAML mapping given by `flag`; ValueError naming the flag and the file
    when it is unreadable or not such a mapping."""
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc}") from exc
    except yaml.YAMLError as exc:
        # The parser's own message quotes the offending line: where and what, without the line.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise ValueError(f"{flag} {path}: cannot read it: {problem}{where}") from None
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
    ):
        raise ValueError(f"{flag} {path}: must be a mapping of shard id to DSN")
    return dict(loaded)


def parse_shard_dsn_pairs(flag: str, items: Sequence[str]) -> dict[str, str]:
    """Shard id -> DSN from `SHARD=DSN` values of `flag` (a later value for a shard wins);
    ValueError naming the flag, never the value, when one is not of that form."""
    out: dict[str, str] = {}
    for item in items:
        shard, sep, dsn = item.partition("=")
        if not sep:
            raise ValueError(f"{flag}: give SHARD=DSN (no '=' in the value)")
        if not shard or not dsn:
            # Only the part before the first '=' can be shown: a DSN forgotten without SHARD= splits
            # at one of its own '=', and the rest of it may hold a password.
            raise ValueError(f"{flag} {shard!r}: give SHARD=DSN")
        out[shard] = dsn
    return out
