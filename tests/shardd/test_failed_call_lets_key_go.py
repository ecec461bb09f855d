"""A call whose handler transaction failed in the database lets its key go before it is answered.

Closing the connection would let the key's session lock go only once the server's session has
exited, and a retry sent at once (a router resends every 25 ms through a move's cut-over) could
then meet the first attempt's claim and be answered in flight. So when the server answered the
failure, the daemon rolls back and unlocks first, and only then closes the connection: at the
moment it closes, its session holds no advisory lock.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import grpc
import psycopg
import pytest

from shardrouter.core.shardmap import DEFAULT_SLOTS
from shardrouter.shardd import fences
from shardrouter.shardd.fences import SlotFence
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money


@pytest.fixture(params=["ahead", "first"])
def stub(database: str, request: pytest.FixtureRequest) -> Iterator[transfer_pb2_grpc.TransferServiceStub]:
    """A daemon whose claims go with the handler's statements, or before them."""
    daemon = start_shard(make_settings(database, claim_placement=request.param))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            yield transfer_pb2_grpc.TransferServiceStub(channel)
    finally:
        daemon.stop(0.5)


def test_a_deposit_refused_by_a_fence_frees_its_key_before_its_connection_closes(
    stub: transfer_pb2_grpc.TransferServiceStub,
    db: psycopg.Connection[tuple[object, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    account = "fenced-account"
    slot = zlib.crc32(account.encode()) % DEFAULT_SLOTS
    fences.raise_fence(db, SlotFence("move-test", DEFAULT_SLOTS, slot, slot))
    held_at_close: list[int] = []
    close = psycopg.Connection.close

    def close_and_note(conn: psycopg.Connection[object]) -> None:
        if not conn.closed and conn is not db:
            row = db.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
                (conn.info.backend_pid,),
            ).fetchone()
            held_at_close.append(int(row[0]) if row else -1)  # type: ignore[arg-type]
        close(conn)

    monkeypatch.setattr(psycopg.Connection, "close", close_and_note)
    md = key_metadata()
    request = transfer_pb2.DepositRequest(account_id=account, amount=money(5), reference="fenced")
    with pytest.raises(grpc.RpcError) as refused:
        stub.Deposit(request, metadata=md)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert held_at_close == [0]  # the failed call's connection, closed with its key already let go
    # And so the retry that follows at once meets no claim: still refused for the fence, not in flight.
    with pytest.raises(grpc.RpcError) as again:
        stub.Deposit(request, metadata=md)
    assert again.value.code() is grpc.StatusCode.UNAVAILABLE, again.value.details()
    fences.lower_fence(db, "move-test")
    assert stub.Deposit(request, metadata=md).balance == money(5)
