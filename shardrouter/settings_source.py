"""Reading a settings dataclass from `--flag value` arguments and `PREFIX_*` environment variables.

Each process (router, shardd) has one frozen settings dataclass; this is the one reader they share.
Flags win over the environment, which wins over the dataclass defaults.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import Field, fields
from typing import Any


def settings_values(
    cls: type[Any], *, prefix: str, prog: str, argv: Sequence[str] | None, env: Mapping[str, str] | None
) -> dict[str, Any]:
    """The fields of `cls` given by flags or environment, converted to their declared types."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    for f in fields(cls):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None)
    known, _ = parser.parse_known_args(list(argv or []))
    values: dict[str, Any] = {}
    for f in fields(cls):
        raw = getattr(known, f.name)
        if raw is None:
            raw = env.get(prefix + f.name.upper())
        if raw is not None:
            values[f.name] = _convert(f, raw, prefix)
    return values


def command_words(args: Sequence[str]) -> list[str]:
    """The command words: every argument that is neither a `--flag` nor a flag's value."""
    words, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("--"):
            skip = "=" not in arg
        else:
            words.append(arg)
    return words


def env_names(cls: type[Any], prefix: str) -> tuple[str, ...]:
    """Every environment variable name the settings class reads."""
    return tuple(prefix + f.name.upper() for f in fields(cls))


def _convert(f: Field[Any], raw: str, prefix: str) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if kind.startswith("tuple"):
            return tuple(p.strip() for p in raw.split(",") if p.strip())
    except ValueError:
        raise ValueError(
            f"{prefix}{f.name.upper()} / --{f.name.replace('_', '-')}: cannot read {raw!r} as {kind}"
        ) from None
    return raw
