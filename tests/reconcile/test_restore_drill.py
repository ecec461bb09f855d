"""THE DRILL (docs/runbooks/restore-one-shard.md, on a local cluster): cross-shard transfers under load, a
base backup and a restore point on one shard, more cross-shard load, that shard restored to the point
from its base backup and WAL archive while the other keeps everything; then `shard-router reconcile`
reports exactly what the restore broke, `--repair` re-delivers the credits the restored shard lost
(once, under their original keys), what stays is only money created by credits whose debits the
restore took away, with its exact amount, and `--reverse-orphan-credits` takes that back: every
balance then adds up to the deposits."""

from __future__ import annotations

import uuid
from typing import Any

from shardrouter.localcluster.cluster import LocalCluster
from shardrouter.localcluster.shard_restore import ShardRestores
from tests.reconcile.drive import (
    Bank,
    Load,
    credits_of,
    deposits_total,
    dsns,
    kinds,
    money_total,
    reconcile,
    reconcile_text,
    running_cluster,
    settle,
    sql,
)


def _ids(dsn: str, query: str) -> set[uuid.UUID]:
    return {row[0] for row in sql(dsn, query)}


def test_restore_one_shard_then_reconcile_and_repair() -> None:
    with running_cluster() as cluster:
        bank = Bank(cluster)
        try:
            _drill(cluster, bank)
        finally:
            bank.close()


def _drill(cluster: LocalCluster, bank: Bank) -> None:
    a, b = cluster.shard_ids
    restores = ShardRestores(cluster)
    accounts = bank.open_accounts("drill", 4)
    load = Load(bank, accounts)
    load.start()
    try:
        load.wait_for(20)
        restores.backup_shard(a)
        load.wait_for(20)
        restores.restore_point(a, "drill")
        load.wait_for(40)  # acknowledged after the point: shard A will forget its part of these
    finally:
        load.stop()
    assert not load.failed, load.failed[:3]
    settle(cluster)  # every credit delivered before the restore
    made = set(load.made)
    databases = dsns(cluster)
    restores.restore_shard(a, target_name="drill")
    settle(cluster)  # A's relay re-sends what it had queued at the point; B replays those

    # What the restore took, read from the databases: transfers A made after the point (their credits
    # stay on B), and credits B delivered to A after the point (B's outbox says delivered).
    on_a = _ids(databases[a], "SELECT id FROM transfers")
    from_a = _ids(databases[b], "SELECT transfer_id FROM ledger_entries WHERE kind = 'transfer_in'") - _ids(
        databases[b], "SELECT id FROM transfers"
    )
    orphans = {t for t in from_a if t not in on_a}
    credited_on_a = _ids(databases[a], "SELECT transfer_id FROM ledger_entries WHERE kind = 'transfer_in'")
    lost = _ids(databases[b], "SELECT transfer_id FROM outbox WHERE delivered_at IS NOT NULL") - credited_on_a
    assert orphans and lost, "the load made no cross-shard transfer after the restore point"
    assert orphans | lost <= made
    orphan_amount = sum(
        int(r[0])
        for r in sql(
            databases[b],
            "SELECT amount_minor FROM ledger_entries WHERE kind = 'transfer_in' AND transfer_id = ANY(%s)",
            (list(orphans),),
        )
    )

    code, text = reconcile_text(cluster)  # what the operator reads (pytest -s shows it)
    print(text)
    assert (
        code == 1 and f"{len(orphans) + len(lost)} mismatch(es): {len(lost)} repairable by --repair" in text
    )
    code, report = reconcile(cluster)
    assert code == 1
    assert kinds(report) == {
        **{str(t): "credit_without_debit" for t in orphans},
        **{str(t): "credit_missing" for t in lost},
    }
    eur = _eur(report)
    assert eur["created_or_lost_by_mismatches"] == orphan_amount - _amounts(databases[b], lost)
    assert eur["unexplained"] == 0
    assert any(f"{a} holds no trace of {len(orphans)} transfer(s)" in n for n in report["notes"])
    assert any(f"{a} lost {len(lost)} credit(s)" in n for n in report["notes"])

    code, repaired = reconcile(cluster, "--repair")
    after = repaired["after"]
    print(render_json(after))
    assert code == 1  # money created by the lost debits stays until a person chooses
    assert kinds(after) == {str(t): "credit_without_debit" for t in orphans}
    assert sum(m["amount_minor"] for m in after["mismatches"]) == orphan_amount
    assert all(credits_of(cluster, t) == 1 for t in lost)
    assert _eur(after)["in_flight"] == 0
    assert money_total(cluster) == deposits_total(cluster) + orphan_amount

    code, reversed_ = reconcile(cluster, "--repair", "--reverse-orphan-credits")
    assert code == 0, reversed_["after"]["mismatches"]
    assert money_total(cluster) == deposits_total(cluster)

    # The keys A acknowledged after the point are gone, which no shard can show: the caller's retry
    # of a lost transfer with its ORIGINAL key is applied again, as a new transfer. With its orphan
    # credit reversed first (the runbook's order), that re-creates the debit and the money moves once.
    orphan = min(orphans)
    key, src, dst, amount = load.sent[orphan]
    again = bank.transfer(src, dst, amount, key)
    assert again != orphan
    assert bank.transfer(src, dst, amount, key) == again  # from now on the key replays
    settle(cluster)
    code, final = reconcile(cluster)
    assert code == 0 and final["mismatches"] == []
    assert money_total(cluster) == deposits_total(cluster)


def render_json(report: dict[str, Any]) -> str:
    return "after repair: " + ", ".join(
        f"{m['kind']} {m['transfer_id']} {m['amount_minor']}" for m in report["mismatches"]
    )


def _eur(report: dict[str, Any]) -> dict[str, int]:
    (eur,) = report["money"].values()
    return dict(eur)


def _amounts(dsn: str, transfer_ids: set[uuid.UUID]) -> int:
    return sum(
        int(r[0])
        for r in sql(dsn, "SELECT amount_minor FROM transfers WHERE id = ANY(%s)", (list(transfer_ids),))
    )
