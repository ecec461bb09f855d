"""A shard daemon follows the shard map without a restart: from a new version on it refuses the
accounts it no longer owns, and a stale copy of the file cannot give them back."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc
import pytest
import yaml

from shardrouter.core.errors import ERROR_DOMAIN
from shardrouter.core.shardmap import parse_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd.server import start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, make_settings, money


def _doc(version: int, ports: dict[str, int], first: str, second: str) -> dict[str, object]:
    """shard `first` owns the lower half of the slots, `second` the upper half."""
    return {
        "version": version,
        "shards": [
            {"id": first, "address": f"127.0.0.1:{ports[first]}", "slot_ranges": [[0, 8191]]},
            {"id": second, "address": f"127.0.0.1:{ports[second]}", "slot_ranges": [[8192, 16383]]},
        ],
    }


def _deposit(stub: transfer_pb2_grpc.TransferServiceStub, account: str) -> grpc.StatusCode:
    try:
        stub.Deposit(
            transfer_pb2.DepositRequest(account_id=account, amount=money(1)),
            metadata=key_metadata(),
            timeout=5,
        )
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_a_shard_follows_the_map_and_refuses_what_it_no_longer_owns(
    postgres: LocalPostgres, tmp_path: Path
) -> None:
    ports = {"shard-a": free_port(), "shard-b": free_port()}
    map_path = tmp_path / "shard-map.yaml"
    map_path.write_text(yaml.safe_dump(_doc(1, ports, "shard-a", "shard-b")))
    v1 = parse_shard_map(_doc(1, ports, "shard-a", "shard-b"), source="v1")
    account = next(a for a in (f"acct-{i}" for i in range(1000)) if v1.shard_for(a).id == "shard-b")
    name = f"x{uuid.uuid4().hex[:10]}"
    postgres.create_database(name)
    daemon = start_shard(
        make_settings(
            postgres.dsn_for(name),
            shard_id="shard-b",
            listen=f"127.0.0.1:{ports['shard-b']}",
            shard_map=str(map_path),
            shard_map_reload_s=0.05,
            relay_workers=0,
        )
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    try:
        assert _deposit(stub, account) is grpc.StatusCode.OK

        # Version 2 gives the account's half to shard-a.
        map_path.write_text(yaml.safe_dump(_doc(2, ports, "shard-b", "shard-a")))
        deadline = time.monotonic() + 5
        while daemon.shard_map is not None and daemon.shard_map.version != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.shard_map is not None and daemon.shard_map.version == 2
        with pytest.raises(grpc.RpcError) as caught:
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id=account, amount=money(1)),
                metadata=key_metadata(),
                timeout=5,
            )
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE  # retryable: through the router
        assert "belongs to shard-a" in (caught.value.details() or "")
        assert ERROR_DOMAIN in str(caught.value.trailing_metadata())

        # A stale copy of version 1 comes back (a lagging ConfigMap replica): it is refused.
        map_path.write_text(yaml.safe_dump(_doc(1, ports, "shard-a", "shard-b")))
        time.sleep(0.4)
        assert daemon.shard_map.version == 2
        assert _deposit(stub, account) is grpc.StatusCode.UNAVAILABLE

        # Version 3 gives it back.
        map_path.write_text(yaml.safe_dump(_doc(3, ports, "shard-a", "shard-b")))
        deadline = time.monotonic() + 5
        while daemon.shard_map.version != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _deposit(stub, account) is grpc.StatusCode.OK
    finally:
        channel.close()
        daemon.stop(0.2)
