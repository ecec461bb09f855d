"""The file naming each shard's database (shard id -> DSN): what the tools that work on several
shards' databases at once (moves, reconciliation) read, and what the local cluster writes
(`databases.yaml` in its data directory)."""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["read_shard_dsns"]


def read_shard_dsns(path: Path) -> dict[str, str]:
    """Shard id -> DSN from a YAML mapping; ValueError naming the file when it is unreadable or not
    such a mapping."""
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--databases {path}: cannot read it: {exc}") from exc
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
    ):
        raise ValueError(f"--databases {path}: must be a mapping of shard id to DSN")
    return dict(loaded)
