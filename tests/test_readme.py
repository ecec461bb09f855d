"""The READMEs, run: every shell command and code block of README.md (and the local parts of
deploy/k8s/README.md) against a real local cluster, so a README that drifts fails CI.

Each fenced block carries a directive on the line just before it, `<!-- readme-test: KIND ... -->`
(invisible when rendered), and a block without one fails the test:

- `setup-run`: the install-and-run command; its last command runs here with `--exit-after-demo` (the
  install is what CI itself does);
- `setup-test`: the install-and-test command; `.ci/run` must run the same install and test commands;
- `console`: a transcript: each `$ command` runs in bash from the repository root, as pasted (no
  virtualenv on PATH), and its output must match the lines below it, where `...` matches anything
  (and a line of `...` alone any number of lines);
- `sh`: commands run in bash as pasted and must succeed (output not compared); `sh slow REASON` runs
  only with `--run-slow` (a block that runs tests the default suite runs itself);
- `python [REGEX]`: runs with the project's Python and must exit 0, and its output must match REGEX;
- `shard-map`: a shard map example that must load;
- `skip REASON`: needs what this machine lacks (a Kubernetes cluster, Docker); the reason is required.

Blocks run against one cluster started by `shard-router dev up --no-demo` as users start it; the
address `127.0.0.1:50051` in a block is replaced by that cluster's router address, and
`127.0.0.1:8080` by its HTTP front's.
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardrouter.core.shardmap import load_shard_map
from shardrouter.localcluster.postgres import free_port
from tests.helpers import pg_data_dir
from tests.processes import ROOT, wait_serving

READMES = (ROOT / "README.md", ROOT / "deploy" / "k8s" / "README.md")
DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->")
KINDS = {"setup-run", "setup-test", "console", "sh", "python", "shard-map", "skip"}
DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_HTTP = "127.0.0.1:8080"


@dataclass(frozen=True)
class Block:
    """One fenced block of a README with its directive."""

    readme: Path
    line: int
    language: str
    kind: str
    arg: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.readme.relative_to(ROOT)}:{self.line}"


def readme_blocks(path: Path) -> list[Block]:
    """Every fenced block of `path`, with the directive just above it ("" if none)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent, language = fence.group(1), fence.group(2)
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        directive = DIRECTIVE.search(previous)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        blocks.append(
            Block(
                readme=path,
                line=i + 1,
                language=language,
                kind=directive.group("kind") if directive else "",
                arg=directive.group("arg") if directive else "",
                text="\n".join(body) + "\n",
            )
        )
        i = j + 1
    return blocks


ALL_BLOCKS = [b for path in READMES for b in readme_blocks(path)]


def _blocks(*kinds: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.kind in kinds]


def test_every_block_says_how_it_is_checked() -> None:
    unmarked = [b.name for b in ALL_BLOCKS if b.kind not in KINDS]
    assert not unmarked, f"blocks without a <!-- readme-test: KIND --> directive: {unmarked}"
    unexplained = [
        b.name
        for b in ALL_BLOCKS
        if (b.kind == "skip" and len(b.arg) < 10) or (b.kind == "sh" and b.arg and len(b.arg) < 15)
    ]
    assert not unexplained, f"skipped blocks need a reason: {unexplained}"
    ran = [b for b in ALL_BLOCKS if b.kind not in ("skip",)]
    assert len(ran) >= 8, "most of the README should run"


@dataclass
class Cluster:
    """A `shard-router dev up --no-demo` process and what a block needs to reach it."""

    target: str
    env: dict[str, str]
    home: Path
    http: str = DEFAULT_HTTP


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("readme-home")
    port = free_port()
    http_port = free_port()
    # A fresh user: no virtualenv on PATH, a home of its own (the CLI's store, the cluster's data).
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "SHARD_ROUTER_TARGET": f"127.0.0.1:{port}",
        "GRPC_VERBOSITY": "ERROR",
    }
    data = pg_data_dir().parent  # not under pytest's tmp dirs: the PostgreSQL user must reach it
    # The cluster's data where the commands look by default (`dev add-shard`, `reshard`).
    env["XDG_DATA_HOME"] = str(data)
    log = (home / "dev-up.log").open("wb")
    process = subprocess.Popen(
        [
            str(ROOT / ".venv/bin/shard-router"),
            "dev",
            "up",
            "--shards",
            "2",
            "--no-demo",
            "--no-metrics",
            "--port",
            str(port),
            "--http-port",
            str(http_port),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(f"127.0.0.1:{port}", 90)
        yield Cluster(target=f"127.0.0.1:{port}", env=env, home=home, http=f"127.0.0.1:{http_port}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


def _bash(command: str, cluster: Cluster, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command.replace(DEFAULT_TARGET, cluster.target).replace(DEFAULT_HTTP, cluster.http)],
        cwd=cwd,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _transcript(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) pairs of a console block; a `\\` continues a command."""
    steps: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.startswith("$ "):
            if line.strip():
                raise AssertionError(f"output line before any command: {line!r}")
            continue
        command = line[2:]
        while command.endswith("\\") and i < len(lines):
            command = command[:-1] + lines[i].strip()
            i += 1
        expected: list[str] = []
        while i < len(lines) and not lines[i].startswith("$ "):
            expected.append(lines[i])
            i += 1
        steps.append((command, [e for e in expected if e.strip()]))
    return steps


def _matches(pattern: str, line: str) -> bool:
    regex = ".*".join(re.escape(part) for part in pattern.strip().split("..."))
    return re.fullmatch(regex, line.strip()) is not None


_TRANSFER_ID = re.compile(r"\btransfer ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b")


@pytest.mark.parametrize("block", _blocks("console"), ids=lambda b: b.name)
def test_console_transcript(block: Block, cluster: Cluster) -> None:
    """`TRANSFER_ID` in a command stands for the transfer id printed last, as a reader pastes it."""
    last_transfer = ""
    for command, expected in _transcript(block.text):
        result = _bash(command.replace("TRANSFER_ID", last_transfer), cluster)
        found = _TRANSFER_ID.findall(result.stdout)
        last_transfer = found[-1] if found else last_transfer
        got = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        assert _lines_match(expected, got), f"$ {command}\nexpected {expected}\ngot {got}"


def _lines_match(expected: list[str], got: list[str]) -> bool:
    """Line by line; an expected line that is `...` alone stands for any number of lines (progress)."""
    if not expected:
        return not got
    if expected[0].strip() == "...":
        return any(_lines_match(expected[1:], got[skip:]) for skip in range(len(got) + 1))
    return bool(got) and _matches(expected[0], got[0]) and _lines_match(expected[1:], got[1:])


def _shell_blocks() -> list[object]:
    """The `sh` blocks; `sh slow REASON` ones as slow variants."""
    return [
        pytest.param(b, marks=pytest.mark.slow) if b.arg.startswith("slow") else b for b in _blocks("sh")
    ]


@pytest.mark.parametrize("block", _shell_blocks(), ids=lambda b: b.name)
def test_shell_block(block: Block, cluster: Cluster) -> None:
    result = _bash("set -e\n" + block.text, cluster)
    assert result.returncode == 0, f"{block.text}\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("block", _blocks("python"), ids=lambda b: b.name)
def test_python_block(block: Block, cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.text.replace(DEFAULT_TARGET, cluster.target))
    result = subprocess.run(
        [str(ROOT / ".venv/bin/python"), str(script)],
        cwd=tmp_path,  # files a block writes (operations.db) land here
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{block.name}\n{result.stdout}\n{result.stderr}"
    if block.arg:  # a regular expression the block's output must match, line by line
        assert re.search(block.arg, result.stdout, flags=re.M), (
            f"{block.name}: {block.arg!r} not in\n{result.stdout}"
        )


@pytest.mark.parametrize("block", _blocks("shard-map"), ids=lambda b: b.name)
def test_shard_map_example_loads(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "shard-map.yaml"
    path.write_text(block.text)
    shard_map = load_shard_map(str(path))
    assert shard_map.shards


@pytest.mark.parametrize("block", _blocks("setup-run"), ids=lambda b: b.name)
def test_run_command(block: Block, tmp_path: Path) -> None:
    """The install is CI's own; the command after it runs the demo on a fresh data directory."""
    commands = [c.strip() for c in block.text.strip().split("&&")]
    assert commands[0] == "python3 -m venv .venv" and commands[1].startswith(".venv/bin/pip install")
    run = [*shlex.split(commands[-1]), "--exit-after-demo", "--no-metrics", "--port", str(free_port())]
    # Not under tmp_path: the unprivileged PostgreSQL user must reach its data directory.
    data = pg_data_dir().parent
    run += ["--data-dir", str(data / "cluster")]
    started = time.monotonic()
    try:
        result = _run_demo(run, tmp_path)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replay" in result.stdout and "Stopped." in result.stdout
    assert time.monotonic() - started < 240


def _run_demo(run: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        run,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GRPC_VERBOSITY": "ERROR"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("block", _blocks("setup-test"), ids=lambda b: b.name)
def test_test_command_is_what_ci_runs(block: Block) -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [c.strip() for c in block.text.strip().split("&&")]
    assert commands[0] == "python3 -m venv .venv"
    install, test = commands[1], commands[-1]
    assert install.replace(" -q", "") in ci.replace(" -q", ""), f"CI does not run {install!r}"
    assert test in ci, f"CI does not run {test!r}"


def test_readme_python_never_imports_from_outside_the_install() -> None:
    """A block that works here only because the tests put the source tree on sys.path would fail a
    user: the blocks import only what the installed project provides."""
    for block in _blocks("python"):
        for module in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", block.text, flags=re.M):
            top = module.split(".")[0]
            assert top in {
                "grpc",
                "grpc_status",
                "shardrouter",
                "google",
                "uuid",
                "time",
                "pathlib",
            }, f"{block.name} imports {module}"


if __name__ == "__main__":  # pragma: no cover - a way to list the blocks while editing the README
    for b in ALL_BLOCKS:
        print(f"{b.name:32} {b.kind or '(none)':10} {b.arg}")
    sys.exit(0)
