"""Moving a slot range between two shards: under load with duplicates, resumed after a stop at
every phase, aborted at every phase, and refused when it cannot be done.

Two real shard daemons (gRPC on loopback, relays on) over two databases of a real PostgreSQL
(wal_level=logical), following one shard map file (`conftest.pair`); the move uses PostgreSQL's own
logical replication between them.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path

import grpc
import psycopg
import pytest

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import load_shard_map
from shardrouter.localcluster.postgres import free_port
from shardrouter.reshard.move import Move, MoveSettings, find_move, start_move
from shardrouter.reshard.plan import MoveError, Phase
from shardrouter.reshard.verify import digests, rows_in_range
from shardrouter.shardd.migrations import FENCED_TABLES
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import error_info, key_metadata, make_settings, money
from tests.reshard.cluster import (
    FIRST,
    LAST,
    SEEDED,
    Load,
    Pair,
    accounts,
    assert_no_leftovers,
    assert_replays_match,
    check_ledger,
    seed,
    send,
)

QUICK = MoveSettings(copy_timeout_s=30, catch_up_timeout_s=30, final_sync_timeout_s=30)
#: Every phase a move can be stopped after and resumed from.
STOPS = [Phase.PREPARED, Phase.COPIED, Phase.CAUGHT_UP, Phase.FENCED, Phase.VERIFIED, Phase.COMMITTED]
#: Every phase a move can be aborted from (before the commit).
ABORTABLE = [Phase.PLANNED, Phase.PREPARED, Phase.COPIED, Phase.CAUGHT_UP, Phase.FENCED, Phase.VERIFIED]
#: The phases the default suite sweeps here: the others, with --run-slow. Each left out is resumed
#: or aborted in every suite by `test_orchestrator_kill.py`'s default kills (prepared, fenced and
#: committed resumed; copied and verified aborted), after an orchestrator killed there.
DEFAULT_STOPS = {Phase.COPIED, Phase.CAUGHT_UP, Phase.VERIFIED}
DEFAULT_ABORTS = {Phase.PLANNED, Phase.PREPARED, Phase.CAUGHT_UP, Phase.FENCED}


def _sweep(phases: list[Phase], default: set[Phase]) -> list[object]:
    return [pytest.param(p, id=p.value, marks=() if p in default else pytest.mark.slow) for p in phases]


def _deposit_refused_by(pair: Pair, shard_id: str, account: str) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        pair.stub(shard_id).Deposit(
            transfer_pb2.DepositRequest(account_id=account, amount=money(1)),
            metadata=key_metadata(),
            timeout=5,
        )
    return refused.value.code()  # type: ignore[no-any-return]


def test_a_move_under_load_applies_every_key_once_and_replays_after(pair: Pair) -> None:
    moving, staying = accounts(pair, 12)
    everyone = moving + staying
    seed(pair, everyone)
    old_map = load_shard_map(pair.map_path)
    load = Load(pair.call, everyone)
    load.start()
    time.sleep(1.0)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    try:
        with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
            move.run(until=Phase.FENCED)
            # From the fence on, nothing changes the range on the old owner, whatever the load does.
            with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
                at_fence = digests(conn, record.plan)
                time.sleep(0.5)
                assert digests(conn, record.plan) == at_fence
            move.run()
        time.sleep(1.0)  # load after the cut-over too
    finally:
        load.stop()

    assert record.phase is Phase.DONE
    assert sum(record.figures["rows_moved"].values()) > 0
    assert {t: d.rows for t, d in at_fence.items()} == record.figures["rows_moved"]
    assert load.mismatches == []
    assert load.ok_count() > 50, f"the load barely ran: {load.ok_count()} successful calls"
    new_map = load_shard_map(pair.map_path)
    assert new_map.version == old_map.version + 1
    assert all(pair.owner(a, new_map) == "shard-1" for a in moving)
    # Every retry after the move, through the map in force, is a verbatim replay.
    assert_replays_match(load, pair)
    check_ledger(pair, len(everyone), load.deposited())
    # The old owner holds nothing of the range and refuses it for good; nothing is left behind.
    with psycopg.connect(pair.dsns["shard-0"], autocommit=True) as conn:
        assert sum(rows_in_range(conn, record.plan).values()) == 0
    assert _deposit_refused_by(pair, "shard-0", moving[0]) is grpc.StatusCode.UNAVAILABLE
    assert_no_leftovers(pair)


@pytest.mark.parametrize("stop", _sweep(STOPS, DEFAULT_STOPS))
def test_a_move_stopped_after_any_phase_resumes_from_its_journal(pair: Pair, stop: Phase) -> None:
    moving, staying = accounts(pair, 4)
    seed(pair, moving + staying)
    answers = {a: pair.sql("shard-0", "SELECT balance FROM accounts WHERE id = %s", (a,)) for a in moving}
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=stop)
    assert record.phase is stop
    # A new orchestrator knows only the move's id: everything else comes from the journal.
    resumed = find_move(pair.databases, record.plan.move_id)
    assert resumed.phase is stop and resumed.objects == record.objects
    with Move(resumed, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run()
    assert resumed.phase is Phase.DONE
    assert all(pair.owner(a) == "shard-1" for a in moving)
    assert {
        a: pair.sql("shard-1", "SELECT balance FROM accounts WHERE id = %s", (a,)) for a in moving
    } == answers
    seed(pair, moving, 1)  # the new owner takes writes for the range
    check_ledger(pair, len(moving) + len(staying), len(moving))
    assert_no_leftovers(pair)


@pytest.mark.parametrize("at", _sweep(ABORTABLE, DEFAULT_ABORTS))
def test_an_abort_at_any_phase_before_the_commit_leaves_nothing_behind(pair: Pair, at: Phase) -> None:
    moving, staying = accounts(pair, 4)
    seed(pair, moving + staying)
    version = load_shard_map(pair.map_path).version
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=at)
        move.abort()
    assert record.phase is Phase.ABORTED
    assert find_move(pair.databases, record.plan.move_id).phase is Phase.ABORTED
    assert load_shard_map(pair.map_path).version == version
    with psycopg.connect(pair.dsns["shard-1"], autocommit=True) as conn:
        assert sum(rows_in_range(conn, record.plan).values()) == 0
    for sid in pair.dsns:
        assert pair.sql(sid, "SELECT move_id FROM slot_fences") == []
    assert_no_leftovers(pair)
    seed(pair, moving, 1)  # the old owner takes writes again
    check_ledger(pair, len(moving) + len(staying), len(moving))
    with pytest.raises(MoveError, match="aborted"):
        with Move(record, map_store=pair.map_path, databases=pair.databases) as move:
            move.run()


def test_a_committed_move_cannot_be_aborted(pair: Pair) -> None:
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases) as move:
        move.run(until=Phase.COMMITTED)
        with pytest.raises(MoveError, match="committed"):
            move.abort()
        move.run()
    assert record.phase is Phase.DONE


def test_a_move_back_returns_the_range_and_lifts_the_old_marker(pair: Pair) -> None:
    moving, _ = accounts(pair, 3)
    seed(pair, moving, 50)
    there = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(there, map_store=pair.map_path, databases=pair.databases) as move:
        move.run()
    back = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-0")
    with Move(back, map_store=pair.map_path, databases=pair.databases) as move:
        move.run()
    assert all(pair.owner(a) == "shard-0" for a in moving)
    seed(pair, moving, 1)  # the old owner takes them again: the moved-out marker is gone
    assert pair.sql("shard-0", "SELECT move_id FROM slot_fences") == []
    assert [m for (m,) in pair.sql("shard-1", "SELECT move_id FROM slot_fences")] == [back.plan.move_id]
    assert set(FENCED_TABLES) <= {t for (t,) in pair.sql("shard-0", "SELECT tablename::text FROM pg_tables")}
    assert_no_leftovers(pair)


def test_keys_dated_by_receipt_move_with_their_account_and_replay_on_the_new_owner(pair: Pair) -> None:
    """An opaque key and a version 4 UUID: their records move with the account (found on the new
    owner by (scope, key), in whatever partition their first receipt dated them), and a retry there
    replays instead of applying again."""
    (account,), _ = accounts(pair, 1)
    keys = ["deposit/" + uuid.uuid4().hex + ":A", str(uuid.uuid4()).upper()]
    request = transfer_pb2.DepositRequest(account_id=account, amount=money(21))
    first = {
        k: pair.stub("shard-0").Deposit(request, metadata=[("idempotency-key", k)], timeout=5) for k in keys
    }
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run()
    assert pair.owner(account) == "shard-1"
    for key in keys:
        again, call = pair.stub("shard-1").Deposit.with_call(
            request, metadata=[("idempotency-key", key)], timeout=5
        )
        assert again.SerializeToString() == first[key].SerializeToString()
        assert dict(call.trailing_metadata())["idempotency-replayed"] == "true"
        stored = key if key.startswith("deposit/") else key.lower()
        for shard, entries in (("shard-0", 0), ("shard-1", 1)):
            assert pair.sql(
                shard, "SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (stored,)
            ) == [(entries,)]
    assert_no_leftovers(pair)


def test_moves_that_cannot_be_done_are_refused_with_the_reason(pair: Pair) -> None:
    with pytest.raises(MoveError, match="not in the shard map"):
        start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-9")
    with pytest.raises(MoveError, match="already belong to shard-0"):
        start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-0")
    slots = load_shard_map(pair.map_path).slots
    with pytest.raises(MoveError, match="owned by shard-0, shard-1"):
        start_move(pair.map_path, pair.databases, 0, slots - 1, "shard-1")
    first = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with pytest.raises(MoveError, match=f"move {first.plan.move_id} .* still planned"):
        start_move(pair.map_path, pair.databases, FIRST + 1, LAST - 1, "shard-1")
    with Move(first, map_store=pair.map_path, databases=pair.databases) as move:
        move.abort()
    assert_no_leftovers(pair)


def test_a_row_that_differs_after_the_copy_stops_the_move_before_the_commit(pair: Pair) -> None:
    moving, _ = accounts(pair, 4)
    seed(pair, moving)
    version = load_shard_map(pair.map_path).version
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run(until=Phase.FENCED)
        slot = load_shard_map(pair.map_path).slot_of(moving[0])
        # A stored response damaged on the new owner (past its fence, as only a person could).
        with psycopg.connect(pair.dsns["shard-1"], autocommit=True) as conn, conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute(
                "UPDATE idempotency_record SET response = response || '\\x00'::bytea"
                " WHERE account_hash = (SELECT account_hash FROM accounts WHERE id = %s)",
                (moving[0],),
            )
        with pytest.raises(
            MoveError, match=f"idempotency_record: .* slots that differ: {slot}; stream: final position "
        ):
            move.run()
        assert record.phase is Phase.FENCED
        assert load_shard_map(pair.map_path).version == version
        move.abort()
    assert all(pair.owner(a) == "shard-0" for a in moving)
    seed(pair, moving, 1)
    check_ledger(pair, len(moving), len(moving))
    assert_no_leftovers(pair)


def test_a_daemon_on_a_stale_map_copy_follows_its_database_for_a_moved_account(
    pair: Pair, tmp_path: Path
) -> None:
    moving, staying = accounts(pair, 20)
    local_source = next(a for a in staying if pair.owner(a) == "shard-0")
    moving = moving[:2]
    seed(pair, [*moving, local_source])
    stale_map = tmp_path / "stale-shard-map.yaml"
    shutil.copy(pair.map_path, stale_map)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        move.run()
    port = free_port()
    stale = start_shard(
        make_settings(
            pair.dsns["shard-0"], shard_id="shard-0", listen=f"127.0.0.1:{port}", shard_map=str(stale_map)
        )
    )
    key = new_key()
    request = transfer_pb2.TransferRequest(
        source_account_id=local_source, destination_account_id=moving[0], amount=money(5)
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            # Its rows are gone from here, and its database says where they went: the read is
            # refused naming the owner, the range and the version (the router follows it).
            with pytest.raises(grpc.RpcError) as read:
                stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=moving[0]), timeout=5)
            assert read.value.code() is grpc.StatusCode.UNAVAILABLE
            info, _ = error_info(read.value)
            assert info.reason == "ACCOUNT_MOVED"
            assert info.metadata["owner_shard_id"] == "shard-1"
            assert info.metadata["slot_range"] == f"{FIRST}-{LAST}"
            assert int(info.metadata["map_version"]) > load_shard_map(stale_map).version
            # A transfer to it is a cross-shard transfer, whatever the stale map says.
            answer = stub.Transfer(request, metadata=key_metadata(key), timeout=5)
    finally:
        stale.stop(0.2)
    transfer_id = answer.transfer.transfer_id
    assert pair.sql(
        "shard-0", "SELECT destination_shard_id FROM transfers WHERE id = %s", (transfer_id,)
    ) == [("shard-1",)]
    # The same key through the map in force: the first answer, applied once.
    again = send(pair, "Transfer", request, key, local_source)
    assert not isinstance(again, grpc.RpcError), again
    assert again.transfer.transfer_id == transfer_id  # type: ignore[attr-defined]
    check_ledger(pair, len(moving) + 1, 0)


def test_preparing_a_move_beside_a_long_transaction_neither_waits_nor_stalls_the_shard(pair: Pair) -> None:
    moving, staying = accounts(pair, 2)
    local = [a for a in staying if pair.owner(a) == "shard-0"] or moving
    seed(pair, moving + staying)
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with psycopg.connect(pair.dsns["shard-0"]) as long_reader:
        long_reader.execute("SELECT count(*) FROM accounts")  # holds a lock until its transaction ends
        with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
            preparing = threading.Thread(target=move.run, kwargs={"until": Phase.PREPARED})
            preparing.start()
            # The replica identity is permanent (migration 15): the prepare takes no table lock
            # the reader's conflicts with, so it ends while the reader is still open.
            preparing.join(5)
            assert not preparing.is_alive(), "the prepare waited for the long transaction"
            assert record.phase is Phase.PREPARED
            answer = pair.stub("shard-0").Deposit(
                transfer_pb2.DepositRequest(account_id=local[0], amount=money(1)),
                metadata=key_metadata(),
                timeout=2,
            )
            assert answer.balance.amount_minor == SEEDED + 1
            long_reader.rollback()
            move.abort()
    assert_no_leftovers(pair)


def test_the_old_owner_names_the_new_one_at_once_however_long_its_map_poll(pair: Pair) -> None:
    moving, _ = accounts(pair, 1)
    seed(pair, moving)
    port = free_port()
    slow = start_shard(
        make_settings(
            pair.dsns["shard-0"],
            shard_id="shard-0",
            listen=f"127.0.0.1:{port}",
            shard_map=str(pair.map_path),
            shard_map_reload_s=60,
        )
    )
    try:
        record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
        with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
            move.run()
        reasons = []
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Deposit(
                        transfer_pb2.DepositRequest(account_id=moving[0], amount=money(1)),
                        metadata=key_metadata(),
                        timeout=5,
                    )
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
                info, _ = error_info(refused.value)
                reasons.append((info.reason, dict(info.metadata)))
                time.sleep(0.05)
    finally:
        slow.stop(0.2)
    # Its 60 s poll has not come round: the fence it met made it read the map there and then.
    assert reasons[0][0] in ("SLOT_RANGE_MOVING", "ACCOUNT_MOVED")
    assert reasons[1] == (
        "ACCOUNT_MOVED",
        {"owner_shard_id": "shard-1", "map_version": "2", "slot_range": f"{FIRST}-{LAST}", "slots": "16384"},
    )


def test_a_range_with_cross_shard_transfers_moves_there_back_and_there_again(pair: Pair) -> None:
    moving, staying = accounts(pair, 6)
    seed(pair, moving + staying)
    deposited = 0
    for round_ in range(3):
        for src, dst in zip(moving, staying, strict=True):  # outbox rows and delivery attempts
            answer = send(
                pair,
                "Transfer",
                transfer_pb2.TransferRequest(
                    source_account_id=src, destination_account_id=dst, amount=money(3)
                ),
                new_key(),
                src,
            )
            assert not isinstance(answer, grpc.RpcError), answer
        target = "shard-1" if round_ % 2 == 0 else "shard-0"
        record = start_move(pair.map_path, pair.databases, FIRST, LAST, target)
        with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
            move.run()
        assert record.figures["rows_moved"]["outbox"] > 0
        assert all(pair.owner(a) == target for a in moving)
    check_ledger(pair, len(moving) + len(staying), deposited)
    assert_no_leftovers(pair)


def test_shards_drawing_ids_from_one_block_cannot_move_rows_between_them(pair: Pair) -> None:
    moving, staying = accounts(pair, 2)
    seed(pair, moving + staying)
    send(
        pair,
        "Transfer",
        transfer_pb2.TransferRequest(
            source_account_id=moving[0], destination_account_id=staying[0], amount=money(1)
        ),
        new_key(),
        moving[0],
    )
    (source_seq,) = pair.sql("shard-0", "SELECT last_value FROM outbox_id_seq")[0]
    pair.sql("shard-1", "SELECT setval('outbox_id_seq', %s)", (int(source_seq) + 1000,))  # type: ignore[call-overload]
    record = start_move(pair.map_path, pair.databases, FIRST, LAST, "shard-1")
    with Move(record, map_store=pair.map_path, databases=pair.databases, settings=QUICK) as move:
        with pytest.raises(MoveError, match="draw ids from the same block"):
            move.run()
        move.abort()
    assert_no_leftovers(pair)
