"""The key rules of shardrouter/core/keys.py and the interceptor's key steps, without a server."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from shardrouter.core.errors import FailedPrecondition, InvalidArgument
from shardrouter.core.keys import derived_key, key_time, new_key, parse_key
from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.steps import check_key_age, read_key

VALID = "0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"


def _reason(text: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_key(text)
    return info.value.reason


def test_a_canonical_uuidv7_parses_in_either_case() -> None:
    assert str(parse_key(VALID)) == VALID
    assert str(parse_key(VALID.upper())) == VALID


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (VALID[:-1], "35 characters"),
        ("z" * 36, "not a UUID"),
        ("0192d1a87-c1e-7b3a-9f2e-3c4d5e6f7a8b", "canonical"),
        (str(uuid.UUID(int=uuid.uuid4().int)), "version 4"),
        ("00000000-0000-0000-0000-000000000000", "not an RFC 9562 UUID"),
        ("0192d1a8-7c1e-7b3a-cf2e-3c4d5e6f7a8b", "not an RFC 9562 UUID"),  # Microsoft variant
    ],
    ids=["short", "not-hex", "hyphens-moved", "v4", "nil", "variant"],
)
def test_a_malformed_key_says_what_is_wrong_and_what_a_key_must_be(text: str, problem: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_key(text)
    assert info.value.reason == "IDEMPOTENCY_KEY_INVALID"
    assert problem in info.value.message
    assert "UUIDv7 (RFC 9562)" in info.value.message


def test_a_key_from_after_the_year_9000_is_from_the_future() -> None:
    far = uuid.UUID(
        int=(int(datetime(9001, 1, 1, tzinfo=UTC).timestamp() * 1000) << 80) | (0x7 << 76) | (0b10 << 62)
    )
    assert _reason(str(far)) == "IDEMPOTENCY_KEY_FROM_FUTURE"


def test_new_key_is_a_v7_carrying_its_time() -> None:
    key = new_key(1_700_000_000_123)
    assert key.version == 7 and key.variant == uuid.RFC_4122
    assert key_time(key) == datetime.fromtimestamp(1_700_000_000.123, tz=UTC)
    assert parse_key(str(key)) == key
    assert new_key(1_700_000_000_123) != key  # 74 random bits
    with pytest.raises(ValueError, match="48 bits"):
        new_key(-1)


def test_a_derived_key_is_deterministic_and_expires_with_its_base() -> None:
    base = new_key(1_700_000_000_000)
    credit, refund = derived_key(base, "credit"), derived_key(base, "refund")
    assert derived_key(base, "credit") == credit != refund
    assert key_time(credit) == key_time(refund) == key_time(base)
    assert parse_key(str(credit)) == credit


def test_read_key_gives_the_key_its_time_and_its_expiry_trailer() -> None:
    read = read_key((("x-caller-id", "c"), ("idempotency-key", VALID)), timedelta(days=30))
    assert read.key == uuid.UUID(VALID) and read.text == VALID
    assert read.time == key_time(read.key)
    assert read.expires_at == read.time + timedelta(days=30)
    assert read.expiry_trailer == (
        "idempotency-expires-at",
        read.expires_at.isoformat(timespec="milliseconds"),
    )


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((), "IDEMPOTENCY_KEY_MISSING"),
        ((("idempotency-key", VALID), ("idempotency-key", VALID)), "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key", VALID.encode()),), "IDEMPOTENCY_KEY_INVALID"),
    ],
    ids=["missing", "twice", "binary"],
)
def test_read_key_wants_exactly_one_text_entry(
    metadata: tuple[tuple[str, str | bytes], ...], reason: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        read_key(metadata, timedelta(days=1))
    assert info.value.reason == reason


def test_the_key_age_rules_use_the_retention_window_and_the_clock_skew() -> None:
    config = IdempotencyConfig(retention=timedelta(days=30), max_clock_skew=timedelta(minutes=5))
    now = datetime(2026, 3, 1, tzinfo=UTC)

    def at(moment: datetime):
        return read_key(
            (("idempotency-key", str(new_key(int(moment.timestamp() * 1000)))),), config.retention
        )

    check_key_age(at(now - timedelta(days=29, hours=23)), now, config)
    check_key_age(at(now + timedelta(minutes=5)), now, config)
    with pytest.raises(FailedPrecondition) as expired:
        check_key_age(at(now - timedelta(days=30)), now, config)  # expiry is exclusive
    assert expired.value.reason == "IDEMPOTENCY_KEY_EXPIRED"
    assert set(expired.value.metadata) == {"key_time", "expired_at"}
    with pytest.raises(InvalidArgument) as future:
        check_key_age(at(now + timedelta(minutes=5, milliseconds=1)), now, config)
    assert future.value.reason == "IDEMPOTENCY_KEY_FROM_FUTURE"
