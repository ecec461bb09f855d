"""`Prefer: wait=N` (RFC 7240) as the HTTP front reads it, and `Preference-Applied` as it writes it."""

from __future__ import annotations

import pytest

from shardrouter.router.http.prefer import (
    MAX_FORWARDED_WAIT_S,
    PreferWaitError,
    parse_prefer_wait,
    preference_applied,
)


@pytest.mark.parametrize(
    ("values", "wait"),
    [
        ([], None),
        (["respond-async"], None),
        (["wait=5"], 5),
        (["WAIT = 7"], 7),
        (['wait="3"'], 3),
        (["respond-async, wait=10"], 10),
        (["respond-async", "wait=4;foo=bar"], 4),
        (["wait=2, wait=9"], 2),  # only the first instance counts
        (['handling="a,wait=8", wait=1'], 1),  # a comma inside a quoted word splits nothing
        (["wait=0"], 0),
        (["wait=99999999999"], MAX_FORWARDED_WAIT_S),
    ],
)
def test_the_first_wait_preference_is_read(values: list[str], wait: int | None) -> None:
    assert parse_prefer_wait(values) == wait


@pytest.mark.parametrize("value", ["wait=-1", "wait=1.5", "wait=soon", "wait", "wait="])
def test_a_wait_that_is_not_whole_seconds_is_refused_400(value: str) -> None:
    with pytest.raises(PreferWaitError) as refused:
        parse_prefer_wait([value])
    error = refused.value.to_error()
    assert error.code.name == "INVALID_ARGUMENT" and "Prefer" in error.message


def test_the_granted_wait_is_applied_in_whole_seconds() -> None:
    assert preference_applied("5000") == "wait=5"
    assert preference_applied("1500") == "wait=1"
    assert preference_applied(None) is None and preference_applied("x") is None
