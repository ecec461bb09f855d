"""Restoring ONE shard of a running local cluster to a point in time, with PostgreSQL's own base
backup and WAL archive, real processes throughout: the restored database holds exactly what was
committed up to the target (a named restore point, or a time) and nothing after, its daemons serve
again, the other shard is untouched (same server, same rows); a target that cannot be reached
leaves the shard on the data it had; the `dev backup|restore-point|restore|backups` commands ask a
running cluster through its control socket."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.core.shardmap import load_shard_map
from shardrouter.localcluster import cli, pitr
from shardrouter.localcluster.cluster import LocalCluster
from shardrouter.localcluster.postgres import ReplicatedPostgres, free_port
from shardrouter.localcluster.shard_restore import ShardRestores
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import pg_data_dir

#: What a restore must bring back exactly (background work writes other tables too).
_TABLES = {
    "accounts": "id",
    "transfers": "id",
    "ledger_entries": "id",
    "idempotency_record": "scope, key",
    "outbox": "id",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    data_dir = pg_data_dir()  # short: the control socket's path has at most 107 bytes
    running = LocalCluster(
        data_dir=data_dir, shards=2, replicas=1, router_port=free_port(), http_port=0, metrics=False
    )
    running.start()
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(data_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def stub(cluster: LocalCluster) -> Iterator[transfer_pb2_grpc.TransferServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.router_port}") as channel:
        yield transfer_pb2_grpc.TransferServiceStub(channel)


def _accounts_on(cluster: LocalCluster, shard_id: str, prefix: str, count: int) -> list[str]:
    shard_map = load_shard_map(cluster.shard_map_path)
    found = (f"{prefix}-{i}" for i in range(100_000))
    return [a for a in found if shard_map.shard_for(a).id == shard_id][:count]


def _dsn(cluster: LocalCluster, shard_id: str) -> str:
    return cluster.shard_dsn(shard_id)


def _rows(cluster: LocalCluster, shard_id: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(_dsn(cluster, shard_id), autocommit=True) as conn:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY {order}").fetchall()
            for table, order in _TABLES.items()
        }


def _server_started(cluster: LocalCluster, shard_id: str) -> datetime:
    with psycopg.connect(_dsn(cluster, shard_id), autocommit=True) as conn:
        row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _keys(cluster: LocalCluster, shard_id: str) -> set[str]:
    with psycopg.connect(_dsn(cluster, shard_id), autocommit=True) as conn:
        return {str(k) for (k,) in conn.execute("SELECT key FROM idempotency_record").fetchall()}


def _switch_wal_and_wait_archived(cluster: LocalCluster, shard_id: str) -> None:
    """Complete the current WAL segment and wait until the archiver has handled it."""
    with psycopg.connect(cluster.shard_dsn(shard_id), autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE nudge AS SELECT 1")  # something to switch away from
        (name,) = conn.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone() or ("",)
        conn.execute("SELECT pg_switch_wal()")
        deadline = time.monotonic() + 10
        done = "SELECT coalesce(last_archived_wal, '') >= %s FROM pg_stat_archiver"
        while conn.execute(done, (name,)).fetchone() != (True,):
            assert time.monotonic() < deadline, f"segment {name} not archived"
            time.sleep(0.02)


def _archived_segments(cluster: LocalCluster, shard_id: str) -> list[str]:
    return sorted(
        p.name
        for p in cluster.archive_dir(shard_id).iterdir()
        if p.name[:1] != "." and "ENABLED" not in p.name
    )


def _deposit(stub: transfer_pb2_grpc.TransferServiceStub, account: str, amount: int) -> str:
    key = str(new_key())
    stub.Deposit(
        transfer_pb2.DepositRequest(
            account_id=account, amount=transfer_pb2.Money(amount_minor=amount, currency="EUR")
        ),
        metadata=((KEY_METADATA, key),),
        timeout=10,
    )
    return key


def _transfer(
    stub: transfer_pb2_grpc.TransferServiceStub, source: str, destination: str, amount: int, key: str = ""
) -> tuple[str, str, bool]:
    """(key, transfer id, replayed)"""
    key = key or str(new_key())
    reply, call = stub.Transfer.with_call(
        transfer_pb2.TransferRequest(
            source_account_id=source,
            destination_account_id=destination,
            amount=transfer_pb2.Money(amount_minor=amount, currency="EUR"),
        ),
        metadata=((KEY_METADATA, key),),
        timeout=10,
    )
    replayed = dict(call.trailing_metadata() or ()).get("idempotency-replayed") == "true"
    return key, reply.transfer.transfer_id, replayed


def _balance(stub: transfer_pb2_grpc.TransferServiceStub, account: str) -> int:
    reply = stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=account), timeout=10)
    return int(reply.balance.amount_minor)


def test_a_shard_restored_to_a_restore_point_has_exactly_what_was_committed_before_it(
    cluster: LocalCluster, stub: transfer_pb2_grpc.TransferServiceStub
) -> None:
    restores = ShardRestores(cluster)
    alice, bob = _accounts_on(cluster, "shard-0", "pitr-a", 2)
    (carol,) = _accounts_on(cluster, "shard-1", "pitr-a", 1)
    _deposit(stub, alice, 10_000)
    _deposit(stub, bob, 1)
    _deposit(stub, carol, 500)
    # Before a first base backup, WAL is of no use to a restore: completed segments are not kept.
    _switch_wal_and_wait_archived(cluster, "shard-0")
    assert not _archived_segments(cluster, "shard-0")
    backup = restores.backup_shard("shard-0")
    assert backup.path.is_dir() and backup.timeline >= 1
    assert restores.backups("shard-0")[-1] == backup

    before = [_transfer(stub, alice, bob, 100) for _ in range(3)]
    at_point = _rows(cluster, "shard-0")
    point = restores.restore_point("shard-0", "drill-before-more")
    assert restores.restore_points("shard-0")[-1] == point
    after = [_transfer(stub, alice, bob, 1000) for _ in range(2)]
    _deposit(stub, alice, 7)
    _deposit(stub, carol, 5)  # the other shard moves on too
    assert _rows(cluster, "shard-0") != at_point
    late = restores.backup_shard("shard-0")  # newer than the point: not one to restore it from
    other_rows, other_started = _rows(cluster, "shard-1"), _server_started(cluster, "shard-1")

    restored = restores.restore_shard("shard-0", target_name=point.name)
    print(f"restored shard-0 in {restored.seconds} s (timeline {restored.timeline})")
    assert restored.backup == backup, "the newest backup before the point"

    assert _rows(cluster, "shard-0") == at_point, "exactly the rows up to the restore point"
    keys = _keys(cluster, "shard-0")
    assert {k for k, _, _ in before} <= keys
    assert not {k for k, _, _ in after} & keys, "the idempotency records after the point are gone"
    assert restored.timeline == backup.timeline + 1
    assert _rows(cluster, "shard-1") == other_rows and _server_started(cluster, "shard-1") == other_started
    # The daemons serve again: a retry of a key from before the point is replayed, new calls apply.
    key, transfer_id, _ = before[0]
    assert _transfer(stub, alice, bob, 100, key) == (key, transfer_id, True)
    assert _balance(stub, alice) == 10_000 - 300
    _deposit(stub, alice, 1)
    assert _balance(stub, alice) == 10_000 - 300 + 1
    assert _balance(stub, carol) == 505
    # What the restore abandoned cannot be restored to any more: refused before anything stops.
    with pytest.raises(ValueError, match="on a history shard-0 left when it was restored"):
        restores.restore_shard("shard-0", late, target_time=datetime.now(UTC))


def test_a_shard_restored_to_a_time_keeps_the_commits_up_to_it_on_its_new_timeline(
    cluster: LocalCluster, stub: transfer_pb2_grpc.TransferServiceStub
) -> None:
    restores = ShardRestores(cluster)
    (dora,) = _accounts_on(cluster, "shard-1", "pitr-t", 1)
    _deposit(stub, dora, 100)
    backup = restores.backup_shard("shard-1")
    kept = _deposit(stub, dora, 20)
    with psycopg.connect(_dsn(cluster, "shard-1"), autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()  # after the commit of `kept`
    assert row is not None
    target: datetime = row[0]
    lost = _deposit(stub, dora, 3)  # committed after `target`
    with pytest.raises(ValueError, match="before backup"):
        restores.restore_shard("shard-1", backup, target_time=backup.finished_at - timedelta(seconds=1))

    restored = restores.restore_shard("shard-1", target_time=target)  # the newest backup before it

    assert restored.backup == backup
    keys = _keys(cluster, "shard-1")
    assert kept in keys and lost not in keys
    assert _balance(stub, dora) == 120
    assert _deposit(stub, dora, 1) and _balance(stub, dora) == 121
    # A time after the last commit keeps everything (no commit follows it in the WAL); a time
    # still to come is refused before anything stops.
    with pytest.raises(ValueError, match="has not passed yet"):
        restores.restore_shard("shard-1", target_time=datetime.now(UTC) + timedelta(hours=1))
    everything = _rows(cluster, "shard-1")
    restores.restore_shard("shard-1", target_time=datetime.now(UTC))
    assert _rows(cluster, "shard-1") == everything


def test_bad_targets_are_refused_before_anything_stops(cluster: LocalCluster) -> None:
    restores = ShardRestores(cluster)
    started = _server_started(cluster, "shard-0")
    with pytest.raises(ValueError, match="exactly one target"):
        restores.restore_shard("shard-0")
    with pytest.raises(ValueError, match="exactly one target"):
        restores.restore_shard("shard-0", target_name="x", target_time=datetime.now(UTC))
    with pytest.raises(ValueError, match="time zone"):
        restores.restore_shard("shard-0", target_time=datetime.now())
    with pytest.raises(ValueError, match="no shard 'shard-9'"):
        restores.restore_shard("shard-9", target_name="x")
    with pytest.raises(ValueError, match="no base backup before the target"):
        restores.restore_shard("shard-0", target_time=datetime(2000, 1, 1, tzinfo=UTC))
    assert _server_started(cluster, "shard-0") == started


def test_an_unreachable_target_leaves_the_shard_on_the_data_it_had(
    cluster: LocalCluster, stub: transfer_pb2_grpc.TransferServiceStub
) -> None:
    restores = ShardRestores(cluster)
    (erin,) = _accounts_on(cluster, "shard-0", "pitr-u", 1)
    restores.backup_shard("shard-0")
    _deposit(stub, erin, 42)
    rows = _rows(cluster, "shard-0")
    with pytest.raises(pitr.RestoreError, match="runs on its earlier data again"):
        restores.restore_shard("shard-0", target_name="no-such-point")
    assert _rows(cluster, "shard-0") == rows
    assert _balance(stub, erin) == 42  # and its daemons serve
    assert not list(cluster.data_dir.glob(f"*{pitr.SET_ASIDE_SUFFIX}"))


def test_the_dev_commands_back_up_mark_and_restore_through_the_running_cluster(
    cluster: LocalCluster, stub: transfer_pb2_grpc.TransferServiceStub, capsys: pytest.CaptureFixture[str]
) -> None:
    restores = ShardRestores(cluster)
    (fred,) = _accounts_on(cluster, "shard-1", "pitr-c", 1)
    controls = cli._serve_controls(cluster)
    assert controls is not None
    where = ["--data-dir", str(cluster.data_dir)]
    try:
        _deposit(stub, fred, 10)
        assert cli.main(["backup", "shard-1", *where]) == 0
        assert "Base backup" in capsys.readouterr().out
        _deposit(stub, fred, 20)
        assert cli.main(["restore-point", "shard-1", "cli-point", *where]) == 0
        assert "Restore point 'cli-point' of shard-1" in capsys.readouterr().out
        _deposit(stub, fred, 40)
        assert cli.main(["restore-point", "shard-1", "cli-point", *where]) == 1
        assert "has a restore point named 'cli-point' already" in capsys.readouterr().err
        assert cli.main(["restore", "shard-1", "--point", "cli-point", *where]) == 0
        out = capsys.readouterr().out
        assert "Restored shard-1 from backup" in out and "reconcile" in out
        assert _balance(stub, fred) == 30
        newest = restores.backup_shard("shard-1")
        assert cli.main(["backups", "shard-1", *where]) == 0
        listed = capsys.readouterr().out
        assert "restore point 'cli-point'" in listed and listed.count("backup ") >= 2
        # Trimming: the newest backup stays, older ones and the WAL before it go.
        assert cli.main(["backups", "shard-1", "--keep", "1", *where]) == 0
        assert "deleted backup" in capsys.readouterr().out
        assert restores.backups("shard-1") == [newest]
        first_kept = pitr._segment_name(newest.start_lsn, newest.timeline)
        segments = [n for n in _archived_segments(cluster, "shard-1") if not n.endswith(".history")]
        assert segments and all(n[8:24] >= first_kept[8:] for n in segments), (first_kept, segments)
    finally:
        controls.stop()


def test_with_a_standby_the_standby_is_made_afresh_from_the_restored_primary() -> None:
    data_dir = pg_data_dir()
    cluster = LocalCluster(
        data_dir=data_dir,
        shards=1,
        replicas=1,
        standby=True,
        router_port=free_port(),
        http_port=0,
        metrics=False,
    )
    cluster.start()
    restores = ShardRestores(cluster)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{cluster.router_port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            _deposit(stub, "gus", 5)
            restores.backup_shard("shard-0")
            _deposit(stub, "gus", 10)
            restores.restore_point("shard-0", "standby-drill")
            _deposit(stub, "gus", 100)
            restored = restores.restore_shard("shard-0", target_name="standby-drill")
            print(f"restored shard-0 with its standby in {restored.seconds} s")
            assert _balance(stub, "gus") == 15
            _deposit(stub, "gus", 1)  # a synchronous commit: the new standby acknowledges it
        (db,) = cluster.databases
        assert isinstance(db, ReplicatedPostgres)
        (row,) = db.replication()
        assert row["state"] == "streaming" and row["sync_state"] == "sync"
        with psycopg.connect(db.standby.dsn_for("shardd"), autocommit=True) as standby:
            recovery = standby.execute("SELECT pg_is_in_recovery()").fetchone()
        assert recovery == (True,)
    finally:
        cluster.stop()
        shutil.rmtree(data_dir.parent, ignore_errors=True)


def test_what_a_restore_left_behind_is_not_on_the_current_history(tmp_path: Path) -> None:
    # Timeline 3 branched from 2 at 0/5000000, which had branched from 1 at 0/3000160.
    (tmp_path / "00000003.history").write_text(
        "1\t0/3000160\tafter point drill\n2\t0/5000000\tbefore 2026-12-05 04:30:00+00\n"
    )
    history = pitr.timeline_history(tmp_path, 3)
    assert history == {1: pitr.lsn_value("0/3000160"), 2: pitr.lsn_value("0/5000000")}
    assert pitr.on_history(3, "0/9000000", 3, history)
    assert pitr.on_history(1, "0/2000120", 3, history)
    assert not pitr.on_history(1, "0/4000000", 3, history), "timeline 1 after its switch: abandoned"
    assert pitr.on_history(2, "0/4FFFFFF", 3, history)
    assert not pitr.on_history(4, "0/1000000", 3, history)
    assert pitr.timeline_history(tmp_path, 1) == {}
    assert pitr.lsn_value("1/0") == 1 << 32
