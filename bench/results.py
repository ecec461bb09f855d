"""What one cell measured, and the latency summary both the pgbench and the gRPC cells report."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values), max(1, math.ceil(q * len(sorted_values))))
    return sorted_values[rank - 1]


def latency_summary(latencies_ms: list[float]) -> dict[str, float]:
    """The same fields as the load generator's summary."""
    values = sorted(latencies_ms)
    return {
        "count": len(values),
        "mean_ms": sum(values) / len(values) if values else 0.0,
        "p50_ms": percentile(values, 0.5),
        "p90_ms": percentile(values, 0.9),
        "p99_ms": percentile(values, 0.99),
        "p999_ms": percentile(values, 0.999),
        "max_ms": values[-1] if values else 0.0,
    }


@dataclass
class CellResult:
    """One scenario at one concurrency."""

    scenario: str
    concurrency: int
    ok: int
    errors: dict[str, int]
    throughput: float
    latency: dict[str, float]
    window_s: float
    #: CPU seconds over the measured window, by process name ("client" = the load generator/pgbench).
    cpu_s: dict[str, float]
    #: Peak RSS (KiB) during the cell, by process name.
    peak_rss_kb: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)

    def cpu_us_per_op(self, names: list[str]) -> float:
        """CPU microseconds per OK operation summed over `names`."""
        if self.ok == 0:
            return 0.0
        return sum(self.cpu_s.get(n, 0.0) for n in names) / self.ok * 1e6

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return asdict(self)
