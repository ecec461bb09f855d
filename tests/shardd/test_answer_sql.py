"""Protobuf's wire format written as SQL (`shardd.answer_sql`) gives protobuf's own bytes.

A Deposit's answer is built by its statement and stored as the key's record, so every replay returns
what PostgreSQL wrote: the bytes must be those the generated code's `SerializeToString` gives, for
every value a balance can take and every edge of a varint.
"""

from __future__ import annotations

import psycopg

from shardrouter.shardd import answer_sql
from shardrouter.shardd.ledger.store import deposit_answer, deposit_answer_parts
from shardrouter.v1 import transfer_pb2

#: Each varint length's edges, zero, the extremes, and negatives (ten bytes, two's complement).
EDGES = sorted(
    {0, 1, -1, 2**63 - 1, -(2**63), 10**15, -(10**15), 300, -300}
    | {sign * ((1 << (7 * n)) + d) for n in range(1, 10) for d in (-1, 0, 1) for sign in (1, -1)}
)


def _bigints(values: list[int]) -> list[int]:
    return [v for v in values if -(2**63) <= v < 2**63]


def test_the_varint_of_a_bigint_is_protobufs(db: psycopg.Connection[tuple[object, ...]]) -> None:
    values = _bigints(EDGES)
    rows = db.execute(
        f"SELECT v, {answer_sql.int64_field(1, 'v')} FROM unnest(%s::bigint[]) AS v", (values,)
    ).fetchall()
    assert len(rows) == len(values)
    for value, encoded in rows:
        assert isinstance(value, int)
        assert bytes(encoded) == transfer_pb2.Money(amount_minor=value).SerializeToString(), value


def test_a_deposits_answer_built_in_the_database_is_the_generated_codes(
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    """Balances at every edge, with entry ids and currencies of several lengths (one past 127 bytes,
    so a length takes two bytes): the statement's bytes, the noted copy, and protobuf's agree."""
    cases = [
        (entry, currency, balance)
        for entry in ("0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b", "e", "x" * 200)
        for currency in ("EUR", "", "Q" * 130)
        for balance in _bigints(EDGES)
    ]
    sql = deposit_answer("b")
    with db.transaction():
        for entry, currency, balance in cases:
            built, noted = db.execute(
                f"SELECT {sql}, {answer_sql.noting_answer(sql)} FROM (SELECT %(balance)s::bigint AS b) AS r",
                {**deposit_answer_parts(entry, currency), "balance": balance},
            ).fetchone() or (None, None)
            expected = transfer_pb2.DepositResponse(
                entry_id=entry, balance=transfer_pb2.Money(amount_minor=balance, currency=currency)
            ).SerializeToString()
            assert bytes(built) == expected, (entry, currency, balance)
            row = db.execute(f"SELECT {answer_sql.NOTED_ANSWER}").fetchone()
            assert row is not None and bytes(row[0]) == expected and noted == expected.hex()


def test_no_answer_is_noted_outside_the_transaction_that_noted_it(
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    assert db.execute(f"SELECT {answer_sql.NOTED_ANSWER}").fetchone() == (None,)
    two_bytes = r"'\x0102'::bytea"
    with db.transaction():
        db.execute(f"SELECT {answer_sql.noting_answer(two_bytes)}")
        assert db.execute(f"SELECT {answer_sql.NOTED_ANSWER}").fetchone() == (b"\x01\x02",)
    assert db.execute(f"SELECT {answer_sql.NOTED_ANSWER}").fetchone() == (None,)
