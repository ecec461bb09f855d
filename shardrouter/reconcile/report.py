"""The human-readable report (`--json` prints `Report.as_json()` instead)."""

from __future__ import annotations

from shardrouter.reconcile.check import REVERSIBLE, Mismatch, Report


def render(report: Report, *, title: str = "reconcile") -> str:
    """The report in words: every mismatch with its kind, shards, accounts, amounts, ids and what to
    do; what is in flight; the money per currency; notes; and the verdict."""
    lines = [
        f"{title}: {len(report.shards)} shard(s) ({', '.join(report.shards)}), "
        f"{report.transfers} transfer(s) checked"
    ]
    if report.mismatches:
        lines.append(f"MISMATCHES ({len(report.mismatches)}):")
    for n, m in enumerate(report.mismatches, 1):
        lines += _mismatch_lines(n, m)
    lines.append(_in_flight_line(report))
    lines += _money_lines(report)
    lines += [f"note: {note}" for note in report.notes]
    lines += [f"repair: {repair}" for repair in report.repairs]
    lines.append(_verdict_line(report))
    return "\n".join(lines)


def _mismatch_lines(n: int, m: Mismatch) -> list[str]:
    """One mismatch: where and how much, its ids, what was found and what to do."""
    where = []
    if m.transfer_id:
        where.append(f"transfer {m.transfer_id}")
    if m.source_shard or m.destination_shard:
        where.append(f"{m.source_shard or '?'} -> {m.destination_shard or '?'}")
    if m.source_account or m.destination_account:
        where.append(f"{m.source_account or '?'} -> {m.destination_account or '?'}")
    if m.account and not m.transfer_id:
        where.append(f"account {m.account} on {m.shard}")
    money = f"{m.amount_minor} {m.currency}".strip()
    effect = (
        f" (money {'created' if m.effect_minor > 0 else 'lost'}: {m.effect_minor:+d})"
        if m.effect_minor
        else ""
    )
    lines = [f"  {n}. {m.kind.value}: " + ", ".join(where) + f", {money}{effect}"]
    ids = []
    if m.outbox_id is not None:
        ids.append(f"outbox row {m.outbox_id} on {m.source_shard}")
    if m.key:
        ids.append(f"key {m.key}")
    if ids:
        lines.append("     " + ", ".join(ids))
    lines.append(f"     {m.detail}")
    lines.append(f"     what to do: {m.action}")
    return lines


def _in_flight_line(report: Report) -> str:
    return (
        f"in flight: {report.pending_credits} credit(s) queued"
        + (f" (oldest {report.oldest_pending_s:.1f} s)" if report.pending_credits else "")
        + f", {report.refunds_owed} refund(s) owed (the relays finish these)"
    )


def _money_lines(report: Report) -> list[str]:
    if report.money is None:
        return ["money: not added up (--since reads only some transfers)"]
    return [
        f"money {currency}: balances {totals.balances} over {totals.accounts} account(s) = deposits "
        f"{totals.deposits} - in flight {totals.in_flight} {totals.mismatches:+d} (mismatches) "
        f"{totals.off_ledger:+d} (off ledger); unexplained {totals.unexplained:+d}"
        for currency, totals in sorted(report.money.items())
    ]


def _verdict_line(report: Report) -> str:
    if report.consistent:
        return "consistent: every shard agrees with every other"
    repairable = sum(1 for m in report.mismatches if m.repair)
    reversible = sum(1 for m in report.mismatches if m.kind in REVERSIBLE)
    return f"{len(report.mismatches)} mismatch(es): {repairable} repairable by --repair" + (
        f", {reversible} by --repair --reverse-orphan-credits" if reversible else ""
    )


__all__ = ["render"]
