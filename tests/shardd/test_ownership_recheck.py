"""A shard daemon decides ownership by the newest shard map in its file, not the last one it polled.

Before refusing an account as another shard's, it reads its map file again: a daemon that just became
the owner serves at once, and one that just lost it refuses with UNAVAILABLE ACCOUNT_MOVED naming the
new owner and the map's version, nothing applied. Real daemons (gRPC on loopback) over real PostgreSQL;
their map polls are 60 s apart, so only the on-demand re-read can explain what they answer.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from shardrouter.core.errors import Reason
from shardrouter.core.keys import new_key
from shardrouter.core.ownership import RangeOwner
from shardrouter.core.shardmap import DEFAULT_SLOTS, ShardMap, parse_shard_map, write_shard_map
from shardrouter.internal.v1 import ledger_pb2, ledger_pb2_grpc
from shardrouter.localcluster.postgres import free_port
from shardrouter.shardd import fences
from shardrouter.shardd.fences import SlotFence
from shardrouter.shardd.ownership import record_owner
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import error_info, key_metadata, make_settings, money

SLOW_POLL_S = 60.0


def _map(version: int, lower: str, ports: dict[str, int]) -> ShardMap:
    """Shard `lower` owns slots 0..8191, the other one 8192..16383."""
    upper = next(s for s in ports if s != lower)
    return parse_shard_map(
        {
            "version": version,
            "shards": [
                {"id": lower, "address": f"127.0.0.1:{ports[lower]}", "slot_ranges": [[0, 8191]]},
                {"id": upper, "address": f"127.0.0.1:{ports[upper]}", "slot_ranges": [[8192, 16383]]},
            ],
        },
        source=f"v{version}",
    )


ACCOUNT = next(
    a for a in (f"acct-{i}" for i in range(10_000)) if zlib.crc32(a.encode()) % DEFAULT_SLOTS < 8192
)


@pytest.fixture
def ports() -> dict[str, int]:
    return {"shard-a": free_port(), "shard-b": free_port()}


@pytest.fixture
def map_path(tmp_path: Path, ports: dict[str, int]) -> Path:
    path = tmp_path / "shard-map.yaml"
    write_shard_map(path, _map(1, "shard-a", ports))  # ACCOUNT is shard-a's
    return path


Serve = Callable[..., tuple[ShardDaemon, grpc.Channel]]


@pytest.fixture
def serve(database: str, ports: dict[str, int], map_path: Path) -> Iterator[Serve]:
    """Starts a daemon of the given shard over the test database (its polls a minute apart unless
    told) and opens a channel to it; both are closed afterwards."""
    started: list[tuple[ShardDaemon, grpc.Channel]] = []

    def start(shard_id: str, reload_s: float = SLOW_POLL_S) -> tuple[ShardDaemon, grpc.Channel]:
        daemon = start_shard(
            make_settings(
                database,
                shard_id=shard_id,
                listen=f"127.0.0.1:{ports[shard_id]}",
                shard_map=str(map_path),
                shard_map_reload_s=reload_s,
            )
        )
        started.append((daemon, grpc.insecure_channel(f"127.0.0.1:{daemon.port}")))
        return started[-1]

    yield start
    for daemon, channel in started:
        channel.close()
        daemon.stop(0.2)


def test_a_daemon_that_just_became_the_owner_serves_at_once(
    serve: Serve, ports: dict[str, int], map_path: Path
) -> None:
    daemon, channel = serve("shard-b")
    write_shard_map(map_path, _map(2, "shard-b", ports))  # the move commits; the next poll is a minute away
    assert daemon.shard_map is not None and daemon.shard_map.version == 1
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    response = stub.Deposit(
        transfer_pb2.DepositRequest(account_id=ACCOUNT, amount=money(3)), metadata=key_metadata(), timeout=5
    )
    assert response.balance.amount_minor == 3
    assert daemon.shard_map.version == 2


def test_a_daemon_that_lost_the_account_refuses_it_as_moved_with_nothing_applied(
    serve: Serve, database: str, ports: dict[str, int], map_path: Path
) -> None:
    # A daemon re-reads the file only before refusing: one that still thinks it owns the account
    # learns of the move at its next poll (its database's fence refuses writes meanwhile).
    daemon, channel = serve("shard-a", reload_s=0.05)
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    stub.Deposit(transfer_pb2.DepositRequest(account_id=ACCOUNT, amount=money(3)), metadata=key_metadata())
    write_shard_map(map_path, _map(2, "shard-b", ports))
    deadline = time.monotonic() + 5
    while daemon.shard_map is not None and daemon.shard_map.version != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    metadata = key_metadata()
    with pytest.raises(grpc.RpcError) as refused:
        stub.Deposit(
            transfer_pb2.DepositRequest(account_id=ACCOUNT, amount=money(3)), metadata=metadata, timeout=5
        )
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    info, retry = error_info(refused.value)
    assert info.reason == Reason.ACCOUNT_MOVED and retry
    # The owner, the version, and the whole map range it holds (a router keeps it for later calls).
    assert dict(info.metadata) == {
        "owner_shard_id": "shard-b",
        "map_version": "2",
        "slot_range": "0-8191",
        "slots": "16384",
    }
    assert "belongs to shard-b" in (refused.value.details() or "")
    with psycopg.connect(database, autocommit=True) as conn:
        key = uuid.UUID(metadata[0][1])
        assert conn.execute(
            "SELECT count(*) FROM idempotency_record WHERE key = %s", (str(key),)
        ).fetchone() == (0,)
        assert conn.execute("SELECT balance FROM accounts WHERE id = %s", (ACCOUNT,)).fetchone() == (3,)
    # Reads are refused the same way.
    with pytest.raises(grpc.RpcError) as read_refused:
        stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=ACCOUNT), timeout=5)
    assert error_info(read_refused.value)[0].reason == Reason.ACCOUNT_MOVED


def test_a_moved_account_is_refused_as_moved_before_its_fenced_slot_is_touched(
    serve: Serve, database: str, ports: dict[str, int], map_path: Path
) -> None:
    """After a move the old owner's database keeps the slot fenced; a call there is still told who owns
    the account (ACCOUNT_MOVED), not just that the slot is moving, and a key it completed before the
    move is not replayed here: its record moved with the account."""
    daemon, channel = serve("shard-a", reload_s=0.05)
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    metadata = key_metadata()
    request = transfer_pb2.DepositRequest(account_id=ACCOUNT, amount=money(3))
    stub.Deposit(request, metadata=metadata)  # completed here: this process remembers the answer
    with psycopg.connect(database, autocommit=True) as conn:
        slot = zlib.crc32(ACCOUNT.encode()) % DEFAULT_SLOTS
        fences.raise_fence(conn, SlotFence("move-1", DEFAULT_SLOTS, slot, slot))
        with conn.transaction():  # what the move's commit records beside the fence
            record_owner(conn, "move-1", RangeOwner(DEFAULT_SLOTS, slot, slot, "shard-b", 2))
    write_shard_map(map_path, _map(2, "shard-b", ports))
    deadline = time.monotonic() + 5
    while daemon.shard_map is not None and daemon.shard_map.version != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    for call_metadata in (key_metadata(), metadata):  # a new key, and the completed one
        with pytest.raises(grpc.RpcError) as refused:
            stub.Deposit(request, metadata=call_metadata, timeout=5)
        info, _ = error_info(refused.value)
        assert info.reason == Reason.ACCOUNT_MOVED
        assert info.metadata["owner_shard_id"] == "shard-b"


def test_a_credit_for_an_account_another_shard_owns_is_refused_retryably_not_stored(
    serve: Serve, database: str
) -> None:
    """A relay whose map disagrees with this shard's must retry the credit (at the owner it finds
    next), not dead-letter and refund it on a stored NOT_FOUND."""
    _daemon, channel = serve("shard-b")
    credit = ledger_pb2.CreditTransferRequest(
        transfer_id=str(new_key()),
        source_shard_id="shard-c",
        source_account_id="elsewhere",
        destination_account_id=ACCOUNT,  # shard-a's in every map the file has held
        amount=money(5),
    )
    key = new_key()
    with pytest.raises(grpc.RpcError) as refused:
        ledger_pb2_grpc.ShardLedgerServiceStub(channel).CreditTransfer(
            credit, metadata=[("idempotency-key", str(key))], timeout=5
        )
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    info, _ = error_info(refused.value)
    assert info.reason == Reason.ACCOUNT_MOVED
    assert info.metadata["owner_shard_id"] == "shard-a"
    with psycopg.connect(database, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM idempotency_record WHERE key = %s", (str(key),)
        ).fetchone() == (0,)
