"""The key rules of shardrouter/core/keys.py (every key kind) and the interceptor's key steps, without a server."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from shardrouter.core.errors import FailedPrecondition, InvalidArgument, Reason
from shardrouter.core.keys import derived_key, key_time, new_key, parse_key
from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.steps import check_key_age, read_key

VALID = "0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"
CONFIG = IdempotencyConfig(retention=timedelta(days=30))
NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _reason(text: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_key(text)
    return info.value.reason


def test_a_canonical_uuidv7_parses_in_either_case_and_dates_itself() -> None:
    for text in (VALID, VALID.upper()):
        key = parse_key(text)
        assert key.text == VALID and key.uuid == uuid.UUID(VALID) and key.is_uuidv7
        assert key.dated_at == key_time(uuid.UUID(VALID))
        assert key.describe() == "a UUIDv7"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("3b241101-e2bb-4255-8caf-4136c566a962", "a version 4 UUID"),
        (str(uuid.uuid1()), "a version 1 UUID"),
        (str(uuid.uuid5(uuid.NAMESPACE_DNS, "x")), "a version 5 UUID"),
        (
            "0192d1a8-7c1e-7b3a-cf2e-3c4d5e6f7a8b",
            "a UUID of a non-RFC 9562 variant",
        ),  # a v7 of another variant
    ],
    ids=["v4", "v1", "v5", "v7-other-variant"],
)
def test_any_other_canonical_uuid_is_a_uuid_key_dated_by_receipt(text: str, kind: str) -> None:
    for sent in (text, text.upper()):
        key = parse_key(sent)
        assert key.text == text.lower() and key.uuid == uuid.UUID(text)
        assert key.dated_at is None and not key.is_uuidv7
        assert key.describe() == kind


@pytest.mark.parametrize(
    "text",
    [
        "a",
        "~" * 255,
        'order-7781/attempt:A,"quoted"',
        "ABC-def",
        "{0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b}",  # braces: not canonical, so opaque
        "0192d1a87c1e7b3a9f2e3c4d5e6f7a8b",  # no hyphens
        "urn:uuid:0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b",
        VALID[:-1],  # 35 characters
        "0192d1a87-c1e-7b3a-9f2e-3c4d5e6f7a8b",  # hyphens moved
        "g192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b",  # not hex
    ],
)
def test_any_other_visible_ascii_text_is_an_opaque_key_taken_as_sent(text: str) -> None:
    key = parse_key(text)
    assert key == parse_key(text) and key.text == text
    assert key.uuid is None and key.dated_at is None
    assert key.describe() == "an opaque key"
    if text.lower() != text:
        assert parse_key(text.lower()).text != key.text  # opaque keys are case-sensitive


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "got 0 characters"),
        ("k" * 256, "got 256 characters, at most 255"),
        ("k" * 10_000, "got 10000 characters"),
        ("two words", "character 4 is a space"),
        ("tab\there", "character 4 is a control character (U+0009)"),
        ("nul\x00", "character 4 is a control character (U+0000)"),
        ("del\x7f", "character 4 is a control character (U+007F)"),
        ("caf\u00e9", "character 4 is a non-ASCII character (U+00E9)"),
        (" " + VALID, "character 1 is a space"),
    ],
    ids=["empty", "256", "10KB", "space", "tab", "nul", "del", "non-ascii", "padded-uuid"],
)
def test_a_malformed_key_says_what_is_wrong_and_what_a_key_may_be(text: str, problem: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_key(text)
    assert info.value.reason == "IDEMPOTENCY_KEY_INVALID"
    assert problem in info.value.message
    assert "UUIDv7" in info.value.message and "opaque key of 1-255 visible ASCII" in info.value.message


def test_a_key_from_after_the_year_9000_is_from_the_future() -> None:
    far = uuid.UUID(
        int=(int(datetime(9001, 1, 1, tzinfo=UTC).timestamp() * 1000) << 80) | (0x7 << 76) | (0b10 << 62)
    )
    assert _reason(str(far)) == "IDEMPOTENCY_KEY_FROM_FUTURE"


def test_new_key_is_a_v7_carrying_its_time() -> None:
    key = new_key(1_700_000_000_123)
    assert key.version == 7 and key.variant == uuid.RFC_4122
    assert key_time(key) == datetime.fromtimestamp(1_700_000_000.123, tz=UTC)
    assert parse_key(str(key)).uuid == key
    assert new_key(1_700_000_000_123) != key  # 74 random bits
    with pytest.raises(ValueError, match="48 bits"):
        new_key(-1)


def test_a_derived_key_is_deterministic_and_expires_with_its_base() -> None:
    base = new_key(1_700_000_000_000)
    credit, refund = derived_key(base, "credit"), derived_key(base, "refund")
    assert derived_key(base, "credit") == credit != refund
    assert key_time(credit) == key_time(refund) == key_time(base)
    assert parse_key(str(credit)).dated_at == key_time(base)


def test_read_key_gives_the_key_its_time_and_its_expiry_trailer() -> None:
    read = read_key((("x-caller-id", "c"), ("idempotency-key", VALID)), CONFIG, NOW)
    assert read.key == parse_key(VALID) and read.text == VALID and read.dated_by_key
    assert read.time == key_time(uuid.UUID(VALID))
    assert read.expires_at == read.time + timedelta(days=30)
    assert read.expiry_trailer == (
        "idempotency-expires-at",
        read.expires_at.isoformat(timespec="milliseconds"),
    )


@pytest.mark.parametrize("text", ["6f1c0e2a-9b7d-4c3e-8a51-2d4f6e8b0c17", "opaque:1"])
def test_read_key_dates_any_other_key_by_its_receipt(text: str) -> None:
    read = read_key((("idempotency-key", text),), CONFIG, NOW)
    assert read.text == text and not read.dated_by_key
    assert read.time == NOW and read.expires_at == NOW + CONFIG.retention
    # Neither expired nor from the future, whatever the clock says.
    check_key_age(read, NOW, CONFIG)


@pytest.mark.parametrize("text", ["6f1c0e2a-9b7d-4c3e-8a51-2d4f6e8b0c17", "opaque:1", "0192d1a8-7c1e-7b3a-cf2e-3c4d5e6f7a8b"])
def test_read_key_with_require_uuidv7_refuses_any_other_key(text: str) -> None:
    config = IdempotencyConfig(require_uuidv7=True)
    with pytest.raises(InvalidArgument) as info:
        read_key((("idempotency-key", text),), config, NOW)
    assert info.value.reason == "IDEMPOTENCY_KEY_INVALID"
    assert "this shard accepts only UUIDv7 keys" in info.value.message
    assert read_key((("idempotency-key", VALID),), config, NOW).dated_by_key


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
        read_key(metadata, CONFIG, NOW)
    assert info.value.reason == reason


def test_the_key_age_rules_use_the_retention_window_and_the_clock_skew() -> None:
    config = IdempotencyConfig(retention=timedelta(days=30), max_clock_skew=timedelta(minutes=5))
    now = datetime(2026, 3, 1, tzinfo=UTC)

    def at(moment: datetime):
        return read_key((("idempotency-key", str(new_key(int(moment.timestamp() * 1000)))),), config, now)

    check_key_age(at(now - timedelta(days=29, hours=23)), now, config)
    check_key_age(at(now + timedelta(minutes=5)), now, config)
    with pytest.raises(FailedPrecondition) as expired:
        check_key_age(at(now - timedelta(days=30)), now, config)  # expiry is exclusive
    assert expired.value.reason == "IDEMPOTENCY_KEY_EXPIRED"
    assert set(expired.value.metadata) == {"key_time", "expired_at"}
    with pytest.raises(InvalidArgument) as future:
        check_key_age(at(now + timedelta(minutes=5, milliseconds=1)), now, config)
    assert future.value.reason == "IDEMPOTENCY_KEY_FROM_FUTURE"


def test_the_nil_uuid_is_refused_as_a_client_bug() -> None:
    for sent in ("00000000-0000-0000-0000-000000000000", str(uuid.UUID(int=0)).upper()):
        with pytest.raises(InvalidArgument, match="almost always a client bug") as refused:
            parse_key(sent)
        assert refused.value.reason == Reason.IDEMPOTENCY_KEY_INVALID
