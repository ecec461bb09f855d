"""The verification of a move names what it found: an unbalanced account comes with its balance, its
ledger's sum and its entries, so the operator (and a flaky CI run) sees which account and why."""

from __future__ import annotations

import uuid

import psycopg

from shardrouter.core.shardmap import DEFAULT_SLOTS
from shardrouter.reshard.plan import MovePlan
from shardrouter.reshard.verify import ACCOUNTS_SHOWN, Verification, digests, unbalanced_accounts, verify
from shardrouter.shardd.migrations import apply_migrations

PLAN = MovePlan("m-verify", DEFAULT_SLOTS, 0, DEFAULT_SLOTS - 1, "shard-0", "shard-1")


def _transfer(account: str, amount: int) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{account}/{amount}")


def _account(db: psycopg.Connection[tuple[object, ...]], account: str, balance: int, *entries: int) -> None:
    db.execute("INSERT INTO accounts (id, currency, balance) VALUES (%s, 'EUR', %s)", (account, balance))
    for amount in entries:
        db.execute(
            "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, transfer_id, idempotency_key)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (
                uuid.uuid4(),
                account,
                amount,
                "deposit" if amount > 0 else "transfer_out",
                None if amount > 0 else _transfer(account, amount),
                str(uuid.uuid4()),
            ),
        )


def test_an_unbalanced_account_is_named_with_its_balance_ledger_sum_and_entries(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        apply_migrations(db)
        _account(db, "fine", 7, 10, -3)
        _account(db, "short", 12, 10, -3)  # the balance says 12, the ledger 7
        _account(db, "empty", 5)  # a balance without any entry
        found = unbalanced_accounts(db, PLAN)
        tables = digests(db, PLAN)

    assert found.count == 2
    assert [a.account_id for a in found.some] == ["empty", "short"]
    short = found.some[1]
    assert (short.balance, short.ledger_sum, short.entry_count) == (12, 7, 2)
    assert sorted((e.kind, e.amount_minor) for e in short.entries) == [("deposit", 10), ("transfer_out", -3)]
    assert str(_transfer("short", -3)) in {e.transfer_id for e in short.entries}
    problems = Verification(tables, tables, found).problems
    assert len(problems) == 1
    assert problems[0].startswith("2 moved account(s) whose balance is not the sum of their ledger")
    assert "short: balance 12, ledger sum 7 (off by 5), 2 entries, newest first: [" in problems[0]
    assert f"transfer_out -3 (transfer {_transfer('short', -3)})" in problems[0]
    assert "empty: balance 5, ledger sum 0 (off by 5), 0 entries, newest first: []" in problems[0]


def test_only_a_few_unbalanced_accounts_are_named(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        apply_migrations(db)
        for i in range(ACCOUNTS_SHOWN + 2):
            _account(db, f"acct-{i}", 9, 1)
        found = unbalanced_accounts(db, PLAN)
        tables = digests(db, PLAN)
    assert found.count == ACCOUNTS_SHOWN + 2
    assert len(found.some) == ACCOUNTS_SHOWN
    (problem,) = Verification(tables, tables, found).problems
    assert problem.endswith("; and 2 more)")


def test_balanced_accounts_are_no_problem(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        apply_migrations(db)
        _account(db, "fine", 7, 10, -3)
        found = unbalanced_accounts(db, PLAN)
        tables = digests(db, PLAN)
    assert (found.count, found.some) == (0, ())
    assert Verification(tables, tables, found).problems == []


def test_the_old_owners_side_of_unbalanced_accounts_is_reported_too(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        apply_migrations(db)
        _account(db, "short", 12, 10, -3)
        # The same database on both sides: the old owner committed the inconsistency too.
        result = verify(db, db, PLAN)
    counted, both = result.problems
    assert counted == "1 moved account(s) whose balance is not the sum of their ledger; on the old owner 1"
    assert both.startswith(
        "the accounts, both sides: short: old owner balance 12, ledger sum 7 (off by 5), 2 entries, newest first: ["
    )
    assert "; new owner balance 12, ledger sum 7 (off by 5), 2 entries" in both


def test_entries_whose_routing_hash_is_not_the_accounts_are_counted(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        apply_migrations(db)
        _account(db, "stray", 12, 10)
        with db.transaction():  # as a replication apply worker writes: no trigger sets the hash
            db.execute("SET LOCAL session_replication_role = replica")
            db.execute(
                "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, idempotency_key, account_hash)"
                " VALUES (%s, 'stray', 5, 'deposit', %s, 1)",
                (uuid.uuid4(), str(uuid.uuid4())),
            )
        found = unbalanced_accounts(db, PLAN)
    (stray,) = found.some
    assert (stray.balance, stray.ledger_sum, stray.entry_count, stray.foreign_hash) == (12, 15, 2, 1)
    assert (
        "2 entries, 1 of them with another account_hash, newest first: [deposit 5, deposit 10]"
        in stray.describe()
    )
