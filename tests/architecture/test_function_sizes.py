"""No function of the package, the bench or the scripts runs over 80 lines, but a few named
composition roots.

ruff keeps statements and branches per function within the budget in pyproject.toml
(`[tool.ruff.lint.pylint]`); this counts lines, which ruff does not: a long function made of few
statements (a table, a long call) is as hard to read. An `ast` walk measures every function and
method, nested ones included, from its `def` line to its last line (docstring and comments count).
A composition root wires many parts and reads best as one list of them: those allowed are named
below, each with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The folders whose code is measured.
SCANNED = ("shardrouter", "bench", "scripts")
MAX_LINES = 80
#: (file, qualified name) -> why it may be longer.
ALLOWED: dict[tuple[str, str], str] = {
    ("shardrouter/router/server.py", "start_router"): (
        "the router's composition root: settings, TLS, channel pool, map follower, metrics, HTTP front "
        "and the gRPC server wired in start order, each step a call"
    ),
    ("shardrouter/reshard/cli.py", "_parser"): (
        "the argparse builder of `shard-router reshard`: one add_argument per flag"
    ),
}


def function_lengths(root: Path, folders: tuple[str, ...] = SCANNED) -> dict[tuple[str, str], int]:
    """(file relative to `root`, qualified name such as `Class.method`) -> its length in lines, for
    every function and method of the Python files under `folders` (generated stubs left out)."""
    lengths: dict[tuple[str, str], int] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name or "node_modules" in path.parts:
                continue
            relative = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for name, length in _lengths(tree, ""):
                lengths[(relative, name)] = length
    return lengths


def _lengths(node: ast.AST, prefix: str) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + child.name
            assert child.end_lineno is not None
            found.append((name, child.end_lineno - child.lineno + 1))
            found += _lengths(child, name + ".")
        elif isinstance(child, ast.ClassDef):
            found += _lengths(child, prefix + child.name + ".")
        else:
            found += _lengths(child, prefix)
    return found


def too_long(
    lengths: dict[tuple[str, str], int], allowed: dict[tuple[str, str], str] = ALLOWED
) -> dict[tuple[str, str], int]:
    """The functions over MAX_LINES that are not allowed by name."""
    return {where: n for where, n in lengths.items() if n > MAX_LINES and where not in allowed}


def test_no_function_is_longer_than_the_budget() -> None:
    over = too_long(function_lengths(ROOT))
    assert not over, f"functions over {MAX_LINES} lines (split them into named steps): " + ", ".join(
        f"{file}:{name} ({n} lines)" for (file, name), n in sorted(over.items())
    )


def test_every_allowed_function_exists_and_is_still_long() -> None:
    """An entry for a function that was renamed, removed or shortened is dropped from the list."""
    lengths = function_lengths(ROOT)
    stale = [where for where in ALLOWED if lengths.get(where, 0) <= MAX_LINES]
    assert not stale, f"allowed but not (or no longer) over {MAX_LINES} lines: {stale}"


def test_the_walk_flags_a_planted_long_function(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()

    def method(name: str, lines: int) -> list[str]:
        return [f"    def {name}(self) -> None:", *(f"        x{i} = {i}" for i in range(lines - 1))]

    source = ["def short() -> None:", "    pass", "", "", "class Holder:"]
    source += [*method("long", MAX_LINES + 1), "", *method("fits", MAX_LINES)]
    (package / "planted.py").write_text("\n".join(source) + "\n", encoding="utf-8")
    lengths = function_lengths(tmp_path, ("pkg",))
    assert lengths == {
        ("pkg/planted.py", "short"): 2,
        ("pkg/planted.py", "Holder.long"): MAX_LINES + 1,
        ("pkg/planted.py", "Holder.fits"): MAX_LINES,
    }
    assert too_long(lengths, {}) == {("pkg/planted.py", "Holder.long"): MAX_LINES + 1}
    assert too_long(lengths, {("pkg/planted.py", "Holder.long"): "a planted root"}) == {}
