"""Smoke test of `python -m bench.hedging`: a tiny run end to end, three cells with figures, the
stalled cells slower than the reference, hedges counted only where hedging is on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--duration", "1.5", "--warmup", "0.3", "--stall", "0.6", "--concurrency", "4")

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="the load generator needs node and npm",
)


# Hedged forwarding itself is tested by tests/router/test_hedged_forwarding.py and
# tests/faults/test_hedged_faults.py; the bench's smoke run is the slow variant.
@pytest.mark.slow
def test_a_tiny_run_prints_three_cells_and_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "hedging.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.hedging", *TINY, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| stall, hedging on |" in result.stdout and "Target: with hedging" in result.stdout
    found = json.loads(out.read_text())
    cells = {c["cell"]: c for c in found["cells"]}
    assert list(cells) == ["no stall, hedging off", "stall, hedging off", "stall, hedging on"]
    for cell in cells.values():
        assert cell["ops_s"] > 0 and cell["p50_ms"] > 0 and not cell["errors"], cell
    # Without hedging, a caller whose call sat on the stopped daemon waited for the whole stall.
    assert cells["stall, hedging off"]["max_ms"] >= 500
    assert cells["no stall, hedging off"]["hedges_per_call"] == 0 == cells["stall, hedging off"]["hedges_per_call"]
    assert cells["stall, hedging on"]["hedges_per_call"] > 0
    assert isinstance(found["passed"], bool) and "extra attempts" in found["verdict"]
