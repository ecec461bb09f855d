"""Every module of ours states its public surface (`__all__`), and the statement is true."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shardrouter",)


def _modules() -> list[Path]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name or path.name == "__main__.py" or path.parent.name == "v1":
                continue
            tree = ast.parse(path.read_text())
            defines = any(
                isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Assign)
                for n in tree.body
            )
            if (
                path.name == "__init__.py"
                and not defines
                and not any(isinstance(n, ast.ImportFrom) for n in tree.body)
            ):
                continue  # a package that is only its docstring
            found.append(path)
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = _modules()


def test_the_modules_are_found() -> None:
    assert len(MODULES) > 50


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_declares_a_true_public_surface(path: Path) -> None:
    module = importlib.import_module(_module_name(path))
    declared = getattr(module, "__all__", None)
    assert declared is not None, f"{path.relative_to(ROOT)} has no __all__"
    missing = [name for name in declared if not hasattr(module, name)]
    assert not missing, f"__all__ names what the module does not have: {missing}"
    assert len(set(declared)) == len(declared), "__all__ lists a name twice"
    tree = ast.parse(path.read_text())
    public_defs = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not n.name.startswith("_")
    }
    unlisted = sorted(public_defs - set(declared))
    assert not unlisted, f"public functions or classes left out of __all__ (make them _private?): {unlisted}"
