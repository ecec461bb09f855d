"""The `shardd` command for operators: settings errors, migrate, retention, key look-up, dead letters."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest

from shardrouter.core.keys import new_key
from shardrouter.shardd.server import prepare_database
from shardrouter.shardd.settings import ShardSettings, parse_settings
from shardrouter.v1 import transfer_pb2
from tests.helpers import key_metadata, money
from tests.processes import run_shardd


def test_retention_shorter_than_the_slowest_retry_path_is_refused():
    with pytest.raises(ValueError, match="late replay could apply twice"):
        ShardSettings(retention_days=10)
    result = run_shardd("serve", "--retention-days", "10")
    assert result.returncode == 2
    assert "retention_days=10 must be at least twice the slowest retry path" in result.stderr


def test_flags_win_over_environment_and_bad_values_are_named():
    settings = parse_settings(["--workers", "3"], {"SHARDD_WORKERS": "9", "SHARDD_SHARD_ID": "shard-7"})
    assert settings.workers == 3 and settings.shard_id == "shard-7"
    with pytest.raises(ValueError, match="SHARDD_POOL_MAX"):
        parse_settings([], {"SHARDD_POOL_MAX": "many"})


def test_migrate_and_retention_commands(database):
    assert run_shardd("migrate", "--dsn", database).returncode == 0
    result = run_shardd("retention", "run", "--dsn", database)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ran"] is True and report["dropped"] == []
    assert any(name.startswith("idempotency_record_") for name in report["kept"])


def test_key_lookup_shows_state_and_expiry_but_never_the_response(stub, database):
    md = key_metadata(caller="team-a")
    stub.Deposit(
        transfer_pb2.DepositRequest(account_id="alice", amount=money(5), reference="secret-ref"), metadata=md
    )
    result = run_shardd("keys", "lookup", md[0][1], "--dsn", database)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["state"] == "completed" and record["status_code"] == 0
    assert record["scope"].endswith("|team-a") and "expires_at" in record
    assert "secret-ref" not in result.stdout and "response" not in record
    missing = run_shardd("keys", "lookup", str(new_key()), "--dsn", database)
    assert missing.returncode == 1 and "no record" in missing.stdout


def test_dead_letter_commands(database, db):
    prepare_database(database, timedelta(days=30))
    # A dead letter as the relay leaves it: a pending transfer whose credit failed for good.
    transfer_id = new_key()
    db.execute("INSERT INTO accounts (id, currency, balance) VALUES ('src', 'EUR', 0)")
    db.execute(
        "INSERT INTO transfers (id, source_account_id, destination_account_id, destination_shard_id, amount_minor,"
        " currency, state) VALUES (%s, 'src', 'ghost', 'shard-1', 10, 'EUR', 'pending')",
        (transfer_id,),
    )
    db.execute(
        "INSERT INTO outbox (transfer_id, destination_shard_id, idempotency_key, payload, dead_lettered_at)"
        " VALUES (%s, 'shard-1', %s, '\\x00', now())",
        (transfer_id, new_key()),
    )
    db.execute(
        "INSERT INTO dead_letters (transfer_id, outbox_id, reason, refund_key) SELECT %s, id, 'NOT_FOUND: ghost', %s"
        " FROM outbox",
        (transfer_id, new_key()),
    )
    listing = run_shardd("dead-letters", "list", "--dsn", database)
    assert listing.returncode == 0
    row = json.loads(listing.stdout.strip())
    assert row["transfer_id"] == str(transfer_id) and row["refunded_at"] is None
    shown = run_shardd("dead-letters", "show", str(transfer_id), "--dsn", database)
    assert json.loads(shown.stdout)["reason"] == "NOT_FOUND: ghost"
    assert run_shardd("dead-letters", "show", str(uuid.uuid4()), "--dsn", database).returncode == 1
    no_map = run_shardd("dead-letters", "replay", str(transfer_id), "--dsn", database)
    assert no_map.returncode == 2 and "--shard-map" in no_map.stderr


def test_usage_and_unknown_commands():
    assert run_shardd("--help").returncode == 0
    result = run_shardd("frobnicate")
    assert result.returncode == 2 and "commands:" in result.stderr


@pytest.mark.parametrize(
    "key", ["order-77/Attempt:1", "8E03978E-40D5-43E8-BC93-6894A57F9324"], ids=["opaque", "uuid4"]
)
def test_key_lookup_finds_a_key_dated_by_its_receipt(stub, database, key):
    md = key_metadata(key, caller="team-a")
    stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
    result = run_shardd("keys", "lookup", key, "--dsn", database)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["state"] == "completed" and record["scope"].endswith("|team-a")
    bad = run_shardd("keys", "lookup", "two words", "--dsn", database)
    assert bad.returncode != 0 and "not an idempotency key" in bad.stderr
