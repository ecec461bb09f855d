"""Reading a settings dataclass from `--flag value` arguments and `PREFIX_*` environment variables.

Each process (router, shardd) has one frozen settings dataclass; this is the one reader they share.
Flags win over the environment, which wins over the dataclass defaults. The reader is strict: an
unknown flag is an error that names the closest valid one (a typo must never fall back to a default),
and `unknown_environment` lists `PREFIX_*` variables no setting reads, for a warning at start.

Each field's `#:` comment is its documentation: `--help` and docs/settings.md are generated from it,
so they cannot drift from the code.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, TypeVar

_Settings = TypeVar("_Settings")

__all__ = [
    "CommandLine",
    "SettingDoc",
    "UsageError",
    "closest",
    "env_names",
    "help_text",
    "parse_command",
    "read_command_line",
    "setting_docs",
    "settings_reference",
    "settings_values",
    "split_command_line",
    "unknown_environment",
]

HELP_FLAGS = ("-h", "--help")


class UsageError(ValueError):
    """A command line that cannot be run as given (exit status 2)."""


@dataclass(frozen=True)
class CommandLine:
    """A command line taken apart: its command words, its flag values by field name, and `--help`."""

    words: list[str]
    flags: dict[str, str]
    help: bool


@dataclass(frozen=True)
class SettingDoc:
    """One setting as a person reads it."""

    name: str
    flag: str
    env: str
    default: str
    kind: str
    help: str


def split_command_line(args: Sequence[str], cls: type[Any]) -> CommandLine:
    """Command words, `--flag value` / `--flag=value` pairs of `cls`'s fields, and whether help was asked.

    Raises UsageError for an unknown flag (naming the closest valid one) or a flag without a value.
    """
    by_flag = {_flag(f.name): f.name for f in fields(cls)}
    words: list[str] = []
    flags: dict[str, str] = {}
    wants_help = False
    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        i += 1
        if arg in HELP_FLAGS:
            wants_help = True
            continue
        if not arg.startswith("-") or arg == "-":
            words.append(arg)
            continue
        flag, has_value, value = arg.partition("=")
        if flag not in by_flag:
            raise UsageError(f"unknown flag {flag}{_did_you_mean(flag, [*by_flag, *HELP_FLAGS])}")
        if not has_value:
            if i >= len(items) or items[i].startswith("--"):
                raise UsageError(f"flag {flag} needs a value")
            value = items[i]
            i += 1
        flags[by_flag[flag]] = value
    return CommandLine(words, flags, wants_help)


def parse_command(
    words: Sequence[str], commands: Mapping[tuple[str, ...], int]
) -> tuple[tuple[str, ...], list[str]]:
    """The command among `commands` (words -> number of operands) that `words` name, and its operands.

    Raises UsageError naming an unknown command and the closest known one, or a wrong operand count.
    """
    for command, operands in sorted(commands.items(), key=lambda c: -len(c[0])):
        if tuple(words[: len(command)]) == command:
            rest = list(words[len(command) :])
            if len(rest) != operands:
                wanted = "no argument" if operands == 0 else f"{operands} argument(s)"
                raise UsageError(
                    f"'{' '.join(command)}' takes {wanted}, got {len(rest)}: {' '.join(rest)}".rstrip(": ")
                )
            return command, rest
    spelled = " ".join(words)
    known = [" ".join(c) for c in commands]
    firsts = sorted({c[0] for c in commands})
    if words and words[0] in firsts:
        subcommands = [" ".join(c) for c in commands if c[0] == words[0]]
        raise UsageError(f"unknown command '{spelled}'; '{words[0]}' takes one of: {', '.join(subcommands)}")
    suggestion = closest(words[0], firsts) if words else None
    hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
    raise UsageError(f"unknown command '{spelled}'{hint}; commands: {', '.join(known)}")


def read_command_line(
    args: Sequence[str],
    cls: type[Any],
    *,
    prog: str,
    prefix: str,
    usage: str,
    commands: Mapping[tuple[str, ...], int],
    parse: Callable[[Sequence[str]], _Settings],
) -> tuple[_Settings, tuple[str, ...], list[str]] | int:
    """A daemon's command line read whole: (settings, command, operands), or the exit status when there
    is nothing to run (`--help`: printed, 0; a usage error or a bad setting: printed, 2)."""
    try:
        line = split_command_line(args, cls)
        if line.help or line.words[:1] == ["help"]:
            print(help_text(cls, prefix, usage))
            return 0
        if not line.words:
            raise UsageError("no command given")
        command, operands = parse_command(line.words, commands)
        settings = parse(args)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        print(usage.split("\n\n", 1)[0] + f"\n({prog} --help lists every command and flag)", file=sys.stderr)
        return 2
    return settings, command, operands


def settings_values(
    cls: type[Any], *, prefix: str, prog: str, argv: Sequence[str] | None, env: Mapping[str, str] | None
) -> dict[str, Any]:
    """The fields of `cls` given by flags or environment, converted to their declared types.

    Raises UsageError for an unknown flag and ValueError for a value of the wrong type.
    """
    env = os.environ if env is None else env
    given = split_command_line(list(argv or []), cls).flags
    values: dict[str, Any] = {}
    for f in fields(cls):
        raw = given.get(f.name)
        if raw is None:
            raw = env.get(prefix + f.name.upper())
        if raw is not None:
            values[f.name] = _convert(f, raw, prefix)
    return values


def env_names(cls: type[Any], prefix: str) -> tuple[str, ...]:
    """Every environment variable name the settings class reads."""
    return tuple(prefix + f.name.upper() for f in fields(cls))


def unknown_environment(cls: type[Any], prefix: str, env: Mapping[str, str] | None = None) -> list[str]:
    """One line for each `PREFIX_*` variable that no setting reads (a typo, or a removed setting)."""
    env = os.environ if env is None else env
    known = env_names(cls, prefix)
    return [
        f"{name} is set but no setting reads it{_did_you_mean(name, known)}"
        for name in sorted(env)
        if name.startswith(prefix) and name not in known
    ]


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice closest to a mistyped `word`, if one is close enough to suggest."""
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


def setting_docs(cls: type[Any], prefix: str) -> list[SettingDoc]:
    """Every field of `cls` with its flag, environment variable, default and `#:` documentation."""
    docs = _field_comments(cls)
    out = []
    for f in fields(cls):
        default: object = f.default if f.default is not MISSING else ""
        if isinstance(default, tuple):
            default = ",".join(str(v) for v in default)
        out.append(
            SettingDoc(
                name=f.name,
                flag=_flag(f.name),
                env=prefix + f.name.upper(),
                default=str(default).lower() if isinstance(default, bool) else str(default),
                kind=_kind(f),
                help=docs.get(f.name, ""),
            )
        )
    return out


def help_text(cls: type[Any], prefix: str, usage: str) -> str:
    """`usage` followed by every setting: flag, environment variable, default, meaning."""
    lines = [usage.rstrip(), "", "settings (flag / environment variable, default; flags win):"]
    for doc in setting_docs(cls, prefix):
        default = f'"{doc.default}"' if doc.default == "" else doc.default
        lines.append(f"  {doc.flag} {doc.kind.upper()}  / {doc.env}  (default {default})")
        lines.append(f"      {doc.help}")
    return "\n".join(lines)


def settings_reference(cls: type[Any], prefix: str, title: str) -> str:
    """A Markdown table of every setting (docs/settings.md is made of these)."""
    rows = [
        f"## {title}",
        "",
        "| flag | environment | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for doc in setting_docs(cls, prefix):
        meaning = doc.help.replace("|", "\\|")
        rows.append(f"| `{doc.flag}` | `{doc.env}` | `{doc.default}` | {meaning} |")
    return "\n".join(rows) + "\n"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    found = closest(word, choices)
    return f" (did you mean {found}?)" if found else ""


_FIELD = re.compile(r"^\s*(\w+)\s*:\s*[^=]+=")


def _field_comments(cls: type[Any]) -> dict[str, str]:
    """The `#:` comment block above each field of the class's source."""
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = _FIELD.match(line)
        if match and pending:
            docs[match.group(1)] = " ".join(pending)
        pending = []
    return docs


def _kind(f: Field[Any]) -> str:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return "list" if kind.startswith("tuple") else kind


def _convert(f: Field[Any], raw: str, prefix: str) -> Any:
    kind = _kind(f)
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if kind == "list":
            return tuple(p.strip() for p in raw.split(",") if p.strip())
    except ValueError:
        raise ValueError(
            f"{prefix}{f.name.upper()} / --{f.name.replace('_', '-')}: cannot read {raw!r} as {kind}"
        ) from None
    return raw
