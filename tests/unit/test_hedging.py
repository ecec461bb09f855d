"""The router's hedging rules on their own: the budget, the wait preference a hedge carries, the
race between two attempts (first decisive answer wins, the loser is cancelled), and which answers
are decisive."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shardrouter.core.errors import (
    Aborted,
    FailedPrecondition,
    Reason,
    ResourceExhausted,
    ShardRouterError,
    Unavailable,
    to_status_proto,
)
from shardrouter.core.wire import DETAILS_TRAILER
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.router.forwarding import Outcome, decisive
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


def test_a_hedge_past_a_stalled_daemon_borrows_one_more_burst_and_the_debt_is_earned_back() -> None:
    budget = HedgeBudget(0.5)
    assert sum(budget.take() for _ in range(20)) == HEDGE_BURST
    assert sum(budget.take(past_a_stall=True) for _ in range(20)) == HEDGE_BURST
    assert not budget.take(past_a_stall=True)
    budget.earn()
    budget.earn()  # one token earned: one more past the stall, none for an ordinary hedge
    assert not budget.take()
    assert budget.take(past_a_stall=True)
    for _ in range(2 * int(HEDGE_BURST) + 2):  # the debt paid, and one token more
        budget.earn()
    assert budget.take()


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


def _race(
    primary_s: float, hedge_s: float | None, decisive: set[str], log: list[str], refusals: int = 0
) -> tuple[str, bool]:
    """`refusals`: how many times the budget says no before the hedge goes (None: it never goes)."""

    def hedge() -> object:
        log.append("hedged")
        if hedge_s is None or log.count("hedged") <= refusals:
            return None
        return _answer("hedge", hedge_s, log)

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


def test_without_budget_the_primary_alone_answers_and_the_budget_is_asked_again_meanwhile() -> None:
    log: list[str] = []
    assert _race(0.2, None, {"primary"}, log) == ("primary", False)
    assert set(log) == {"hedged"} and len(log) >= 3


def test_a_hedge_refused_at_first_goes_once_the_budget_allows_and_is_not_asked_for_again() -> None:
    log: list[str] = []
    assert _race(5.0, 0.01, {"primary", "hedge"}, log, refusals=2) == ("hedge", True)
    assert log == ["hedged", "hedged", "hedged", "cancelled primary"]


def test_a_daemon_is_stalled_for_a_hedge_when_it_is_marked_and_the_other_is_not() -> None:
    slow = SlowDaemons(avoid_s=60)
    assert not slow.stalled("a", "b")
    slow.mark("a")
    assert slow.stalled("a", "b") and not slow.stalled("b", "a")
    slow.mark("b")
    assert not slow.stalled("a", "b")


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


def _outcome(error: ShardRouterError | None) -> Outcome:
    if error is None:
        return Outcome(grpc.StatusCode.OK, "", (), (), b"")
    details = to_status_proto(error).SerializeToString()
    return Outcome(error.code, error.message, (), ((DETAILS_TRAILER, details),), None)


def test_only_a_final_answer_is_decisive_a_refusal_the_other_daemon_may_not_share_waits_for_it() -> None:
    # An answer, a business refusal, a key reused: the caller's answer at once.
    assert decisive(_outcome(None))
    assert decisive(_outcome(FailedPrecondition("reused", reason=Reason.IDEMPOTENCY_KEY_REUSED)))
    # The twin in flight, this daemon's database lost (its session ended as stalled by the other
    # daemon's waiter), its admission full: the other attempt's answer is awaited.
    assert not decisive(_outcome(Aborted("in flight", reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT)))
    assert not decisive(_outcome(Unavailable("database unavailable", reason=Reason.DATABASE_UNAVAILABLE)))
    assert not decisive(_outcome(ResourceExhausted("shed", reason=Reason.SHARD_SATURATED)))
