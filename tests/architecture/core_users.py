"""Which layers use each module of `core`: a short `ast` walk over a source tree.

A `core` module counts as used by a layer when a module of that layer imports it, directly or
through other `core` modules (`core.shardmap_watch` reads the ConfigMap through
`core.kube_configmap`, so every layer that follows the map uses both). Tests and the bench are not
layers.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

#: The layers above `core`, each a subpackage of the import root.
LAYERS = ("shardd", "router", "client", "reshard", "reconcile", "localcluster")


def _imported_modules(source: Path, package: str) -> set[str]:
    """Dotted names of the modules `source` imports (a `from X import y` counts X and X.y)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith(f"{package}.core.")}


def _core_module(dotted: str, package: str) -> str:
    """The top-level `core` module (or subpackage) a dotted name lies in: `tracing` for
    `pkg.core.tracing.spans`."""
    return dotted.removeprefix(f"{package}.core.").split(".", 1)[0]


def core_module_users(root: Path, package: str = "shardrouter") -> dict[str, set[str]]:
    """Each top-level module of `root/package/core` -> the layers that use it (see the docstring)."""
    core = root / package / "core"
    modules = {p.stem for p in core.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in core.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    # core module -> core modules it imports
    within: dict[str, set[str]] = defaultdict(set)
    for path in core.rglob("*.py"):
        own = _core_module(".".join(path.relative_to(root).with_suffix("").parts), package)
        for name in _imported_modules(path, package):
            target = _core_module(name, package)
            if target != own and target in modules:
                within[own].add(target)
    users: dict[str, set[str]] = {name: set() for name in modules}
    for layer in LAYERS:
        reached: set[str] = set()
        for path in (root / package / layer).rglob("*.py"):
            for name in _imported_modules(path, package):
                if _core_module(name, package) in modules:
                    reached.add(_core_module(name, package))
        frontier = list(reached)
        while frontier:
            for target in within.get(frontier.pop(), ()):
                if target not in reached:
                    reached.add(target)
                    frontier.append(target)
        for name in reached:
            users[name].add(layer)
    return users


def core_modules_with_one_user(root: Path, package: str = "shardrouter") -> dict[str, set[str]]:
    """The `core` modules used by fewer than two layers, with the layer that uses them (if any)."""
    return {name: layers for name, layers in core_module_users(root, package).items() if len(layers) < 2}
