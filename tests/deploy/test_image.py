"""The image recipe (deploy/Dockerfile): base images pinned by digest, Python packages only from the
lock file with hashes (deploy/requirements.lock), which holds every runtime dependency of
pyproject.toml. Offline: no image is built and nothing is downloaded."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    out: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not current):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    return out


def from_images(text: str) -> list[str]:
    """The image of every FROM, with global ARG defaults substituted; stage names are left out."""
    args: dict[str, str] = {}
    images: list[str] = []
    stages: set[str] = set()
    for instruction in instructions(text):
        keyword, _, rest = instruction.partition(" ")
        if keyword.upper() == "ARG" and not images:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif keyword.upper() == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], words[0])
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image not in stages:
                images.append(image)
    return images


def lock_path(text: str) -> Path:
    """The lock file the Dockerfile copies and installs with --require-hashes."""
    steps = instructions(text)
    (install,) = [i for i in steps if "pip install" in i and "--require-hashes" in i]
    assert "--no-deps" in install, "pip must not resolve anything beyond the lock"
    (target,) = re.findall(r"-r\s+(\S+)", install)
    (copy,) = [i for i in steps if i.startswith("COPY ") and i.split()[-1] == target]
    return ROOT / copy.split()[-2]


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """Package name -> (version, hashes), from a pip requirements file with --hash options."""
    text = path.read_text(encoding="utf-8")
    entries: dict[str, tuple[str, list[str]]] = {}
    for raw in re.split(r"\n(?=\S)", re.sub(r"(?m)^\s*#.*\n?", "", text)):
        block = raw.strip()
        if not block:
            continue
        head = block.split("\\")[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)(\s*;.*)?", head)
        assert match, f"not pinned with ==: {head}"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", block)
        assert hashes, f"{head}: no --hash=sha256:"
        entries[str(canonicalize_name(match[1]))] = (match[2], hashes)
    return entries


def test_every_base_image_is_pinned_by_digest() -> None:
    # the digest is the build argument PYTHON_DIGEST, given at build time (test_site_file.py: unset,
    # the build stops naming it)
    text = DOCKERFILE.read_text(encoding="utf-8")
    text = re.sub(r"(?m)^ARG PYTHON_DIGEST=.*$", "ARG PYTHON_DIGEST=sha256:" + "a" * 64, text)
    images = from_images(text)
    assert len(images) >= 2
    for image in images:
        assert DIGEST.search(image), f"FROM {image}: pin it by digest (@sha256:...)"


def test_packages_come_from_a_lock_with_hashes_that_lists_the_runtime_dependencies() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    lock = lock_path(text)
    assert lock.is_file() and lock.parent == ROOT / "deploy"
    assert f"!{lock.relative_to(ROOT).as_posix()}" in DOCKERIGNORE.read_text(encoding="utf-8")
    packages = locked(lock)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for spec in project["dependencies"]:
        requirement = Requirement(spec)
        name = str(canonicalize_name(requirement.name))
        assert name in packages, f"{name} (pyproject.toml) is not in {lock.name}"
        for extra in requirement.extras:  # psycopg[binary] -> psycopg-binary
            assert str(canonicalize_name(f"{requirement.name}-{extra}")) in packages, (name, extra)
        version, _ = packages[name]
        assert requirement.specifier.contains(version, prereleases=True), (spec, version)
    # the build backend that installs the project itself, from the lock too (no build isolation)
    assert {"setuptools", "wheel"} <= set(packages)
    install = [i for i in instructions(text) if re.search(r"pip install [^&]*\s\.(\s|$)", i)]
    assert install and all(
        "--no-index" in i and "--no-build-isolation" in i and "--no-deps" in i for i in install
    )


def test_lock_check_can_fail(tmp_path: Path) -> None:
    unhashed = tmp_path / "requirements.lock"
    unhashed.write_text("grpcio==1.85.1\n", encoding="utf-8")
    with pytest.raises(AssertionError):
        locked(unhashed)
    unpinned = tmp_path / "unpinned.lock"
    unpinned.write_text("grpcio>=1.85 --hash=sha256:" + "0" * 64 + "\n", encoding="utf-8")
    with pytest.raises(AssertionError):
        locked(unpinned)
    assert not DIGEST.search("python:3.11-slim-bookworm")
    assert from_images("ARG B=x:1@sha256:" + "a" * 64 + "\nFROM ${B} AS b\nFROM b\nFROM ${B}\n") == [
        "x:1@sha256:" + "a" * 64,
        "x:1@sha256:" + "a" * 64,
    ]
