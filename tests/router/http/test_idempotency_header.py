"""The `Idempotency-Key` header parser: both forms, RFC 8941 string examples, every refusal."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardrouter.core.errors import Reason
from shardrouter.router.http.idempotency_header import (
    MAX_KEY_LENGTH,
    IdempotencyKeyBadCharacter,
    IdempotencyKeyBadEscape,
    IdempotencyKeyEmpty,
    IdempotencyKeyHeaderError,
    IdempotencyKeyMissing,
    IdempotencyKeyRepeated,
    IdempotencyKeyTooLong,
    IdempotencyKeyTrailingText,
    IdempotencyKeyUnterminated,
    parse_idempotency_key,
)

UUID = "0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"
VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)


@pytest.mark.parametrize(
    ("header", "key"),
    [
        (UUID, UUID),
        (f'"{UUID}"', UUID),
        ("abc", "abc"),
        ('"abc"', "abc"),
        ("  abc\t", "abc"),
        (' "abc" ', "abc"),
        ("key_123-ABC.~!#$%&'*+/:;<=>?@[]^`{|}", "key_123-ABC.~!#$%&'*+/:;<=>?@[]^`{|}"),
        ('"a,b"', "a,b"),  # a comma inside a quoted key is part of the key
        ('"a\\"b"', 'a"b'),
        ('"a\\\\b"', "a\\b"),
        ("x" * MAX_KEY_LENGTH, "x" * MAX_KEY_LENGTH),
        (["abc"], "abc"),
        (("abc",), "abc"),
    ],
)
def test_accepted_keys(header, key):
    assert parse_idempotency_key(header) == key


# RFC 8941 section 3.3.3 / the structured-field test suite's string cases, as far as a key allows.
@pytest.mark.parametrize(
    ("header", "key_or_error"),
    [
        ('"foo"', "foo"),
        ('"foo \\"bar\\""', IdempotencyKeyBadCharacter),  # valid sf-string, but a key has no spaces
        ('"foo\\"bar\\""', 'foo"bar"'),  # the same quoting without spaces
        ('"hello world"', IdempotencyKeyBadCharacter),  # the RFC's Example-String: spaces refused
        ('""', IdempotencyKeyEmpty),  # "empty string": valid sf-string, empty key
        ('"   "', IdempotencyKeyBadCharacter),
        ('"f\u00fc\u00fc"', IdempotencyKeyBadCharacter),  # "non-ascii string"
        ('"foo\tbar"', IdempotencyKeyBadCharacter),  # "tab in string"
        ('"foo\nbar"', IdempotencyKeyBadCharacter),  # "newline in string"
        ('"foo', IdempotencyKeyUnterminated),  # "unbalanced string"
        ('"foo\\,"', IdempotencyKeyBadEscape),  # "bad string quoting"
        ('"foo\\"', IdempotencyKeyUnterminated),  # "ending string quote"
        ('"foo\\', IdempotencyKeyUnterminated),  # "abruptly ending string quote"
        ('"foo";a=1', IdempotencyKeyTrailingText),  # parameters: not part of this header
        ('"foo" "bar"', IdempotencyKeyTrailingText),
        ('"foo", "bar"', IdempotencyKeyRepeated),  # a list of two strings
        ('"x' + "y" * 300 + '"', IdempotencyKeyTooLong),
    ],
)
def test_rfc_8941_string_examples(header, key_or_error):
    if isinstance(key_or_error, str):
        assert parse_idempotency_key(header) == key_or_error
    else:
        with pytest.raises(key_or_error):
            parse_idempotency_key(header)


@pytest.mark.parametrize(
    ("header", "error", "words"),
    [
        (None, IdempotencyKeyMissing, "missing"),
        ([], IdempotencyKeyMissing, "missing"),
        (["a", "b"], IdempotencyKeyRepeated, "2 such headers"),
        ([UUID, UUID], IdempotencyKeyRepeated, "2 such headers"),
        ("a,b", IdempotencyKeyRepeated, "comma-separated"),
        (f"{UUID}, {UUID}", IdempotencyKeyBadCharacter, "a space"),
        (f"{UUID},{UUID}", IdempotencyKeyRepeated, "comma-separated"),
        ("", IdempotencyKeyEmpty, "empty"),
        ("   ", IdempotencyKeyEmpty, "empty"),
        ('""', IdempotencyKeyEmpty, "empty"),
        ("x" * (MAX_KEY_LENGTH + 1), IdempotencyKeyTooLong, "256 characters"),
        ("ab cd", IdempotencyKeyBadCharacter, "character 3 of the key is a space"),
        ("ab\x00cd", IdempotencyKeyBadCharacter, "control character (U+0000)"),
        ("ab\x7fcd", IdempotencyKeyBadCharacter, "control character (U+007F)"),
        ("ab\tcd", IdempotencyKeyBadCharacter, "a tab"),
        ("caf\u00e9", IdempotencyKeyBadCharacter, "non-ASCII character (U+00E9)"),
        ("\u2603", IdempotencyKeyBadCharacter, "non-ASCII"),
        ('"abc', IdempotencyKeyUnterminated, "no closing quote"),
        ('"ab\\c"', IdempotencyKeyBadEscape, "backslash before 'c'"),
        ('"abc"x', IdempotencyKeyTrailingText, "closing quote"),
    ],
)
def test_refusals_say_what_is_wrong(header, error, words):
    with pytest.raises(error) as caught:
        parse_idempotency_key(header)
    assert words in caught.value.message
    assert caught.value.message.startswith("Idempotency-Key header: ")
    assert "send exactly one Idempotency-Key header" in caught.value.message


def test_refusals_become_invalid_argument_with_their_reason():
    with pytest.raises(IdempotencyKeyHeaderError) as missing:
        parse_idempotency_key(None)
    error = missing.value.to_error()
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == Reason.IDEMPOTENCY_KEY_MISSING
    assert error.field_violations[0].field == "Idempotency-Key"

    with pytest.raises(IdempotencyKeyHeaderError) as bad:
        parse_idempotency_key("a b")
    error = bad.value.to_error()
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == Reason.IDEMPOTENCY_KEY_INVALID
    assert error.message == bad.value.message


@given(st.text(VISIBLE, min_size=1, max_size=MAX_KEY_LENGTH))
def test_any_key_round_trips_through_the_quoted_form(key):
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    assert parse_idempotency_key(quoted) == key


@given(
    st.text(VISIBLE, min_size=1, max_size=MAX_KEY_LENGTH).filter(
        lambda k: "," not in k and not k.startswith('"')
    )
)
def test_any_key_without_comma_or_leading_quote_is_its_own_bare_form(key):
    assert parse_idempotency_key(key) == key


@given(st.text(max_size=300))
def test_any_text_is_a_key_or_a_refusal(text):
    try:
        key = parse_idempotency_key(text)
    except IdempotencyKeyHeaderError as error:
        assert error.message
    else:
        assert 1 <= len(key) <= MAX_KEY_LENGTH
        assert all("\x21" <= c <= "\x7e" for c in key)
