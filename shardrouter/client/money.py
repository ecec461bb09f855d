"""Exact money text: "25.00" EUR <-> 2500 minor units, using ISO 4217 minor-unit exponents.

The API carries integer minor units only (never floats); this module is the one place where a human's
decimal text becomes minor units and back. Too many decimals for the currency ("25.001" EUR, "5.5"
JPY) are refused rather than rounded: a rounding client moves a different amount than was asked.
"""

from __future__ import annotations

import re

from shardrouter.core.validation import CURRENCIES

__all__ = ["AmountError", "exponent", "format_amount", "parse_amount"]

# ISO 4217 minor-unit exponents that differ from 2, for the currencies in `CURRENCIES`.
_EXPONENTS: dict[str, int] = {
    **dict.fromkeys(
        "BIF CLP DJF GNF ISK JPY KMF KRW PYG RWF UGX VND VUV XAF XOF XPF".split(),
        0,
    ),
    **dict.fromkeys(("BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"), 3),
}
_DEFAULT_EXPONENT = 2
_AMOUNT = re.compile(r"(?P<units>[0-9]+)(?:\.(?P<fraction>[0-9]*))?")


class AmountError(ValueError):
    """The text is not an amount of the currency (bad syntax, too many decimals, unknown currency)."""


def exponent(currency: str) -> int:
    """How many decimal places `currency` has (2 for EUR, 0 for JPY, 3 for KWD)."""
    if currency not in CURRENCIES:
        raise AmountError(f"unknown currency {currency!r}: expected an ISO 4217 code in upper case, e.g. EUR")
    return _EXPONENTS.get(currency, _DEFAULT_EXPONENT)


def parse_amount(text: str, currency: str) -> int:
    """Minor units of a non-negative decimal amount: parse_amount("25.5", "EUR") == 2550.

    Accepts digits with an optional decimal point and at most `exponent(currency)` decimals. No sign,
    exponent, thousands separators or inner spaces; surrounding whitespace is ignored.
    """
    places = exponent(currency)
    match = _AMOUNT.fullmatch(text.strip())
    if match is None:
        raise AmountError(
            f"invalid amount {text!r}: expected digits with an optional decimal point, e.g. 25.00"
        )
    fraction = match.group("fraction") or ""
    if match.group("fraction") == "" and places == 0:
        raise AmountError(f"invalid amount {text!r}: {currency} has no decimal places")
    if len(fraction) > places:
        raise AmountError(
            f"invalid amount {text!r}: {currency} has {places} decimal place{'s' if places != 1 else ''}, "
            f"got {len(fraction)}"
        )
    units = int(match.group("units"))
    minor = int(fraction.ljust(places, "0") or "0")
    scale: int = 10**places
    return units * scale + minor


def format_amount(amount_minor: int, currency: str) -> str:
    """The canonical decimal text of an amount: format_amount(2550, "EUR") == "25.50"."""
    places = exponent(currency)
    sign = "-" if amount_minor < 0 else ""
    units, fraction = divmod(abs(amount_minor), 10**places)
    return f"{sign}{units}.{fraction:0{places}d}" if places else f"{sign}{units}"
