"""The report's hot-account verdict: the ratio of our shard, and beside it the same ratio of the
handler without idempotency when the run measured it (what one row lock costs without us)."""

from __future__ import annotations

from bench.report import targets
from bench.results import CellResult
from bench.run import RunResult


def _cell(scenario: str, throughput: float) -> CellResult:
    return CellResult(
        scenario=scenario,
        concurrency=16,
        ok=int(throughput * 5),
        errors={},
        throughput=throughput,
        latency={"p50_ms": 1.0, "p99_ms": 2.0, "p999_ms": 3.0},
        window_s=5.0,
        cpu_s={},
        peak_rss_kb={},
    )


def _hot_target(result: RunResult) -> tuple[str, bool | None]:
    (found,) = [t for t in targets(result) if t.name == "one hot account vs the same load spread"]
    return found.figure, found.passed


def test_the_hot_account_verdict_shows_the_handler_without_idempotency_beside_ours() -> None:
    result = RunResult(
        cells=[
            _cell("shard-deposit", 600),
            _cell("hot-account", 450),
            _cell("noidem-deposit", 1000),
            _cell("noidem-hot-account", 700),
        ]
    )
    figure, passed = _hot_target(result)
    assert figure.startswith("0.75x (450 @c16 / 600 @c16)"), figure
    assert figure.endswith("; without idempotency 0.70x (700 / 1000)"), figure
    assert passed is False  # the verdict is still ours against the target alone


def test_the_hot_account_verdict_stands_alone_without_the_baseline_rows() -> None:
    figure, passed = _hot_target(RunResult(cells=[_cell("shard-deposit", 500), _cell("hot-account", 450)]))
    assert figure == "0.90x (450 @c16 / 500 @c16)" and passed is True
    assert _hot_target(RunResult(cells=[_cell("noidem-hot-account", 700)])) == ("not measured", None)
