"""Answers built in the database: protobuf's wire format as SQL expressions, and the setting that
hands a statement's answer to the record stored beside it.

A guarded call whose claim travels with its handler (`idempotency.store.ClaimAhead`) can be one
round trip: the claim, the handler's statement, the stored record and the COMMIT in one pipeline.
That needs the answer before the handler's statement has returned anything to Python, so a handler
whose answer is a function of its statement's result (a Deposit's: the entry it wrote and the balance
after it) builds the serialised response in that statement and notes it (`noting_answer`); the
record's insert, sent after it in the same transaction, stores what was noted (`NOTED_ANSWER`). The
account's row lock is then held for the database's own work and the commit, not across a round trip
through the daemon.

Only what such answers need is here: a varint, an int64 field, a length-delimited field. Constant
parts are serialised by protobuf itself in Python and passed as parameters; the fields of one message
are concatenated in field-number order, as protobuf's serialiser writes them, so the bytes are the
ones `SerializeToString` gives (tests/shardd/test_answer_sql.py compares them over many values).
"""

from __future__ import annotations

#: The transaction-local setting carrying a noted answer, hex-encoded, to the record's insert.
ANSWER_SETTING = "shardrouter.answer"

#: The answer noted in this transaction, as bytea; NULL when none was (the setting is unset in the
#: session, or empty: a transaction-local value is gone after its transaction).
NOTED_ANSWER = f"decode(nullif(current_setting('{ANSWER_SETTING}', true), ''), 'hex')"

_WIRE_VARINT, _WIRE_LENGTH_DELIMITED = 0, 2


def noting_answer(answer: str) -> str:
    """A select-list expression that notes `answer` (a bytea expression) as this transaction's
    answer; it returns the hex text noted."""
    return f"set_config('{ANSWER_SETTING}', encode(({answer}), 'hex'), true)"


def varint(value: str) -> str:
    """The varint of `value`, a bigint expression: seven bits a byte, lowest first, the high bit set
    on every byte but the last; a negative value is its two's complement, ten bytes (as protobuf
    writes an int64). The shifts are arithmetic, so the tenth byte keeps bit 63 alone; the value is
    made a bigint first, as an integer's shifts wrap at 32."""
    value = f"({value})::bigint"
    return (
        "(SELECT string_agg(set_byte('\\x00'::bytea, 0,"
        f" ((({value}) >> (7 * i)) & CASE WHEN i = 9 THEN 1 ELSE 127 END)::integer"
        f" | CASE WHEN i < 9 AND (({value}) >> (7 * (i + 1))) <> 0 THEN 128 ELSE 0 END), '' ORDER BY i)"
        f" FROM generate_series(0, 9) AS i WHERE i = 0 OR (({value}) >> (7 * i)) <> 0)"
    )


def _tag(number: int, wire_type: int) -> str:
    """A field's tag as a bytea literal (a constant: field numbers are known here)."""
    tag = (number << 3) | wire_type
    encoded = bytearray()
    while tag >= 0x80:
        encoded.append((tag & 0x7F) | 0x80)
        tag >>= 7
    encoded.append(tag)
    return f"'\\x{encoded.hex()}'::bytea"


def int64_field(number: int, value: str) -> str:
    """Field `number` of type int64 holding `value` (a bigint expression); nothing when it is 0, as
    proto3 leaves a scalar at its default out."""
    return (
        f"(CASE WHEN ({value}) = 0 THEN ''::bytea ELSE {_tag(number, _WIRE_VARINT)} || {varint(value)} END)"
    )


def message_field(number: int, payload: str) -> str:
    """Field `number` holding a set message whose serialisation is `payload` (a bytea expression);
    written even when empty, as protobuf writes a set message field."""
    return f"({_tag(number, _WIRE_LENGTH_DELIMITED)} || {varint(f'length({payload})')} || ({payload}))"


__all__ = ["ANSWER_SETTING", "NOTED_ANSWER", "int64_field", "message_field", "noting_answer", "varint"]
