"""Request validation shared by the router and the shard daemons.

Checks here depend on the request alone, never on stored state, so a failure is answered with
INVALID_ARGUMENT before any idempotency key is claimed (a corrected request may reuse the key). The
helpers (`account_problems`, `money_problems`, `is_uuid`, `raise_if_any`) also serve the shard's
internal API's validators (`shardd.ledger.service`).
"""

from __future__ import annotations

import re

from shardrouter.core.errors import FieldViolation, InvalidArgument, Reason
from shardrouter.v1 import transfer_pb2

ACCOUNT_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_AMOUNT_MINOR = 10**15
MAX_REFERENCE_LENGTH = 140
MAX_WAIT_MS = 30_000

# ISO 4217 codes of currencies in circulation; an unknown code is a caller bug, not a new currency.
CURRENCIES = frozenset(
    (
        "AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN BWP BYN "
        "BZD CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD FKP GBP GEL GHS "
        "GIP GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS KHR KMF KPW KRW "
        "KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MYR MZN NAD "
        "NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR RON RSD RUB RWF SAR SBD SCR SDG SEK SGD "
        "SHP SLE SOS SRD SSP STN SYP SZL THB TJS TMT TND TOP TRY TTD TWD TZS UAH UGX USD UYU UZS VES VND "
        "VUV WST XAF XCD XOF XPF YER ZAR ZMW ZWG "
    ).split()  # a word list reads better than 160 quoted strings
)


def account_id_problem(account_id: str) -> str | None:
    """Why `account_id` is not a valid account id, or None if it is."""
    if not account_id:
        return "must not be empty"
    if ACCOUNT_ID_PATTERN.fullmatch(account_id) is None:
        return "must be 1-64 characters of A-Z, a-z, 0-9, '_', '.', '-', starting with a letter or digit"
    return None


def money_problems(field: str, money: transfer_pb2.Money, has_money: bool) -> list[FieldViolation]:
    """What is wrong with a Money field (empty list if nothing)."""
    if not has_money:
        return [FieldViolation(field, "is required")]
    problems = []
    if money.amount_minor <= 0:
        problems.append(FieldViolation(f"{field}.amount_minor", "must be positive (minor units, e.g. cents)"))
    elif money.amount_minor > MAX_AMOUNT_MINOR:
        problems.append(FieldViolation(f"{field}.amount_minor", f"must be at most {MAX_AMOUNT_MINOR}"))
    if money.currency not in CURRENCIES:
        problems.append(
            FieldViolation(f"{field}.currency", "must be an ISO 4217 code in upper case, e.g. EUR")
        )
    return problems


def account_problems(field: str, account_id: str) -> list[FieldViolation]:
    """What is wrong with the account id in `field` (empty list if nothing)."""
    problem = account_id_problem(account_id)
    return [] if problem is None else [FieldViolation(field, problem)]


def _reference_problems(reference: str) -> list[FieldViolation]:
    if len(reference) > MAX_REFERENCE_LENGTH:
        return [FieldViolation("reference", f"must be at most {MAX_REFERENCE_LENGTH} characters")]
    if any(not ch.isprintable() for ch in reference):
        return [FieldViolation("reference", "must not contain control characters")]
    return []


def raise_if_any(what: str, problems: list[FieldViolation]) -> None:
    """Raise InvalidArgument naming every problem of a `what` request, if there is any."""
    if problems:
        summary = "; ".join(f"{v.field} {v.description}" for v in problems)
        raise InvalidArgument(
            f"invalid {what} request: {summary}", reason=Reason.INVALID_REQUEST, field_violations=problems
        )


def validate_transfer(request: transfer_pb2.TransferRequest) -> None:
    """Raise InvalidArgument listing every problem of a TransferRequest."""
    problems = account_problems("source_account_id", request.source_account_id)
    problems += account_problems("destination_account_id", request.destination_account_id)
    if request.source_account_id and request.source_account_id == request.destination_account_id:
        problems.append(FieldViolation("destination_account_id", "must differ from source_account_id"))
    problems += money_problems("amount", request.amount, request.HasField("amount"))
    problems += _reference_problems(request.reference)
    raise_if_any("Transfer", problems)


def validate_deposit(request: transfer_pb2.DepositRequest) -> None:
    """Raise InvalidArgument listing every problem of a DepositRequest."""
    problems = account_problems("account_id", request.account_id)
    problems += money_problems("amount", request.amount, request.HasField("amount"))
    problems += _reference_problems(request.reference)
    raise_if_any("Deposit", problems)


def validate_get_balance(request: transfer_pb2.GetBalanceRequest) -> None:
    """Raise InvalidArgument if the account id is malformed."""
    raise_if_any("GetBalance", account_problems("account_id", request.account_id))


def validate_get_transfer(request: transfer_pb2.GetTransferRequest) -> None:
    """Raise InvalidArgument if the account id or transfer id is malformed."""
    problems = account_problems("source_account_id", request.source_account_id)
    if not is_uuid(request.transfer_id):
        problems.append(FieldViolation("transfer_id", "must be the UUID returned by Transfer"))
    if request.wait_for_completion_ms > MAX_WAIT_MS:
        problems.append(FieldViolation("wait_for_completion_ms", f"must be at most {MAX_WAIT_MS}"))
    raise_if_any("GetTransfer", problems)


_UUID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def is_uuid(text: str) -> bool:
    """Whether `text` is a UUID in canonical form (lower-case hex, hyphenated), as `str(uuid)` gives."""
    return _UUID_PATTERN.fullmatch(text) is not None


__all__ = [
    "ACCOUNT_ID_PATTERN",
    "CURRENCIES",
    "MAX_AMOUNT_MINOR",
    "MAX_REFERENCE_LENGTH",
    "MAX_WAIT_MS",
    "account_id_problem",
    "account_problems",
    "is_uuid",
    "money_problems",
    "raise_if_any",
    "validate_deposit",
    "validate_get_balance",
    "validate_get_transfer",
    "validate_transfer",
]
