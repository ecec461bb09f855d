"""`shard-router reconcile` against a real local cluster (a PostgreSQL, a `shardd` process per shard and
the router, as `shard-router dev up` runs them): consistent after cross-shard load; every mismatch kind,
made by a controlled fault, reported with its shards, accounts, amounts and ids; `--repair` (twice
at once, then again) repairs the repairable ones exactly once through the outbox and the relays, and
`--reverse-orphan-credits` takes back money a lost debit created, once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from shardrouter.core.shardmap import even_shard_map, write_shard_map
from shardrouter.localcluster.cluster import LocalCluster
from shardrouter.reconcile.facts import reversal_key
from shardrouter.shardd.ledger.service import credit_key, refund_key
from tests.reconcile.drive import (
    Bank,
    Load,
    credits_of,
    cross_shard_load,
    deposits_total,
    dsns,
    kinds,
    lose_credit,
    lose_outbox_row,
    lose_refund,
    lose_transfer,
    money_total,
    reconcile,
    reconcile_command,
    reconcile_killed_after_first_repair,
    restart_daemons,
    running_cluster,
    settle,
    sql,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster() as started:
        yield started


@pytest.fixture(scope="module")
def bank(cluster: LocalCluster) -> Iterator[Bank]:
    made = Bank(cluster)
    made.open_accounts("acct", 4)
    yield made
    made.close()


def test_consistent_after_cross_shard_load(cluster: LocalCluster, bank: Bank) -> None:
    made = cross_shard_load(bank, bank.by_shard, 120)
    # While transfers go on, credits in flight are not mismatches, and a credit landing between
    # the reads of two shards is not reported (each mismatch must show in two reads).
    load = Load(bank, bank.by_shard)
    load.start()
    try:
        for _ in range(3):
            load.wait_for(10)
            code, during = reconcile(cluster)
            assert code == 0, during["mismatches"]
            assert all(m["unexplained"] == 0 for m in during["money"].values())
    finally:
        load.stop()
    assert not load.failed, load.failed[:3]
    made += load.made
    settle(cluster)
    code, report = reconcile(cluster)
    assert code == 0, report
    assert report["consistent"] and report["mismatches"] == []
    assert report["transfers_checked"] >= len(made)
    (eur,) = report["money"].values()
    assert eur["balances"] == eur["deposits"] == deposits_total(cluster) == money_total(cluster)
    assert eur["in_flight"] == 0 and eur["unexplained"] == 0
    # The installed console command says the same in words.
    command = reconcile_command(cluster)
    out, err = command.communicate(timeout=60)
    assert command.returncode == 0, err
    assert "consistent: every shard agrees with every other" in out


@dataclass
class Faults:
    """The faults made on the module's cluster, by transfer id, and what each should be reported as."""

    credit_missing: uuid.UUID
    credit_missing_amount: int
    credit_not_queued: uuid.UUID
    credit_without_debit: uuid.UUID
    orphan_amount: int
    orphan_account: str
    refund_missing: uuid.UUID
    refund_amount: int
    unbalanced_account: str
    #: A credit lost while its key's record stayed: a redelivery would only replay, so not repaired.
    credit_kept: uuid.UUID
    shards: tuple[str, str]


@pytest.fixture(scope="module")
def faults(cluster: LocalCluster, bank: Bank) -> Faults:
    """One fault of each kind, each on a transfer of its own from shard A to shard B."""
    a, b = cluster.shard_ids
    src, dst = bank.by_shard[a][0], bank.by_shard[b][0]
    t_lost, t_unqueued, t_orphan = (bank.transfer(src, dst, amount) for amount in (11, 13, 17))
    # A credit to an account B does not have: dead-lettered and refunded by the relay.
    t_dead = bank.transfer(src, bank.nobody_on(b), 19)
    t_kept = bank.transfer(src, dst, 23)
    settle(cluster)
    databases = dsns(cluster)
    assert sql(databases[a], "SELECT state FROM transfers WHERE id = %s", (t_dead,)) == [("refunded",)]
    _, lost_amount = lose_credit(databases[b], t_lost)  # B restored to before the credit
    lose_credit(databases[b], t_unqueued)  # ... and A's outbox row lost by hand
    lose_outbox_row(databases[a], t_unqueued)
    _, orphan_amount = lose_transfer(databases[a], t_orphan)  # A restored to before the transfer
    refund_amount = lose_refund(
        databases[a], t_dead
    )  # the refund's entry lost, the dead letter says refunded
    lose_credit(databases[b], t_kept, keep_record=True)
    odd = bank.by_shard[b][1]
    sql(databases[b], "UPDATE accounts SET balance = balance + 5 WHERE id = %s", (odd,))
    restart_daemons(cluster)  # as after a restore: no daemon remembers a forgotten key
    return Faults(
        credit_missing=t_lost,
        credit_missing_amount=lost_amount,
        credit_not_queued=t_unqueued,
        credit_without_debit=t_orphan,
        orphan_amount=orphan_amount,
        orphan_account=dst,
        refund_missing=t_dead,
        refund_amount=refund_amount,
        unbalanced_account=odd,
        credit_kept=t_kept,
        shards=(a, b),
    )


def _by_kind(report: dict[str, Any], blocked: bool = False) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in report["mismatches"] if bool(m["blocked"]) == blocked}


def test_each_fault_is_reported_precisely(cluster: LocalCluster, bank: Bank, faults: Faults) -> None:
    a, b = faults.shards
    code, report = reconcile(cluster)
    assert code == 1
    assert kinds(report) == {
        str(faults.credit_missing): "credit_missing",
        str(faults.credit_not_queued): "credit_not_queued",
        str(faults.credit_without_debit): "credit_without_debit",
        str(faults.refund_missing): "refund_missing",
        str(faults.credit_kept): "credit_missing",
        f"{b}/{faults.unbalanced_account}": "balance_not_ledger",
    }
    found = _by_kind(report)
    kept = _by_kind(report, blocked=True)["credit_missing"]
    assert kept["transfer_id"] == str(faults.credit_kept) and kept["repair"] is None
    assert "replay and apply nothing" in kept["blocked"] and kept["effect_minor"] == -23
    lost = found["credit_missing"]
    assert (lost["source_shard"], lost["destination_shard"]) == (a, b)
    assert (lost["source_account"], lost["destination_account"]) == (bank.by_shard[a][0], bank.by_shard[b][0])
    assert lost["amount_minor"] == faults.credit_missing_amount == 11 and lost["effect_minor"] == -11
    assert lost["key"] == str(credit_key(faults.credit_missing)) and lost["repair"] == "requeue"
    assert lost["outbox_id"] is not None
    unqueued = found["credit_not_queued"]
    assert (unqueued["source_shard"], unqueued["amount_minor"], unqueued["repair"]) == (a, 13, "queue")
    assert unqueued["outbox_id"] is None
    orphan = found["credit_without_debit"]
    # Named from the credit key's stored outcome on B: the relay of A sent it.
    assert (orphan["source_shard"], orphan["destination_shard"], orphan["account"]) == (
        a,
        b,
        faults.orphan_account,
    )
    assert orphan["amount_minor"] == faults.orphan_amount == 17 and orphan["effect_minor"] == 17
    assert orphan["repair"] is None and "--reverse-orphan-credits" in orphan["action"]
    refund = found["refund_missing"]
    assert (refund["source_shard"], refund["amount_minor"], refund["effect_minor"]) == (a, 19, -19)
    assert refund["key"] == str(refund_key(faults.refund_missing)) and refund["repair"] == "refund"
    odd = found["balance_not_ledger"]
    assert (odd["shard"], odd["account"], odd["effect_minor"], odd["repair"]) == (
        b,
        faults.unbalanced_account,
        5,
        None,
    )
    (eur,) = report["money"].values()
    assert eur["created_or_lost_by_mismatches"] == -11 - 13 + 17 - 19 - 23
    assert eur["off_ledger"] == 5 and eur["unexplained"] == 0
    assert any(f"{a} holds no trace of 1 transfer(s)" in note for note in report["notes"])
    assert any(f"{b} lost 2 credit(s)" in note for note in report["notes"])
    # --since reads the transfers touched in the window (all of these) and adds no money up.
    code, recent = reconcile(cluster, "--since", "10m")
    assert code == 1 and kinds(recent) == kinds(report) and recent["money"] is None


def test_repair_applies_each_repair_once(cluster: LocalCluster, bank: Bank, faults: Faults) -> None:
    a, b = faults.shards
    balances_before = money_total(cluster)
    # Killed right after its first repair, then two at once, each a process of its own, then a
    # fourth: each repair lands once.
    reconcile_killed_after_first_repair(cluster)
    _, midway = reconcile(cluster)  # the first repair (the oldest transfer's) done, the others not
    assert faults.credit_missing not in {m["transfer_id"] for m in midway["mismatches"]}
    assert set(kinds(midway).values()) == {
        "credit_missing",  # the blocked one
        "credit_not_queued",
        "refund_missing",
        "credit_without_debit",
        "balance_not_ledger",
    }
    twins = [reconcile_command(cluster, "--repair", "--json") for _ in range(2)]
    for twin in twins:
        twin.communicate(timeout=90)
        assert twin.returncode == 1  # what --repair may not repair stays
    code, after = reconcile(cluster, "--repair")
    assert code == 1
    assert kinds(after["after"]) == {
        str(faults.credit_kept): "credit_missing",
        str(faults.credit_without_debit): "credit_without_debit",
        f"{b}/{faults.unbalanced_account}": "balance_not_ledger",
    }
    for tid in (faults.credit_missing, faults.credit_not_queued):
        assert credits_of(cluster, tid) == 1
    databases = dsns(cluster)
    assert sql(
        databases[a],
        "SELECT count(*) FROM ledger_entries WHERE transfer_id = %s AND kind = 'refund'",
        (faults.refund_missing,),
    ) == [(1,)]
    assert sql(databases[a], "SELECT state FROM transfers WHERE id = %s", (faults.refund_missing,)) == [
        ("refunded",)
    ]
    assert sql(databases[a], "SELECT state FROM transfers WHERE id = %s", (faults.credit_missing,)) == [
        ("completed",)
    ]
    assert money_total(cluster) == balances_before + 11 + 13 + 19
    # The blocked credit once its stale record is gone (and no daemon remembers it): repaired.
    sql(databases[b], "DELETE FROM idempotency_record WHERE key = %s", (str(credit_key(faults.credit_kept)),))
    restart_daemons(cluster)
    code, after = reconcile(cluster, "--repair")
    assert (
        str(faults.credit_kept) not in kinds(after["after"]) and credits_of(cluster, faults.credit_kept) == 1
    )
    assert money_total(cluster) == balances_before + 11 + 13 + 19 + 23
    # The credit without debit is taken back once, on request, even asked twice.
    for _ in range(2):
        code, after = reconcile(cluster, "--repair", "--reverse-orphan-credits")
        assert code == 1 and set(kinds(after["after"]).values()) == {"balance_not_ledger"}
    assert sql(
        databases[b],
        "SELECT amount_minor, account_id, idempotency_key FROM ledger_entries WHERE transfer_id = %s AND kind = 'transfer_out'",
        (faults.credit_without_debit,),
    ) == [(-17, faults.orphan_account, str(reversal_key(faults.credit_without_debit)))]
    # The balance off its ledger is never written by reconcile: put right by hand here.
    sql(databases[b], "UPDATE accounts SET balance = balance - 5 WHERE id = %s", (faults.unbalanced_account,))
    code, report = reconcile(cluster)
    assert code == 0, report["mismatches"]
    assert money_total(cluster) == deposits_total(cluster)


def test_usage_and_connection_errors(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    from shardrouter.reconcile import cli

    assert cli.main(["--dsn", "nonsense"]) == 2
    assert "give SHARD=DSN" in capsys.readouterr().err
    assert cli.main([], default_dir=tmp_path) == 2
    assert "no shard databases given" in capsys.readouterr().err
    assert cli.main(["--reverse-orphan-credits", "--dsn", "s=x"]) == 2
    assert "goes with --repair" in capsys.readouterr().err
    assert cli.main(["--dsn", "shard-9=host=127.0.0.1 port=1 dbname=x connect_timeout=2"]) == 2
    assert "shard-9" in capsys.readouterr().err
    # A shard of the map without a database: its credits would look missing, so nothing is read.
    write_shard_map(
        tmp_path / "map.yaml", even_shard_map({"s-0": "127.0.0.1:1", "s-1": "127.0.0.1:2"}, version=1)
    )
    assert cli.main(["--map", str(tmp_path / "map.yaml"), "--dsn", "s-0=host=127.0.0.1 port=1"]) == 2
    assert "names s-1, with no database given" in capsys.readouterr().err
