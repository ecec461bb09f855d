"""The router's hedging rules on their own: the budget, the wait preference a hedge carries, and the
race between two attempts (first decisive answer wins, the loser is cancelled)."""

from __future__ import annotations

import asyncio

import pytest

from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.router.hedging import HEDGE_BURST, HedgeBudget, SlowDaemons, first_decisive, with_wait


def test_the_budget_saves_a_burst_then_earns_its_share_of_calls() -> None:
    budget = HedgeBudget(0.25)
    assert sum(budget.take() for _ in range(20)) == HEDGE_BURST
    assert not budget.take()
    for _ in range(8):  # eight calls at a quarter of a token: two hedges
        budget.earn()
    assert [budget.take() for _ in range(3)] == [True, True, False]
    with pytest.raises(ValueError, match="share of calls"):
        HedgeBudget(1.5)


def test_a_hedge_asks_to_wait_unless_the_caller_said_how_long() -> None:
    base = (("idempotency-key", "k"),)
    assert with_wait(base, 900) == (*base, (WAIT_METADATA, "900"))
    own = (*base, (WAIT_METADATA, "5"))
    assert with_wait(own, 900) == own
    assert with_wait(base, 0) == base


async def _answer(value: str, after_s: float, log: list[str]) -> str:
    try:
        await asyncio.sleep(after_s)
    except asyncio.CancelledError:
        log.append(f"cancelled {value}")
        raise
    return value


def _race(primary_s: float, hedge_s: float | None, decisive: set[str], log: list[str]) -> tuple[str, bool]:
    def hedge() -> object:
        log.append("hedged")
        return None if hedge_s is None else _answer("hedge", hedge_s, log)

    return asyncio.run(
        first_decisive(
            _answer("primary", primary_s, log),
            hedge,  # type: ignore[arg-type]
            hedge_after_s=0.05,
            decisive=lambda result: result in decisive,
        )
    )


def test_a_quick_primary_is_not_hedged() -> None:
    log: list[str] = []
    assert _race(0.0, 0.0, {"primary", "hedge"}, log) == ("primary", False)
    assert log == []


def test_a_slow_primary_is_hedged_the_hedge_wins_and_the_primary_is_cancelled() -> None:
    log: list[str] = []
    assert _race(5.0, 0.01, {"primary", "hedge"}, log) == ("hedge", True)
    assert log == ["hedged", "cancelled primary"]


def test_an_answer_that_is_not_decisive_waits_for_the_other() -> None:
    log: list[str] = []  # the hedge found the key in flight at the primary's daemon: wait for it
    assert _race(0.2, 0.01, {"primary"}, log) == ("primary", False)
    assert log == ["hedged"]


def test_without_budget_the_primary_alone_answers() -> None:
    log: list[str] = []
    assert _race(0.1, None, {"primary"}, log) == ("primary", False)
    assert log == ["hedged"]


def test_a_daemon_hedged_past_is_avoided_until_it_answers_or_the_moment_passes() -> None:
    slow = SlowDaemons(avoid_s=60)
    daemons = ["a", "b"]
    assert slow.order(daemons, 0) == ("a", "b")
    slow.mark("a")
    assert slow.order(daemons, 0) == ("b", "a") and slow.order(daemons, 1) == ("b", "a")
    slow.mark("b")  # both slow: each call keeps its turn
    assert slow.order(daemons, 0) == ("a", "b")
    slow.answered("a")
    assert slow.order(daemons, 1) == ("a", "b")
    quick = SlowDaemons(avoid_s=0)
    quick.mark("a")
    assert quick.order(daemons, 0) == ("a", "b")  # the moment has passed
