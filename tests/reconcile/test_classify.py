"""The comparison on hand-made facts: the kinds a restore rarely makes (a credit and a refund of one
transfer, two credits, entries that add up to nothing), what stays in flight, a shard not given, and
the money identity; and `check`'s two reads, one snapshot after the other."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from shardrouter.core.keys import new_key
from shardrouter.reconcile import check as check_module
from shardrouter.reconcile.check import Kind, classify
from shardrouter.reconcile.facts import ShardFacts, reversal_key
from shardrouter.shardd.ledger.reads import TransferEntryRow
from shardrouter.shardd.ledger.service import credit_key
from shardrouter.shardd.ledger.store import DeadLetterRow, OutboxRow, TransferRow

NOW = datetime.now(UTC)

#: A row and the shard (a or b) that holds it.
Held = tuple[str, object]


def _transfer(tid: uuid.UUID, state: str = "completed", amount: int = 10) -> Held:
    return "a", TransferRow(tid, "src", "dst", "b", amount, "EUR", "", state, NOW, NOW)


def _outbox(tid: uuid.UUID, *, delivered: bool = True, dead: bool = False) -> Held:
    return "a", OutboxRow(
        1,
        tid,
        "b",
        str(credit_key(tid)),
        b"",
        1,
        NOW,
        delivered_at=NOW if delivered else None,
        dead_lettered_at=NOW if dead else None,
    )


def _dead_letter(tid: uuid.UUID) -> Held:
    return "a", DeadLetterRow(tid, 1, "NOT_FOUND", "r", NOW, None, 0, "src", 10, "EUR")


def _leg(shard: str, tid: uuid.UUID, kind: str, amount: int, account: str, key: str = "k") -> Held:
    return shard, TransferEntryRow(new_key(), tid, kind, account, amount, "EUR", key, NOW)


def _facts(*items: Held) -> dict[str, ShardFacts]:
    facts = {"a": ShardFacts("a"), "b": ShardFacts("b")}
    for shard, row in items:
        if isinstance(row, TransferRow):
            facts[shard].transfers.append(row)
        elif isinstance(row, OutboxRow):
            facts[shard].outbox.append(row)
        elif isinstance(row, DeadLetterRow):
            facts[shard].dead_letters.append(row)
        elif isinstance(row, TransferEntryRow):
            facts[shard].legs.append(row)
    return facts


def _settled(tid: uuid.UUID) -> list[Held]:
    return [
        _transfer(tid),
        _outbox(tid),
        _leg("a", tid, "transfer_out", -10, "src"),
        _leg("b", tid, "transfer_in", 10, "dst"),
    ]


def test_settled_and_in_flight_transfers_are_no_mismatch() -> None:
    done, pending, owed = new_key(), new_key(), new_key()
    facts = _facts(
        *_settled(done),
        _transfer(pending, "pending"),
        _outbox(pending, delivered=False),
        _leg("a", pending, "transfer_out", -10, "src"),
        _transfer(owed, "pending"),
        _outbox(owed, delivered=False, dead=True),
        _dead_letter(owed),
        _leg("a", owed, "transfer_out", -10, "src"),
    )
    facts["a"].deposits["EUR"], facts["a"].balances["EUR"] = 100, (80, 2)  # 20 in flight
    report = classify(facts)
    assert report.mismatches == [] and (report.pending_credits, report.refunds_owed) == (1, 1)
    assert report.in_flight_ids == {pending, owed}
    assert report.money is not None and report.money["EUR"].in_flight == 20


def test_credit_and_refund_of_one_transfer_and_two_credits() -> None:
    both, twice = new_key(), new_key()
    facts = _facts(
        *_settled(both),
        _leg("a", both, "refund", 10, "src"),
        *_settled(twice),
        _leg("a", twice, "transfer_in", 10, "other"),  # a second credit on another shard
    )
    facts["a"].deposits["EUR"], facts["a"].balances["EUR"] = 100, (120, 2)  # 20 created
    report = classify(facts)
    found = {m.transfer_id: m for m in report.mismatches}
    assert found[both].kind is Kind.CREDITED_AND_REFUNDED and found[both].effect_minor == 10
    assert (found[both].shard, found[both].account) == ("b", "dst")  # where a reversal would write
    assert found[twice].kind is Kind.DUPLICATE_CREDIT and found[twice].effect_minor == 10
    assert report.money is not None and report.money["EUR"].mismatches == 20


def test_entries_that_add_up_to_nothing_and_a_transfer_without_debit() -> None:
    odd, bare = new_key(), new_key()
    report = classify(
        _facts(
            _transfer(odd),
            _outbox(odd),
            _leg("a", odd, "transfer_out", -10, "src"),
            _leg("b", odd, "transfer_in", 9, "dst"),
            _transfer(bare),
            _outbox(bare),
            _leg("b", bare, "transfer_in", 10, "dst"),
        ),
        with_money=False,
    )
    kinds = {m.transfer_id: (m.kind, m.effect_minor) for m in report.mismatches}
    assert kinds == {odd: (Kind.LEGS_UNBALANCED, -1), bare: (Kind.DEBIT_MISSING, 10)}


def test_a_reversed_orphan_is_settled() -> None:
    tid = new_key()
    report = classify(
        _facts(
            _leg("b", tid, "transfer_in", 10, "dst", str(credit_key(tid))),
            _leg("b", tid, "transfer_out", -10, "dst", str(reversal_key(tid))),
        ),
        with_money=False,
    )
    assert report.mismatches == []


def test_a_shard_not_given_is_not_judged_and_money_says_so() -> None:
    tid = new_key()
    facts = _facts(_transfer(tid), _outbox(tid), _leg("a", tid, "transfer_out", -10, "src"))
    del facts["b"]
    facts["a"].balances["EUR"] = (90, 1)
    facts["a"].deposits["EUR"] = 100
    report = classify(facts)
    assert [m.kind for m in report.mismatches] == [Kind.MONEY_NOT_CONSERVED]
    assert report.mismatches[0].effect_minor == -10
    assert any("were not checked" in note and "b" in note for note in report.notes)


def test_check_keeps_what_both_reads_saw_and_counts_what_only_the_second_saw_as_moving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`check` reads every shard twice: a mismatch both reads saw is reported; one only the second
    saw (a transfer moving on between the reads) is left out, its id kept as moving and its money
    counted in flight; one only the first saw has settled meanwhile."""
    stays, moves, settles = new_key(), new_key(), new_key()
    refunded = [_leg("a", stays, "refund", 10, "src")]
    first = _facts(*_settled(stays), *refunded, *_settled(settles), _leg("a", settles, "refund", 10, "src"))
    second = _facts(
        *_settled(stays),
        *refunded,
        *_settled(settles),
        *_settled(moves),
        _leg("b", moves, "transfer_in", 10, "x"),
    )
    for facts, created in ((first, 20), (second, 20)):
        facts["a"].deposits["EUR"], facts["a"].balances["EUR"] = 100, (100 + created, 2)
    reads = iter([first, second])
    monkeypatch.setattr(check_module, "read_all", lambda dsns, since=None: next(reads))
    monkeypatch.setattr(check_module, "_records_by_key", lambda dsns, ids: {})
    alone = classify(second)
    assert {m.transfer_id for m in alone.mismatches} == {stays, moves}, "the second read alone sees both"

    report = check_module.check({"a": "unused", "b": "unused"})

    assert [m.transfer_id for m in report.mismatches] == [stays]
    assert report.moving_ids == {moves}
    (moving,) = [m for m in alone.mismatches if m.transfer_id == moves]
    assert report.money is not None and alone.money is not None
    assert report.money["EUR"].mismatches == alone.money["EUR"].mismatches - moving.effect_minor
    assert report.money["EUR"].in_flight == alone.money["EUR"].in_flight - moving.effect_minor
    assert any("seen by one read only" in note for note in report.notes)
    assert next(reads, None) is None, "exactly two reads"
