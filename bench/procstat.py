"""CPU seconds and peak memory of processes, read from /proc.

CPU is utime + stime of a process (all its threads). For PostgreSQL it is the postmaster's own plus
its reaped children's (cutime + cstime: backends that already exited) plus every live child's, so a
backend that exits mid-cell is still counted. Peak RSS is VmHWM; writing 5 to /proc/PID/clear_refs
resets it, so each cell reports its own peak rather than the process's lifetime peak.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # the process is gone
        return None
    # The command name (field 2) may contain spaces; everything after its closing ")" is fixed.
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, with_reaped_children: bool = False) -> float:
    """utime + stime of `pid` (optionally + cutime + cstime), in seconds; 0 if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # After the ")" field 3 (state) is index 0, so utime (14) is 11, stime 12, cutime 13, cstime 14.
    ticks = int(fields[11]) + int(fields[12])
    if with_reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICKS


def children(pid: int) -> list[int]:
    """Live direct children of `pid`."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def tree_cpu_seconds(root: int) -> float:
    """CPU of a process tree root and its children, including children that already exited."""
    return cpu_seconds(root, with_reaped_children=True) + sum(cpu_seconds(c) for c in children(root))


def peak_rss_kb(pid: int) -> int:
    """VmHWM of `pid` in KiB (0 if unknown)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def reset_peak_rss(pid: int) -> None:
    """Start a new VmHWM period for `pid` (needs permission on its clear_refs; ignored otherwise)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


@dataclass(frozen=True)
class Tracked:
    """A process whose CPU and memory a cell reports; `tree` for the postmaster (sum over backends)."""

    name: str
    pid: int
    tree: bool = False

    def cpu(self) -> float:
        """CPU seconds so far."""
        return tree_cpu_seconds(self.pid) if self.tree else cpu_seconds(self.pid)

    def reset_peak(self) -> None:
        """Reset the peak RSS of the process (and of each backend for a tree)."""
        for pid in [self.pid, *(children(self.pid) if self.tree else [])]:
            reset_peak_rss(pid)

    def peak_kb(self) -> int:
        """Peak RSS since the reset: for a tree, the largest single backend's (shared buffers count
        in every backend that touched them, so a sum would be meaningless)."""
        pids = [self.pid, *(children(self.pid) if self.tree else [])]
        return max((peak_rss_kb(p) for p in pids), default=0)


def sample(tracked: list[Tracked]) -> dict[str, float]:
    """CPU seconds of every tracked process, now."""
    return {t.name: t.cpu() for t in tracked}
