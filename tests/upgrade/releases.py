"""The previous release, from the git history, installed into a virtual environment of its own, and its
shard daemon and router as processes beside this release's.

The previous release is the newest commit whose migrations stop before this release's newest one: the
release a rolling update replaces. It is exported with `git archive` (the tree as committed, nothing of
the working tree) and installed with `pip install -e` into its own venv, with pip's own configuration
(the index options of this machine). Both are cached under the system's temporary directory by commit,
so a second run starts at once; a lock file keeps two test workers from installing it at the same time.
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shardrouter.shardd import migrations
from tests.processes import ROOT, ServiceProcess, router_process, shardd_process, wait_serving

MIGRATIONS_FILE = "shardrouter/shardd/migrations.py"
#: A migration's number as it opens its entry in MIGRATIONS.
_ENTRY = re.compile(r"^    \(\n        (\d+),\n", re.MULTILINE)


@dataclass(frozen=True)
class Release:
    """A release installed beside this one."""

    commit: str
    schema: int  # its newest migration
    tree: Path
    python: Path


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout


def is_shallow_clone() -> bool:
    """Whether this checkout lacks the history (`git clone --depth N`)."""
    return _git("rev-parse", "--is-shallow-repository").strip() == "true"


def previous_release_commit(before: int = migrations.LATEST_VERSION) -> tuple[str, int]:
    """The commit just before migration `before` was added (the release it came after), and that
    commit's newest migration."""
    added = None  # the oldest commit seen so far whose migrations reach `before`
    for commit in _git("log", "--format=%H", "--", MIGRATIONS_FILE).split():
        try:
            text = _git("show", f"{commit}:{MIGRATIONS_FILE}")
        except subprocess.CalledProcessError:
            break  # the file was not there yet
        numbers = [int(n) for n in _ENTRY.findall(text)]
        if numbers and max(numbers) >= before:
            added = commit
            continue
        if added is not None and numbers:
            parent = _git("rev-parse", f"{added}^").strip()
            return parent, max(int(n) for n in _ENTRY.findall(_git("show", f"{parent}:{MIGRATIONS_FILE}")))
        break
    raise LookupError(f"no commit in the history adds migration {before} after an earlier one")


def install_release(commit: str, schema: int) -> Release:
    """Export `commit` and install it into its own venv (cached); the installed release."""
    home = Path(tempfile.gettempdir()) / "shard-router-releases" / commit
    home.mkdir(parents=True, exist_ok=True)
    release = Release(commit, schema, home / "tree", home / "venv" / "bin" / "python")
    done = home / "installed"
    with (home / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return release
        subprocess.run(["rm", "-rf", str(release.tree), str(home / "venv")], check=True)
        release.tree.mkdir()
        archive = subprocess.run(
            ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True, timeout=120
        )
        subprocess.run(["tar", "-x", "-C", str(release.tree)], input=archive.stdout, check=True, timeout=120)
        subprocess.run([sys.executable, "-m", "venv", str(home / "venv")], check=True, timeout=120)
        installed = subprocess.run(
            [str(release.python), "-m", "pip", "install", "-q", "-e", str(release.tree)],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if installed.returncode != 0:
            raise RuntimeError(f"pip could not install the release of {commit}:\n{installed.stderr[-3000:]}")
        done.write_text(commit)
    return release


@dataclass
class ReleaseProcess(ServiceProcess):
    """A `shardd serve` of another release: its venv's interpreter, from its own tree, and nothing of
    this checkout on its path."""

    python: str = ""
    cwd: str = ""

    def start(self, timeout_s: float = 60.0, *, wait: bool = True) -> None:
        with self.log_path.open("ab") as log:
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(
                [self.python, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd
            )
        if wait:
            wait_serving(self.address, timeout_s, self)


def _quiet(extra_env: dict[str, str] | None, prefix: str) -> dict[str, str]:
    return {f"{prefix}LOG_LEVEL": "WARNING", **(extra_env or {})}


def _of_release(release: Release, plain: ServiceProcess, name: str, tmp: Path) -> ReleaseProcess:
    """`plain` (a process of this checkout) as the same command of `release`."""
    env = {k: v for k, v in plain.env.items() if k != "PYTHONPATH"}
    return ReleaseProcess(
        name,
        plain.args,
        env,
        plain.port,
        tmp / f"{name}.log",
        python=str(release.python),
        cwd=str(release.tree),
    )


def release_shardd(
    release: Release,
    tmp: Path,
    *,
    shard_id: str,
    dsn: str,
    name: str,
    shard_map: Path | None = None,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> ReleaseProcess:
    """A shard daemon of `release` (dev mode, loopback), not started."""
    plain = this_release_shardd(
        tmp, shard_id=shard_id, dsn=dsn, name=name, shard_map=shard_map, port=port, extra_env=extra_env
    )
    return _of_release(release, plain, name, tmp)


def this_release_shardd(
    tmp: Path,
    *,
    shard_id: str,
    dsn: str,
    name: str,
    shard_map: Path | None = None,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> ServiceProcess:
    """A shard daemon of this checkout (dev mode, loopback), not started."""
    plain = shardd_process(
        tmp,
        shard_id=shard_id,
        dsn=dsn,
        shard_map=shard_map,
        port=port,
        extra_env=_quiet(extra_env, "SHARDD_"),
    )
    return ServiceProcess(name, plain.args, plain.env, plain.port, tmp / f"{name}.log")


def release_router(release: Release, tmp: Path, *, shard_map: Path, name: str) -> ReleaseProcess:
    """A router of `release` (dev mode, loopback) over the shards of `shard_map`, not started."""
    plain = router_process(tmp, shard_map=shard_map, extra_env=_quiet(None, "ROUTER_"))
    return _of_release(release, plain, name, tmp)


def this_release_router(tmp: Path, *, shard_map: Path, name: str) -> ServiceProcess:
    """A router of this checkout (dev mode, loopback) over the shards of `shard_map`, not started."""
    plain = router_process(tmp, shard_map=shard_map, extra_env=_quiet(None, "ROUTER_"))
    return ServiceProcess(name, plain.args, plain.env, plain.port, tmp / f"{name}.log")
