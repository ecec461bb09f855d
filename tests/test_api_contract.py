"""The API surface: buf lint passes and the checked-in generated stubs are fresh."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("shardrouter/v1", "shardrouter/internal/v1")


def test_buf_lint_passes():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    result = subprocess.run([buf, "lint"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_checked_in_stubs_match_a_fresh_generation(tmp_path):
    subprocess.run(
        [sys.executable, "scripts/generate_stubs.py", "--out", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    for package in GENERATED:
        fresh = sorted(p.name for p in (tmp_path / package).glob("*_pb2*"))
        checked_in = sorted(p.name for p in (ROOT / package).glob("*_pb2*"))
        assert fresh == checked_in, f"{package}: stub files differ; run python scripts/generate_stubs.py"
        mismatch = filecmp.cmpfiles(tmp_path / package, ROOT / package, fresh, shallow=False)[1]
        assert not mismatch, f"stale stubs {mismatch}; run python scripts/generate_stubs.py"


def test_every_field_and_message_is_documented():
    """Each message, field, enum value, service and RPC in our protos has a comment above it."""
    for proto in sorted((ROOT / "proto").rglob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            declares = stripped.startswith(("message ", "enum ", "service ", "rpc ")) or (
                "=" in stripped
                and stripped.endswith(";")
                and not stripped.startswith(("syntax", "option", "//"))
            )
            if declares:
                above = lines[i - 1].strip() if i else ""
                assert above.startswith("//"), f"{proto.name}:{i + 1} undocumented: {stripped}"
