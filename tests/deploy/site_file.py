"""The deploy tree as a site renders it: a copy of deploy/k8s whose site file (site/site.yaml, every
setting unset in the repository, so that nothing renders for production before a site fills it)
holds the filled example, site/site.example.yaml, or other values."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
#: deploy/k8s as committed: its site file has no setting.
REPOSITORY_K8S = ROOT / "deploy" / "k8s"
SITE_FILE = Path("site") / "site.yaml"
EXAMPLE_SITE_FILE = Path("site") / "site.example.yaml"


def example_settings() -> dict[str, str]:
    """The settings of the filled example site file."""
    document = yaml.safe_load((REPOSITORY_K8S / EXAMPLE_SITE_FILE).read_text(encoding="utf-8"))
    data: dict[str, str] = document["data"]
    return data


def site_file_text(settings: dict[str, str]) -> str:
    """A site file (the ConfigMap `site`, local to kustomize) holding these settings."""
    document = yaml.safe_load((REPOSITORY_K8S / SITE_FILE).read_text(encoding="utf-8"))
    document["data"] = dict(settings)
    return yaml.safe_dump(document, sort_keys=False)


def k8s_copy(into: Path, settings: dict[str, str] | None = None) -> Path:
    """deploy/k8s copied to `into`/k8s with a site file of `settings` (the example's by default;
    `{}`: the repository's own, every setting unset). Returns the copy's root."""
    root = into / "k8s"
    shutil.copytree(REPOSITORY_K8S, root, ignore=shutil.ignore_patterns("__pycache__"))
    if settings != {}:
        (root / SITE_FILE).write_text(site_file_text(settings or example_settings()), encoding="utf-8")
    return root


def filled_k8s() -> Path:
    """A copy of deploy/k8s with the example site file, for this process (removed at exit)."""
    into = Path(tempfile.mkdtemp(prefix="k8s-site-"))
    atexit.register(shutil.rmtree, into, True)
    return k8s_copy(into)
