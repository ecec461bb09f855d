"""Every name of ours on the wire is spelled once, in `shardrouter/core/wire_names.py`.

An `ast` walk over every module of the package (but the generated stubs and the declaring module)
looks at each string constant, the literal parts of f-strings included, and fails on one that equals
a declared name in any letter case (HTTP header names have none; our gRPC names are lower case
anyway), naming the file and line. Prose that mentions a name (a docstring, a message, a comment) is
not a spelling of it: only a constant equal to the whole name counts.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from shardrouter.core import wire_names

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "shardrouter"
DECLARING_MODULE = Path(PACKAGE, "core", "wire_names.py")


def _scanned(root: Path) -> list[Path]:
    """The package's modules a literal name is looked for in: all but stubs and the declaration."""
    return sorted(
        path
        for path in (root / PACKAGE).rglob("*.py")
        if "_pb2" not in path.name and path.relative_to(root) != DECLARING_MODULE
    )


def literal_spellings(root: Path, names: Iterable[str]) -> list[str]:
    """`file:line: 'literal'` for each string constant under `root/shardrouter` equal to one of
    `names` in any letter case (f-string parts included; stubs and the declaring module skipped)."""
    wanted = {name.lower() for name in names}
    found = []
    for path in _scanned(root):
        spelled = sorted(
            (node.lineno, node.value)
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in wanted
        )
        found += [f"{path.relative_to(root)}:{line}: {value!r}" for line, value in spelled]
    return found


def test_no_module_spells_a_declared_wire_name() -> None:
    spelled = literal_spellings(ROOT, wire_names.DECLARED_NAMES)
    assert not spelled, (
        "wire names spelled outside shardrouter/core/wire_names.py (import the constant instead):\n"
        + "\n".join(spelled)
    )


def test_every_declared_name_is_listed() -> None:
    """A name the module declares but leaves out of `DECLARED_NAMES` would escape the check above."""
    suffixes = ("_METADATA", "_TRAILER", "_HEADER", "_ATTRIBUTE")
    declared = {value for name, value in vars(wire_names).items() if name.endswith(suffixes)}
    assert declared == set(wire_names.DECLARED_NAMES)
    assert len(wire_names.DECLARED_NAMES) == len(declared)


def test_the_check_finds_a_planted_literal(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    (package / "core").mkdir(parents=True)
    (package / "core" / "wire_names.py").write_text('REPLAYED_TRAILER = "idempotency-replayed"\n')
    (package / "router").mkdir()
    (package / "router" / "front.py").write_text(
        '"""Mentions idempotency-replayed and Idempotent-Replayed in prose: fine."""\n'
        "\n"
        'headers = {"idempotent-replayed": "true"}\n'
        'trailer = f"{1}" + dict(()).get("idempotency-replayed", "")\n'
        "note = f\"trailer {dict(()).get('idempotency-outcome')!r}\"\n"
    )
    (package / "v1").mkdir()
    (package / "v1" / "transfer_pb2.py").write_text('NAME = "idempotency-key"\n')

    assert literal_spellings(tmp_path, wire_names.DECLARED_NAMES) == [
        "shardrouter/router/front.py:3: 'idempotent-replayed'",
        "shardrouter/router/front.py:4: 'idempotency-replayed'",
        "shardrouter/router/front.py:5: 'idempotency-outcome'",
    ]
