"""The comparison: every transfer's story as all shards tell it, and every account's balance.

A transfer's facts are spread over shards: its row, its debit (`transfer_out`), its outbox row, its
dead letter and its refund on the source account's shard; its credit (`transfer_in`, written under
the credit's key `credit_key(transfer_id)`) on the destination account's shard. Each transfer is
classified from all of them together:

- settled: debit and credit, or debit and refund (net zero);
- in flight: debited, its credit queued and not yet delivered, or dead-lettered and its refund not
  yet confirmed (the relay finishes these on its own);
- a mismatch (`Kind`), with the money it created (+) or lost (-).

Every account's balance is compared with the sum of its ledger, and money is added up per currency:
balances = deposits - in flight + what the mismatches created or lost (+ balances off their ledger).

The shards are read one after another, so a credit delivered between two reads could look missing
(or a debit made after its shard was read, with its credit seen later, could look absent): `check`
reads everything twice and reports only the mismatches both reads show.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from shardrouter.reconcile.facts import (
    KeyRecord,
    OnShard,
    ShardFacts,
    connect,
    follow_up_records,
    is_reversal,
    read_all,
)
from shardrouter.shardd.ledger.reads import TransferEntryRow
from shardrouter.shardd.ledger.service import credit_key, refund_key
from shardrouter.shardd.ledger.store import DeadLetterRow, OutboxRow, TransferRow


class Kind(StrEnum):
    """What kind of mismatch."""

    #: The source's outbox says the credit was delivered; no shard holds it (the destination was
    #: restored to before it, or lost it). Repair: re-queue it with its original key.
    CREDIT_MISSING = "credit_missing"
    #: The source debited a transfer whose credit is neither queued nor applied anywhere. Repair:
    #: queue it with its original key.
    CREDIT_NOT_QUEUED = "credit_not_queued"
    #: The source says the transfer was refunded (dead letter or state), but no refund entry exists.
    #: Repair: hand it back to the dead-letter refund path (RefundTransfer under its refund key).
    REFUND_MISSING = "refund_missing"
    #: A shard holds a cross-shard credit whose transfer and debit no shard holds (the source was
    #: restored to before the transfer): money created. Not repaired by default.
    CREDIT_WITHOUT_DEBIT = "credit_without_debit"
    #: Both the credit and the refund of one transfer were applied: money created.
    CREDITED_AND_REFUNDED = "credited_and_refunded"
    #: More than one shard holds a credit of one transfer: money created.
    DUPLICATE_CREDIT = "duplicate_credit"
    #: A transfer row without its debit entry.
    DEBIT_MISSING = "debit_missing"
    #: A transfer's entries add up to something no story explains (amounts that differ, ...).
    LEGS_UNBALANCED = "legs_unbalanced"
    #: An account's balance is not the sum of its ledger.
    BALANCE_NOT_LEDGER = "balance_not_ledger"
    #: Money does not add up beyond what the other mismatches explain.
    MONEY_NOT_CONSERVED = "money_not_conserved"


#: The repair `--repair` applies to each kind (the others are reported with what a person can do).
REPAIRS: Mapping[Kind, str] = {
    Kind.CREDIT_MISSING: "requeue",
    Kind.CREDIT_NOT_QUEUED: "queue",
    Kind.REFUND_MISSING: "refund",
}
#: The kinds `--reverse-orphan-credits` repairs, by reversing the credit on its shard.
REVERSIBLE = frozenset({Kind.CREDIT_WITHOUT_DEBIT, Kind.CREDITED_AND_REFUNDED})

_ACTIONS: Mapping[Kind, str] = {
    Kind.CREDIT_MISSING: (
        "run `shard-router reconcile --repair`: the credit is re-queued on the source's outbox with its "
        "original key, and the relay delivers it once (a destination that still holds the key replays it)"
    ),
    Kind.CREDIT_NOT_QUEUED: (
        "run `shard-router reconcile --repair`: the credit is queued again on the source's outbox with "
        "its original key, and the relay delivers it once (or dead-letters and refunds it)"
    ),
    Kind.REFUND_MISSING: (
        "run `shard-router reconcile --repair`: the dead letter is handed back to the refund path, and "
        "the relay sends RefundTransfer under its refund key (applied once)"
    ),
    Kind.CREDIT_WITHOUT_DEBIT: (
        "money was created: either re-create the debit on the source (find the Transfer's caller and "
        "key in the caller's own records; its retry with the same key debits and credits again, so "
        "reverse this credit first) or reverse the credit: `shard-router reconcile --repair "
        "--reverse-orphan-credits` (refused if the account no longer holds the amount)"
    ),
    Kind.CREDITED_AND_REFUNDED: (
        "money was created: the source told its caller the transfer was refunded, so reverse the "
        "credit: `shard-router reconcile --repair --reverse-orphan-credits`"
    ),
    Kind.DUPLICATE_CREDIT: (
        "money was created: find how the second credit came about (a move left rows behind?) and "
        "take one back by hand, with a ledger entry; nothing is repaired automatically"
    ),
    Kind.DEBIT_MISSING: (
        "the transfer row has no debit entry: compare with the caller's records and the database's "
        "history; nothing is repaired automatically"
    ),
    Kind.LEGS_UNBALANCED: "inspect the transfer's entries on every shard; nothing is repaired automatically",
    Kind.BALANCE_NOT_LEDGER: (
        "the balance differs from the sum of the account's ledger: inspect the account's entries; "
        "reconcile never writes a balance without an entry"
    ),
    Kind.MONEY_NOT_CONSERVED: (
        "money does not add up and no transfer explains it: look for entries without a transfer, or "
        "a shard that is missing from the databases given"
    ),
}


@dataclass(frozen=True)
class Mismatch:
    """One mismatch: its kind, where, how much, and what to do."""

    kind: Kind
    detail: str
    transfer_id: uuid.UUID | None = None
    source_shard: str | None = None
    destination_shard: str | None = None
    source_account: str | None = None
    destination_account: str | None = None
    #: The account of a balance mismatch, or the account a repair writes to.
    shard: str | None = None
    account: str | None = None
    amount_minor: int = 0
    currency: str = ""
    outbox_id: int | None = None
    #: The key of the credit (or of the refund, for REFUND_MISSING) the repair uses.
    key: str | None = None
    #: Money this mismatch created (+) or lost (-), in minor units of `currency`.
    effect_minor: int = 0
    #: Why `--repair` would not repair it although its kind is repairable ("" if it would).
    blocked: str = ""

    @property
    def identity(self) -> tuple[str, str]:
        """What makes two reads' mismatches the same one."""
        return self.kind.value, str(self.transfer_id) if self.transfer_id else f"{self.shard}/{self.account}"

    @property
    def repair(self) -> str | None:
        """The repair `--repair` applies (None: none, or `blocked`)."""
        return None if self.blocked else REPAIRS.get(self.kind)

    @property
    def action(self) -> str:
        """What to do, in words."""
        action = _ACTIONS[self.kind]
        return f"not repairable automatically: {self.blocked}; {action}" if self.blocked else action

    def as_json(self) -> dict[str, object]:
        """The mismatch for `--json`."""
        return {
            "kind": self.kind.value,
            "transfer_id": str(self.transfer_id) if self.transfer_id else None,
            "source_shard": self.source_shard,
            "destination_shard": self.destination_shard,
            "source_account": self.source_account,
            "destination_account": self.destination_account,
            "shard": self.shard,
            "account": self.account,
            "amount_minor": self.amount_minor,
            "currency": self.currency,
            "outbox_id": self.outbox_id,
            "key": self.key,
            "effect_minor": self.effect_minor,
            "repair": self.repair,
            "blocked": self.blocked or None,
            "detail": self.detail,
            "action": self.action,
        }


@dataclass
class Money:
    """One currency's totals across shards (minor units)."""

    balances: int = 0
    accounts: int = 0
    deposits: int = 0
    in_flight: int = 0
    #: What the transfer mismatches created (+) or lost (-).
    mismatches: int = 0
    #: Balances minus ledgers of the accounts whose balance is off.
    off_ledger: int = 0

    @property
    def unexplained(self) -> int:
        """balances - (deposits - in flight + mismatches + off ledger): 0 when it all adds up."""
        return self.balances - (self.deposits - self.in_flight + self.mismatches + self.off_ledger)

    def as_json(self) -> dict[str, int]:
        """The totals for `--json`."""
        return {
            "balances": self.balances,
            "accounts": self.accounts,
            "deposits": self.deposits,
            "in_flight": self.in_flight,
            "created_or_lost_by_mismatches": self.mismatches,
            "off_ledger": self.off_ledger,
            "unexplained": self.unexplained,
        }


@dataclass
class Report:
    """The outcome of one comparison."""

    shards: list[str]
    mismatches: list[Mismatch] = field(default_factory=list)
    transfers: int = 0
    #: Credits queued and not delivered yet: count and the oldest's age (s).
    pending_credits: int = 0
    oldest_pending_s: float = 0.0
    #: Dead letters whose refund the relay has not confirmed yet.
    refunds_owed: int = 0
    #: None with `--since` (the totals need every transfer).
    money: dict[str, Money] | None = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Repairs done by this run (with `--repair`), in words.
    repairs: list[str] = field(default_factory=list)
    #: The transfers in flight (their credit pending, or their refund owed).
    in_flight_ids: set[uuid.UUID] = field(default_factory=set)
    #: The transfers a mismatch was seen for by one read only (moving on meanwhile: a credit
    #: delivered between the reads of its two shards), counted as in flight.
    moving_ids: set[uuid.UUID] = field(default_factory=set)

    @property
    def consistent(self) -> bool:
        """No mismatch."""
        return not self.mismatches

    def as_json(self) -> dict[str, object]:
        """The report for `--json`."""
        return {
            "consistent": self.consistent,
            "shards": self.shards,
            "transfers_checked": self.transfers,
            "mismatches": [m.as_json() for m in self.mismatches],
            "in_flight": {
                "pending_credits": self.pending_credits,
                "oldest_pending_s": round(self.oldest_pending_s, 1),
                "refunds_owed": self.refunds_owed,
            },
            "money": None if self.money is None else {c: m.as_json() for c, m in sorted(self.money.items())},
            "notes": self.notes,
            "repairs": self.repairs,
        }


@dataclass
class _Story:
    """Everything the shards hold of one transfer, each row with the shard that holds it."""

    transfers: list[OnShard[TransferRow]] = field(default_factory=list)
    outbox: list[OnShard[OutboxRow]] = field(default_factory=list)
    dead_letters: list[OnShard[DeadLetterRow]] = field(default_factory=list)
    legs: list[OnShard[TransferEntryRow]] = field(default_factory=list)

    def of(self, kind: str) -> list[OnShard[TransferEntryRow]]:
        return [leg for leg in self.legs if leg.row.kind == kind and not is_reversal(leg.row)]

    @property
    def reversals(self) -> list[OnShard[TransferEntryRow]]:
        return [leg for leg in self.legs if is_reversal(leg.row)]

    @property
    def transfer(self) -> OnShard[TransferRow] | None:
        return self.transfers[0] if self.transfers else None

    @property
    def outbox_row(self) -> OnShard[OutboxRow] | None:
        return self.outbox[0] if self.outbox else None

    @property
    def dead_letter(self) -> OnShard[DeadLetterRow] | None:
        return self.dead_letters[0] if self.dead_letters else None

    @property
    def net(self) -> int:
        """What the transfer's entries add up to, on every shard."""
        return sum(leg.row.amount_minor for leg in self.legs)

    def first_leg(self) -> OnShard[TransferEntryRow] | None:
        """A credit, else a debit, else a refund, else a reversal."""
        kinds = (self.of("transfer_in"), self.of("transfer_out"), self.of("refund"), self.reversals)
        return next((legs[0] for legs in kinds if legs), None)

    def amount(self) -> tuple[int, str]:
        """The transfer's amount and currency: its row's, else its first leg's (one of them is held)."""
        if self.transfer is not None:
            return self.transfer.row.amount_minor, self.transfer.row.currency
        leg = self.first_leg()
        assert leg is not None
        return abs(leg.row.amount_minor), leg.row.currency


def transfer_time(transfer_id: uuid.UUID) -> datetime | None:
    """When a transfer was made, from its UUIDv7 id (None if the id is no UUIDv7)."""
    if transfer_id.version != 7:
        return None
    return datetime.fromtimestamp((transfer_id.int >> 80) / 1000, tz=UTC)


def classify(facts: Mapping[str, ShardFacts], *, with_money: bool = True) -> Report:
    """Compare one read of every shard."""
    report = Report(shards=sorted(facts))
    stories = _stories(facts)
    report.transfers = len(stories)
    money: dict[str, Money] = defaultdict(Money)
    unknown = _judge_all(report, money, stories, facts)
    for f in facts.values():
        _add_shard(report, money, f)
    if unknown:
        report.notes.append(
            "transfers to shard(s) " + ", ".join(sorted(unknown)) + " were not checked: give every "
            "shard's database (--databases or --dsn)"
        )
    report.money = _add_up(report, money) if with_money else None
    return report


def _stories(facts: Mapping[str, ShardFacts]) -> dict[uuid.UUID, _Story]:
    """Every transfer's rows, gathered from all shards."""
    stories: dict[uuid.UUID, _Story] = defaultdict(_Story)
    for f in facts.values():
        for t in f.transfers:
            stories[t.id].transfers.append(OnShard(f.shard, t))
        for o in f.outbox:
            stories[o.transfer_id].outbox.append(OnShard(f.shard, o))
        for d in f.dead_letters:
            stories[d.transfer_id].dead_letters.append(OnShard(f.shard, d))
        for leg in f.legs:
            stories[leg.transfer_id].legs.append(OnShard(f.shard, leg))
    return stories


def _judge_all(
    report: Report,
    money: dict[str, Money],
    stories: Mapping[uuid.UUID, _Story],
    facts: Mapping[str, ShardFacts],
) -> set[str]:
    """Judge every transfer into `report` and `money`; the shards named by transfers that were not
    judged because their credit may be on one of them, not given."""
    now = datetime.now(UTC)
    unknown: set[str] = set()
    for transfer_id, story in sorted(stories.items()):
        named = {o.row.destination_shard_id for o in story.outbox} | {
            t.row.destination_shard_id for t in story.transfers
        }
        missing = {s for s in named if s not in facts}
        if missing and not story.of("transfer_in"):
            unknown |= missing  # its credit may be on a shard not given: not judged
            continue
        verdict = _judge(transfer_id, story)
        if isinstance(verdict, Mismatch):
            report.mismatches.append(verdict)
            money[verdict.currency].mismatches += verdict.effect_minor
        elif verdict is not None:
            _count_in_flight(report, money, transfer_id, verdict, now)
    return unknown


def _count_in_flight(
    report: Report, money: dict[str, Money], transfer_id: uuid.UUID, verdict: _InFlight, now: datetime
) -> None:
    state, amount, currency, since = verdict
    report.in_flight_ids.add(transfer_id)
    money[currency].in_flight += amount
    if state == "pending":
        report.pending_credits += 1
        report.oldest_pending_s = max(report.oldest_pending_s, (now - since).total_seconds())
    else:
        report.refunds_owed += 1


def _add_shard(report: Report, money: dict[str, Money], f: ShardFacts) -> None:
    """One shard's accounts off their ledger, balances, deposits and unfinished moves."""
    for u in f.unbalanced:
        report.mismatches.append(
            Mismatch(
                Kind.BALANCE_NOT_LEDGER,
                f"account {u.account_id} on {f.shard} holds {u.balance} but its ledger adds up to "
                f"{u.ledger} {u.currency} (off by {u.balance - u.ledger:+d})",
                shard=f.shard,
                account=u.account_id,
                amount_minor=abs(u.balance - u.ledger),
                currency=u.currency,
                effect_minor=u.balance - u.ledger,
            )
        )
        money[u.currency].off_ledger += u.balance - u.ledger
    for currency, (total, n) in f.balances.items():
        money[currency].balances += total
        money[currency].accounts += n
    for currency, total in f.deposits.items():
        money[currency].deposits += total
    for move_id, phase in f.active_moves:
        report.notes.append(
            f"move {move_id} is {phase} on {f.shard}: rows of its range may be counted on two shards "
            "or none; run reconcile again once it is done"
        )


def _add_up(report: Report, money: dict[str, Money]) -> dict[str, Money]:
    """The totals per currency, and a mismatch for each whose money is not explained."""
    totals = {c: m for c, m in money.items() if c}
    for currency, m in sorted(totals.items()):
        if m.unexplained:
            report.mismatches.append(
                Mismatch(
                    Kind.MONEY_NOT_CONSERVED,
                    f"{currency}: balances {m.balances}, deposits {m.deposits}, in flight {m.in_flight}, "
                    f"created/lost by the mismatches {m.mismatches:+d}, off ledger {m.off_ledger:+d}: "
                    f"{m.unexplained:+d} unexplained",
                    amount_minor=abs(m.unexplained),
                    currency=currency,
                    effect_minor=m.unexplained,
                )
            )
    return totals


#: A transfer in flight: (state, amount, currency, since when).
_InFlight = tuple[str, int, str, datetime]


def _judge(transfer_id: uuid.UUID, story: _Story) -> Mismatch | _InFlight | None:
    """One transfer's verdict: None (settled), in flight (state, amount, currency, since), or a
    mismatch."""
    ins = story.of("transfer_in")
    if story.transfer is None and story.first_leg() is None:
        # An outbox or dead letter row alone: the transfer row is gone.
        if story.outbox_row is None:
            return None
        return _mismatch(Kind.DEBIT_MISSING, transfer_id, story, "outbox row without transfer")
    if len(ins) > 1:
        amount, currency = story.amount()
        return _mismatch(
            Kind.DUPLICATE_CREDIT,
            transfer_id,
            story,
            f"{len(ins)} credits of {amount} {currency} on "
            + ", ".join(f"{i.shard} ({i.row.account_id})" for i in ins),
        )
    if not story.of("transfer_out"):
        return _without_debit(transfer_id, story)
    if ins or story.of("refund"):
        return _debited_and_settled(transfer_id, story)
    return _debited_only(transfer_id, story)


def _without_debit(transfer_id: uuid.UUID, story: _Story) -> Mismatch | None:
    """A transfer no shard holds a debit of: its credit or refund alone, or its row alone."""
    t, ins = story.transfer, story.of("transfer_in")
    if t is not None:
        return _mismatch(
            Kind.DEBIT_MISSING,
            transfer_id,
            story,
            f"transfer {transfer_id} on {t.shard} ({t.row.state}) has no debit entry"
            + (f"; its credit is on {ins[0].shard}" if ins else ""),
        )
    if not ins or story.of("refund"):
        return None if story.net == 0 else _unbalanced(transfer_id, story)
    if story.reversals and story.net == 0:
        return None  # reversed by an earlier --reverse-orphan-credits
    credit = ins[0]
    return _mismatch(
        Kind.CREDIT_WITHOUT_DEBIT,
        transfer_id,
        story,
        f"{credit.shard} holds a credit of {credit.row.amount_minor} {story.amount()[1]} to "
        f"{credit.row.account_id} (entry {credit.row.entry_id}, {credit.row.created_at:%Y-%m-%d %H:%M:%S} UTC) "
        "whose transfer and debit no shard holds",
    )


def _debited_and_settled(transfer_id: uuid.UUID, story: _Story) -> Mismatch | None:
    """A debited transfer with a credit or a refund (or both: money created, unless reversed)."""
    ins, refunds = story.of("transfer_in"), story.of("refund")
    if not (ins and refunds):
        return None if story.net == 0 else _unbalanced(transfer_id, story)
    if story.reversals and story.net == 0:
        return None
    amount, currency = story.amount()
    return _mismatch(
        Kind.CREDITED_AND_REFUNDED,
        transfer_id,
        story,
        f"credited on {ins[0].shard} ({ins[0].row.account_id}) and refunded on {refunds[0].shard} "
        f"({refunds[0].row.account_id}): {amount} {currency} twice",
    )


def _debited_only(transfer_id: uuid.UUID, story: _Story) -> Mismatch | _InFlight | None:
    """A debited transfer with neither credit nor refund: in flight, or its credit or refund lost."""
    amount, currency = story.amount()
    if story.net != -amount:
        return _unbalanced(transfer_id, story)
    t, o, d = story.transfer, story.outbox_row, story.dead_letter
    refunded = (t is not None and t.row.state == "refunded") or (
        d is not None and d.row.refunded_at is not None
    )
    if o is None:
        return _never_queued(transfer_id, story, refunded)
    if o.row.state == "delivered":
        return _mismatch(
            Kind.CREDIT_MISSING,
            transfer_id,
            story,
            f"{o.shard}'s outbox row {o.row.id} says delivered at {o.row.delivered_at:%Y-%m-%d %H:%M:%S} UTC "
            f"(to {o.row.destination_shard_id}); no shard holds the credit",
        )
    if refunded:
        return _mismatch(
            Kind.REFUND_MISSING,
            transfer_id,
            story,
            f"dead letter of {o.shard} says refunded"
            + (
                f" at {d.row.refunded_at:%Y-%m-%d %H:%M:%S} UTC"
                if d is not None and d.row.refunded_at
                else ""
            )
            + " but no refund entry exists",
            blocked="" if d is not None else "no dead letter row to refund through",
        )
    if o.row.state == "dead_lettered":
        return ("refund_owed", amount, currency, o.row.dead_lettered_at or o.row.created_at)
    return ("pending", amount, currency, o.row.created_at)


def _never_queued(transfer_id: uuid.UUID, story: _Story, refunded: bool) -> Mismatch:
    """A debit without outbox row: its refund lost, or its credit never queued."""
    t, debit = story.transfer, story.of("transfer_out")[0]
    if refunded:
        return _mismatch(
            Kind.REFUND_MISSING,
            transfer_id,
            story,
            f"transfer is {t.row.state if t else '?'} on {debit.shard} but no refund entry exists, and no "
            "outbox row or dead letter either",
            blocked="no dead letter to refund through",
        )
    amount, currency = story.amount()
    return _mismatch(
        Kind.CREDIT_NOT_QUEUED,
        transfer_id,
        story,
        f"{debit.shard} debited {debit.row.account_id} by {amount} {currency}; no outbox row and no "
        "credit on any shard",
        blocked="" if t is not None else "no transfer row to rebuild the credit from",
    )


def _unbalanced(transfer_id: uuid.UUID, story: _Story) -> Mismatch:
    return _mismatch(Kind.LEGS_UNBALANCED, transfer_id, story, _legs(story))


def _legs(story: _Story) -> str:
    return "entries: " + ", ".join(
        f"{leg.row.kind} {leg.row.amount_minor:+d} {leg.row.currency} {leg.row.account_id}@{leg.shard}"
        for leg in story.legs
    )


def _mismatch(
    kind: Kind, transfer_id: uuid.UUID, story: _Story, detail: str, *, blocked: str = ""
) -> Mismatch:
    t, o = story.transfer, story.outbox_row
    ins, outs = story.of("transfer_in"), story.of("transfer_out")
    legs = ins or story.legs
    currency = t.row.currency if t else (legs[0].row.currency if legs else "")
    amount = t.row.amount_minor if t else (abs(legs[0].row.amount_minor) if legs else 0)
    source_shard = t.shard if t else (outs[0].shard if outs else (o.shard if o else None))
    destination_shard = (
        ins[0].shard
        if ins
        else (o.row.destination_shard_id if o else (t.row.destination_shard_id if t else None))
    )
    key = str(refund_key(transfer_id)) if kind is Kind.REFUND_MISSING else str(credit_key(transfer_id))
    writes_to = ins[0] if ins and kind in REVERSIBLE else None
    return Mismatch(
        kind,
        detail,
        transfer_id=transfer_id,
        source_shard=source_shard,
        destination_shard=destination_shard,
        source_account=t.row.source_account_id if t else (outs[0].row.account_id if outs else None),
        destination_account=t.row.destination_account_id if t else (ins[0].row.account_id if ins else None),
        shard=writes_to.shard if writes_to else source_shard,
        account=writes_to.row.account_id if writes_to else None,
        amount_minor=amount,
        currency=currency,
        outbox_id=o.row.id if o else None,
        key=key,
        effect_minor=story.net
        if kind not in (Kind.CREDIT_MISSING, Kind.CREDIT_NOT_QUEUED, Kind.REFUND_MISSING)
        else -amount,
        blocked=blocked,
    )


def check(dsns: Mapping[str, str], *, since: datetime | None = None, confirm: bool = True) -> Report:
    """Read every shard (twice, with `confirm`), compare, and annotate the mismatches with what the
    shards hold of their follow-up keys."""
    first = classify(read_all(dsns, since), with_money=since is None)
    if not confirm or not first.mismatches:
        report = first
    else:
        report = classify(read_all(dsns, since), with_money=since is None)
        seen = {m.identity for m in first.mismatches}
        transient = [m for m in report.mismatches if m.identity not in seen]
        report.mismatches = [m for m in report.mismatches if m.identity in seen]
        report.moving_ids = {m.transfer_id for m in transient if m.transfer_id is not None}
        for m in transient:  # their money is in the totals of this read: explained as in flight
            if report.money is not None and m.currency in report.money:
                report.money[m.currency].mismatches -= m.effect_minor
                report.money[m.currency].in_flight -= m.effect_minor
        if transient:
            report.notes.append(
                f"{len(transient)} mismatch(es) seen by one read only (a transfer moving on meanwhile) "
                "were left out; run again to see whether they stay"
            )
    _annotate(dsns, report)
    return report


def _annotate(dsns: Mapping[str, str], report: Report) -> None:
    """Block the repairs a stored key outcome would defeat, name the source shard of credits
    without debit, and say what the lost keys mean."""
    ids = [m.transfer_id for m in report.mismatches if m.transfer_id is not None]
    if not ids:
        return
    by_key = _records_by_key(dsns, ids)
    #: shard -> when the transfers it lost were made (the shards that look restored).
    restored: dict[str, list[datetime]] = defaultdict(list)
    lost_credits: dict[str, list[datetime]] = defaultdict(list)
    report.mismatches = [
        _with_records(m, by_key.get(m.key, []), restored, lost_credits)
        if m.transfer_id is not None and m.key is not None
        else m
        for m in report.mismatches
    ]
    report.notes += _restore_notes(restored, lost_credits)


def _records_by_key(dsns: Mapping[str, str], ids: list[uuid.UUID]) -> dict[str, list[KeyRecord]]:
    """Every shard's stored outcomes of the follow-up keys of `ids`, by key."""
    by_key: dict[str, list[KeyRecord]] = defaultdict(list)
    for shard, dsn in dsns.items():
        with connect(dsn) as conn:
            for r in follow_up_records(conn, shard, ids):
                by_key[r.key].append(r)
    return by_key


def _with_records(
    m: Mismatch,
    held: list[KeyRecord],
    restored: dict[str, list[datetime]],
    lost_credits: dict[str, list[datetime]],
) -> Mismatch:
    """One mismatch as the stored outcomes of its key (`held`) tell it; notes when its transfer was
    made under the shard it was lost on."""
    assert m.transfer_id is not None
    made = transfer_time(m.transfer_id)
    if m.kind is Kind.CREDIT_MISSING:
        credits = [r for r in held if r.method.endswith("/CreditTransfer") and r.status_code == 0]
        if credits:
            m = _replace(
                m,
                blocked=f"{credits[0].shard} holds the credit key's stored outcome (OK) without "
                "its entry, so a redelivery would replay and apply nothing",
            )
        if made and m.destination_shard:
            lost_credits[m.destination_shard].append(made)
    elif m.kind is Kind.REFUND_MISSING and held and not m.blocked:
        m = _replace(
            m,
            blocked=f"{held[0].shard} holds the refund key's stored outcome without its entry, "
            "so RefundTransfer would replay and apply nothing",
        )
    elif m.kind is Kind.CREDIT_WITHOUT_DEBIT:
        scopes = [r.scope for r in held if r.method.endswith("/CreditTransfer")]
        source = scopes[0].rpartition("|")[2].removeprefix("relay:") if scopes else None
        if source:
            m = _replace(m, source_shard=source)
        if made:
            restored[source or "the source shard"].append(made)
    return m


def _restore_notes(restored: dict[str, list[datetime]], lost_credits: dict[str, list[datetime]]) -> list[str]:
    """What the shards that look restored lost besides the mismatches: their keys."""
    notes = [
        f"{shard} holds no trace of {len(times)} transfer(s) made between {min(times):%Y-%m-%d %H:%M:%S} "
        f"and {max(times):%Y-%m-%d %H:%M:%S} UTC whose credits other shards hold: it looks restored to "
        f"before {min(times):%Y-%m-%d %H:%M:%S}. The idempotency records it wrote after that point are "
        "gone and cannot be seen from here: a caller retrying a call it was answered for then (these "
        "Transfers, or any Deposit or Transfer) with its original key gets it applied again as new"
        for shard, times in sorted(restored.items())
    ]
    notes += [
        f"{shard} lost {len(times)} credit(s) of transfers made between {min(times):%Y-%m-%d %H:%M:%S} "
        f"and {max(times):%Y-%m-%d %H:%M:%S} UTC that their sources saw delivered: it looks restored. "
        "The credit keys went with it, so re-queued credits apply there once (not replay); callers' "
        "keys it acknowledged after the restore point are gone too (a retry applies again)"
        for shard, times in sorted(lost_credits.items())
    ]
    return notes


def _replace(m: Mismatch, **changes: str) -> Mismatch:
    return dataclasses.replace(m, **changes)  # type: ignore[arg-type]


__all__ = [
    "REPAIRS",
    "REVERSIBLE",
    "Kind",
    "Mismatch",
    "Money",
    "Report",
    "check",
    "classify",
    "transfer_time",
]
