"""The proofs: from a history file and the shard databases, that every operation has one definite
answer (or is pending), every replay repeats the first answer byte for byte, nothing acknowledged is
missing, nothing is applied twice, each cross-shard transfer is credited or refunded exactly once,
every balance is its ledger and what the answers imply, and money is conserved.

How the ledger records each operation (`shardd.ledger.service`): a deposit is one `deposit` entry
under the caller's key; a transfer is a `transfer_out` under the caller's key on the source, and a
`transfer_in` either under the same key (same shard) or, on the destination's shard, under the
credit's key derived from the transfer id; a credit the destination refuses for good is refunded by a
`refund` entry on the source, under the refund's key. So the caller's key finds the debit, and the
transfer id the debit names finds its credit or its refund, wherever they are.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from shardrouter.check.history import Attempt, History, Operation
from shardrouter.check.ledgers import EntryRow, Ledgers, read_ledgers
from shardrouter.core.errors import Reason
from shardrouter.v1 import transfer_pb2


class Kind(StrEnum):
    """What a violation is."""

    #: A definite answer of the key differs from its first one (a replay that is not byte-identical).
    ANSWER_CHANGED = "answer_changed"
    #: The key, sent again with another request, was answered OK.
    REUSED_KEY_ACCEPTED = "reused_key_accepted"
    #: Acknowledged (OK), and no shard holds its ledger entry.
    ACKNOWLEDGED_MISSING = "acknowledged_missing"
    #: More than one ledger entry of the key.
    APPLIED_TWICE = "applied_twice"
    #: Refused with a definite answer, yet in the ledger.
    REFUSED_BUT_APPLIED = "refused_but_applied"
    #: The ledger's entry is not what the answer said (its id, transfer or amount).
    ANSWER_NOT_LEDGER = "answer_not_ledger"
    #: A cross-shard transfer neither credited nor refunded, and no longer in flight.
    CREDIT_LOST = "credit_lost"
    #: A transfer credited twice, refunded twice, or credited and refunded.
    SETTLED_TWICE = "settled_twice"
    #: An entry on a checked account that no operation of the run explains.
    ENTRY_WITHOUT_OPERATION = "entry_without_operation"
    #: An account whose balance is not the sum of its ledger.
    BALANCE_NOT_LEDGER = "balance_not_ledger"
    #: An account whose balance is not what the answers (and the settled credits) imply.
    BALANCE_NOT_ANSWERS = "balance_not_answers"
    #: Deposits acknowledged (and applied unanswered) differ from balances plus money in flight.
    MONEY_NOT_CONSERVED = "money_not_conserved"


@dataclass(frozen=True)
class Violation:
    """One violation: its kind, the key (or account) it names, and what was seen."""

    kind: Kind
    key: str
    detail: str
    account: str = ""

    @property
    def identity(self) -> tuple[str, str, str]:
        """What makes two reads' violations the same one."""
        return self.kind.value, self.key, self.account


@dataclass
class Verdict:
    """What the proofs found, with the run's figures."""

    figures: dict[str, int] = field(default_factory=dict)
    money: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No violation."""
        return not self.violations


@dataclass(frozen=True)
class KeyAnswers:
    """A key's answers, in the order they came back."""

    first: Attempt | None
    definite: list[Attempt]
    reused: list[Attempt]

    @property
    def state(self) -> str:
        """acknowledged, refused, or pending (no definite answer)."""
        if self.first is None:
            return "pending"
        return "acknowledged" if self.first.code == "OK" else "refused"


def answers_of(attempts: list[Attempt]) -> KeyAnswers:
    """Split a key's attempts into its own request's definite answers and the reused-body ones."""
    own = [a for a in attempts if a.role != "reused_body" and a.definite]
    return KeyAnswers(own[0] if own else None, own, [a for a in attempts if a.role == "reused_body"])


def _answer_violations(key: str, answers: KeyAnswers) -> list[Violation]:
    found: list[Violation] = []
    if answers.first is not None:
        first = answers.first
        for later in answers.definite[1:]:
            if later.answer() != first.answer():
                what = [
                    n
                    for n, a, b in zip(
                        ("code", "reason", "message", "response bytes"),
                        first.answer(),
                        later.answer(),
                        strict=True,
                    )
                    if a != b
                ]
                found.append(
                    Violation(
                        Kind.ANSWER_CHANGED,
                        key,
                        f"the {later.role} answer at {later.ended_at:.3f} differs from the first "
                        f"({first.code} at {first.ended_at:.3f}) in its {', '.join(what)}",
                    )
                )
    for reused in answers.reused:
        if reused.code == "OK":
            found.append(
                Violation(Kind.REUSED_KEY_ACCEPTED, key, "sent again with another request, answered OK")
            )
    return found


@dataclass
class _Tally:
    """Money seen while checking keys (minor units)."""

    acknowledged_deposits: int = 0
    unanswered_deposits: int = 0
    in_flight: int = 0
    #: account -> what the answers and the settled credits say its balance is.
    implied: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    counts: Counter[str] = field(default_factory=Counter)


M = TypeVar("M", bound=Message)


def _decoded(response: bytes, into: M) -> M:
    """A response as recorded: the message's bytes (gRPC), or the HTTP front's JSON of it."""
    if response.startswith(b"{"):  # a serialized message never starts so (field 15, a group)
        json_format.Parse(response, into, ignore_unknown_fields=True)
    else:
        into.ParseFromString(response)
    return into


def _count_entries(key: str, state: str, entries: list[EntryRow], what: str) -> list[Violation]:
    if len(entries) > 1:
        where = ", ".join(f"{e.shard}:{e.id}" for e in entries)
        return [
            Violation(
                Kind.APPLIED_TWICE, key, f"{len(entries)} {what} entries: {where}", entries[0].account_id
            )
        ]
    if state == "acknowledged" and not entries:
        return [
            Violation(Kind.ACKNOWLEDGED_MISSING, key, f"answered OK, and no shard holds its {what} entry")
        ]
    if state == "refused" and entries:
        return [
            Violation(
                Kind.REFUSED_BUT_APPLIED, key, f"refused, yet {entries[0].shard} holds its {what} entry"
            )
        ]
    return []


def _check_deposit(
    op: Operation, answers: KeyAnswers, entries: list[EntryRow], tally: _Tally
) -> list[Violation]:
    mine = [e for e in entries if e.kind == "deposit"]
    found = _count_entries(op.key, answers.state, mine, "deposit")
    if answers.state == "acknowledged" and answers.first is not None:
        tally.acknowledged_deposits += op.amount_minor
        tally.implied[op.account] += op.amount_minor
        said = _decoded(answers.first.response, transfer_pb2.DepositResponse())
        if len(mine) == 1 and (str(mine[0].id) != said.entry_id or mine[0].amount_minor != op.amount_minor):
            found.append(
                Violation(
                    Kind.ANSWER_NOT_LEDGER,
                    op.key,
                    f"answered entry {said.entry_id} of {op.amount_minor}; the ledger holds {mine[0].id} of {mine[0].amount_minor}",
                )
            )
    elif answers.state == "pending" and mine:
        tally.unanswered_deposits += mine[0].amount_minor
        tally.implied[op.account] += mine[0].amount_minor
    return found


def _check_transfer(
    op: Operation,
    answers: KeyAnswers,
    entries: list[EntryRow],
    ledgers: Ledgers,
    by_transfer: Mapping[uuid.UUID, list[EntryRow]],
    tally: _Tally,
) -> list[Violation]:
    debits = [e for e in entries if e.kind == "transfer_out"]
    found = _count_entries(op.key, answers.state, debits, "debit")
    if not debits or debits[0].transfer_id is None:
        return found
    transfer_id = debits[0].transfer_id
    if answers.state == "acknowledged" and answers.first is not None:
        said = _decoded(answers.first.response, transfer_pb2.TransferResponse()).transfer
        if said.transfer_id != str(transfer_id) or debits[0].amount_minor != -op.amount_minor:
            found.append(
                Violation(
                    Kind.ANSWER_NOT_LEDGER,
                    op.key,
                    f"answered transfer {said.transfer_id} of {op.amount_minor}; the ledger's debit is of "
                    f"transfer {transfer_id}, {debits[0].amount_minor}",
                )
            )
    tally.implied[op.account] -= op.amount_minor
    legs = [e for e in by_transfer.get(transfer_id, []) if e.kind in ("transfer_in", "refund")]
    for leg in legs:
        tally.implied[leg.account_id] += leg.amount_minor
        if leg.kind == "refund":
            tally.counts["refunded"] += 1
        else:  # a same-shard credit is written under the caller's key, a cross-shard one under its own
            tally.counts["credited_same_shard" if leg.idempotency_key == op.key else "credited"] += 1
    if len(legs) > 1:
        where = ", ".join(f"{e.kind} on {e.shard}" for e in legs)
        found.append(
            Violation(Kind.SETTLED_TWICE, op.key, f"transfer {transfer_id}: {where}", op.destination)
        )
    elif not legs:
        states = {row.state for _, row in ledgers.transfers.get(transfer_id, [])}
        if "pending" in states:
            tally.in_flight += op.amount_minor
            tally.counts["in_flight"] += 1
        else:
            found.append(
                Violation(
                    Kind.CREDIT_LOST,
                    op.key,
                    f"transfer {transfer_id} ({', '.join(sorted(states)) or 'no transfer row'}) to {op.destination}: "
                    "debited, and neither credited nor refunded on any shard",
                    op.destination,
                )
            )
    return found


def _entry_violations(history: History, ledgers: Ledgers, transfers: set[uuid.UUID]) -> list[Violation]:
    found = []
    for e in ledgers.entries:
        ours = e.idempotency_key in history.operations
        follow_up = e.transfer_id in transfers and e.kind in ("transfer_in", "refund")
        if not (ours or follow_up):
            found.append(
                Violation(
                    Kind.ENTRY_WITHOUT_OPERATION,
                    e.idempotency_key,
                    f"{e.kind} entry {e.id} of {e.amount_minor} on {e.shard} under a key no operation of the run sent",
                    e.account_id,
                )
            )
    return found


def _balance_violations(history: History, ledgers: Ledgers, tally: _Tally) -> list[Violation]:
    found = [
        Violation(
            Kind.BALANCE_NOT_LEDGER,
            "",
            f"{shard}: balance {row.balance}, ledger {row.ledger} ({row.balance - row.ledger:+})",
            row.account_id,
        )
        for shard, row in ledgers.off_ledger
    ]
    for account in sorted(history.accounts):
        balance, implied = ledgers.balance(account), tally.implied.get(account, 0)
        if balance != implied:
            keys = sorted({e.idempotency_key for e in ledgers.entries if e.account_id == account})
            found.append(
                Violation(
                    Kind.BALANCE_NOT_ANSWERS,
                    "",
                    f"balance {balance}, the answers and settled credits imply {implied} ({balance - implied:+}); "
                    f"{len(keys)} keys touch it",
                    account,
                )
            )
    return found


def evaluate(history: History, ledgers: Ledgers) -> Verdict:
    """The proofs over one read of the databases."""
    by_key: dict[str, list[EntryRow]] = defaultdict(list)
    by_transfer: dict[uuid.UUID, list[EntryRow]] = defaultdict(list)
    for e in ledgers.entries:
        by_key[e.idempotency_key].append(e)
        if e.transfer_id is not None:
            by_transfer[e.transfer_id].append(e)
    verdict, tally = Verdict(), _Tally()
    for key, op in history.operations.items():
        answers = answers_of(history.attempts.get(key, []))
        tally.counts[answers.state] += 1
        verdict.violations += _answer_violations(key, answers)
        if answers.state == "pending":
            verdict.pending.append(key)
        if op.kind == "deposit":
            verdict.violations += _check_deposit(op, answers, by_key.get(key, []), tally)
        else:
            before = tally.in_flight
            verdict.violations += _check_transfer(
                op, answers, by_key.get(key, []), ledgers, by_transfer, tally
            )
            if tally.in_flight != before:
                verdict.in_flight.append(key)
    ours = {e.transfer_id for k in history.operations for e in by_key.get(k, []) if e.kind == "transfer_out"}
    verdict.violations += _entry_violations(history, ledgers, {t for t in ours if t is not None})
    verdict.violations += _balance_violations(history, ledgers, tally)
    balances = sum(ledgers.balance(a) for a in history.accounts)
    verdict.money = {
        "acknowledged_deposits": tally.acknowledged_deposits,
        "unanswered_deposits_applied": tally.unanswered_deposits,
        "balances": balances,
        "in_flight": tally.in_flight,
    }
    if tally.acknowledged_deposits + tally.unanswered_deposits != balances + tally.in_flight:
        gap = balances + tally.in_flight - tally.acknowledged_deposits - tally.unanswered_deposits
        verdict.violations.append(
            Violation(Kind.MONEY_NOT_CONSERVED, "", f"balances + in flight exceed the deposits by {gap:+}")
        )
    verdict.figures = _figures(history, tally)
    return verdict


def _figures(history: History, tally: _Tally) -> dict[str, int]:
    attempts = [a for key_attempts in history.attempts.values() for a in key_attempts]
    roles = Counter(a.role for a in attempts)
    labels = Counter(op.label for op in history.operations.values())
    return {
        "operations": len(history.operations),
        "attempts": len(attempts),
        "acknowledged": tally.counts["acknowledged"],
        "refused": tally.counts["refused"],
        "pending": tally.counts["pending"],
        "in_flight_duplicates": roles["in_flight_duplicate"],
        "later_duplicates": roles["later_duplicate"],
        "resends": roles["retry"],
        "reused_bodies": len({a.key for a in attempts if a.role == "reused_body"}),
        "reused_refused": len({a.key for a in attempts if a.reason == Reason.IDEMPOTENCY_KEY_REUSED}),
        "replays": sum(1 for a in attempts if a.replayed),
        "expired_keys": labels["expired_key"],
        "expired_refused": sum(
            1
            for key, op in history.operations.items()
            if op.label == "expired_key"
            and (first := answers_of(history.attempts.get(key, [])).first) is not None
            and first.reason == Reason.IDEMPOTENCY_KEY_EXPIRED
        ),
        "deposits": sum(1 for op in history.operations.values() if op.kind == "deposit"),
        "same_shard": labels["same_shard"],
        "cross_shard": labels["cross_shard"],
        "to_unopened": labels["to_unopened"],
        "credited": tally.counts["credited"],
        "credited_same_shard": tally.counts["credited_same_shard"],
        "refunded": tally.counts["refunded"],
        "in_flight_transfers": tally.counts["in_flight"],
    }


def prove(
    history: History, dsns: Mapping[str, str], *, settle_s: float = 30.0, poll_s: float = 0.5
) -> Verdict:
    """Read the databases until no transfer of the run is in flight (up to `settle_s`) and prove.

    The shards are read one after another, so a credit landing between two reads could look lost or
    doubled: a violation is reported only if a second read, a moment later, shows it too, and the
    figures and money are then the second read's (the first one's may count such a passing gap)."""
    give_up = time.monotonic() + settle_s
    while True:
        verdict = evaluate(history, read_ledgers(dsns, history.accounts))
        if not verdict.in_flight or time.monotonic() >= give_up:
            break
        time.sleep(poll_s)
    if verdict.violations:
        time.sleep(poll_s)
        first = {v.identity for v in verdict.violations}
        verdict = evaluate(history, read_ledgers(dsns, history.accounts))
        verdict.violations = [v for v in verdict.violations if v.identity in first]
    return verdict


__all__ = ["KeyAnswers", "Kind", "Verdict", "Violation", "answers_of", "evaluate", "prove"]
