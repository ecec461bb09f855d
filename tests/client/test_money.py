"""Money text <-> minor units, with ISO 4217 exponents."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardrouter.client.money import AmountError, exponent, format_amount, parse_amount
from shardrouter.core.validation import CURRENCIES, MAX_AMOUNT_MINOR


@pytest.mark.parametrize(
    ("text", "currency", "minor"),
    [
        ("25.00", "EUR", 2500),
        ("25", "EUR", 2500),
        ("25.5", "USD", 2550),
        ("0.01", "EUR", 1),
        (" 7.10 ", "EUR", 710),
        ("25.", "EUR", 2500),
        ("1500", "JPY", 1500),
        ("1500", "KRW", 1500),
        ("1.234", "KWD", 1234),
        ("1.2", "BHD", 1200),
        ("0.001", "TND", 1),
        ("10", "CLP", 10),
    ],
)
def test_parses_to_minor_units(text: str, currency: str, minor: int) -> None:
    assert parse_amount(text, currency) == minor


@pytest.mark.parametrize(
    ("text", "currency", "problem"),
    [
        ("25.001", "EUR", "2 decimal places, got 3"),
        ("1.5", "JPY", "0 decimal places, got 1"),
        ("1.", "JPY", "no decimal places"),
        ("1.2345", "KWD", "3 decimal places, got 4"),
        ("-5.00", "EUR", "invalid amount"),
        ("+5", "EUR", "invalid amount"),
        ("1e3", "EUR", "invalid amount"),
        ("1,000.00", "EUR", "invalid amount"),
        (".50", "EUR", "invalid amount"),
        ("", "EUR", "invalid amount"),
        ("1 000", "EUR", "invalid amount"),
        ("5", "eur", "unknown currency"),
        ("5", "XXX", "unknown currency"),
    ],
)
def test_rejects_bad_text(text: str, currency: str, problem: str) -> None:
    with pytest.raises(AmountError, match=problem):
        parse_amount(text, currency)


def test_exponents_follow_iso_4217() -> None:
    assert [exponent(c) for c in ("EUR", "USD", "GBP", "JPY", "KRW", "BHD", "KWD", "JOD", "OMR")] == [
        2, 2, 2, 0, 0, 3, 3, 3, 3,
    ]  # fmt: skip
    assert {exponent(c) for c in CURRENCIES} == {0, 2, 3}


def test_formats_canonically() -> None:
    assert format_amount(2550, "EUR") == "25.50"
    assert format_amount(5, "EUR") == "0.05"
    assert format_amount(1500, "JPY") == "1500"
    assert format_amount(1, "KWD") == "0.001"
    assert format_amount(-250, "EUR") == "-2.50"


currencies = st.sampled_from(sorted(CURRENCIES))


@given(st.integers(min_value=0, max_value=MAX_AMOUNT_MINOR), currencies)
def test_format_then_parse_is_identity(minor: int, currency: str) -> None:
    text = format_amount(minor, currency)
    assert parse_amount(text, currency) == minor
    assert text.count(".") == (1 if exponent(currency) else 0)


@given(
    st.integers(min_value=0, max_value=10**12),
    st.text(alphabet="0123456789", max_size=3),
    currencies,
)
def test_parse_then_format_is_canonical(units: int, fraction: str, currency: str) -> None:
    places = exponent(currency)
    text = f"{units}.{fraction}" if fraction else str(units)
    if len(fraction) > places:
        with pytest.raises(AmountError):
            parse_amount(text, currency)
        return
    minor = parse_amount(text, currency)
    assert minor == units * 10**places + int(fraction.ljust(places, "0") or 0)
    assert parse_amount(format_amount(minor, currency), currency) == minor
