"""`core` holds what at least two layers share: a module with one user lives beside that user."""

from __future__ import annotations

from pathlib import Path

from tests.architecture.core_users import core_module_users, core_modules_with_one_user

ROOT = Path(__file__).resolve().parents[2]


def test_every_core_module_is_used_by_two_layers_or_more() -> None:
    lonely = core_modules_with_one_user(ROOT)
    assert not lonely, (
        "core modules used by fewer than two layers (move each beside its user): "
        + ", ".join(f"core/{name} ({', '.join(sorted(users)) or 'no layer'})" for name, users in sorted(lonely.items()))
    )


def _write(root: Path, relative: str, text: str = "") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_check_fails_on_a_core_module_with_one_user(tmp_path: Path) -> None:
    """A tree where `core.only_router` serves the router alone, `core.shared` two layers, and
    `core.deep` reaches two layers only through `core.shared`."""
    _write(tmp_path, "pkg/core/__init__.py")
    _write(tmp_path, "pkg/core/only_router.py")
    _write(tmp_path, "pkg/core/deep.py")
    _write(tmp_path, "pkg/core/unused.py")
    _write(tmp_path, "pkg/core/shared.py", "from pkg.core import deep\n")
    _write(tmp_path, "pkg/router/front.py", "from pkg.core.only_router import x\nimport pkg.core.shared\n")
    _write(tmp_path, "pkg/shardd/server.py", "from pkg.core import shared\n")
    users = core_module_users(tmp_path, "pkg")
    assert users == {
        "only_router": {"router"},
        "shared": {"router", "shardd"},
        "deep": {"router", "shardd"},
        "unused": set(),
    }
    assert core_modules_with_one_user(tmp_path, "pkg") == {"only_router": {"router"}, "unused": set()}


def test_the_real_tree_is_read(tmp_path: Path) -> None:
    """The walk finds the modules every layer is known to share (so a passing check means something)."""
    users = core_module_users(ROOT)
    assert users["errors"] >= {"shardd", "router", "client"}
    assert users["shardmap"] >= {"shardd", "router", "reshard"}
