"""The local cluster with every high-availability part on: two daemons per shard and each shard's
PostgreSQL as a primary plus a synchronous standby; it serves, replicates synchronously, and comes
back on a second start with its data (ports are picked afresh per run)."""

from __future__ import annotations

import time

import grpc
import psycopg

from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.localcluster.cluster import LocalCluster
from shardrouter.localcluster.postgres import ReplicatedPostgres, free_port
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import pg_data_dir


def _deposit(port: int, account: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
            transfer_pb2.DepositRequest(
                account_id=account, amount=transfer_pb2.Money(amount_minor=5, currency="EUR")
            ),
            metadata=[(KEY_METADATA, str(new_key()))],
            timeout=10,
        )
    return reply.balance.amount_minor


def test_replicated_cluster_serves_and_restarts() -> None:
    data_dir = pg_data_dir()
    for run, expected in ((1, 5), (2, 10)):
        cluster = LocalCluster(
            # No HTTP front: its default port (8080) is `dev up`'s, which may be running beside the tests.
            data_dir=data_dir,
            shards=1,
            replicas=2,
            standby=True,
            router_port=free_port(),
            http_port=0,
            metrics=False,
        )
        cluster.start()
        try:
            assert [d.name for d in cluster.shard_daemons] == ["shard-0a", "shard-0b"]
            assert _deposit(cluster.router_port, "alice") == expected, f"run {run}"
            (db,) = cluster.databases
            assert isinstance(db, ReplicatedPostgres)
            (row,) = db.replication()
            assert row["state"] == "streaming" and row["sync_state"] == "sync"
            # The standby has the acknowledged deposit: flushed there before the commit returned, and
            # replayed (visible to a read) moments later.
            deadline = time.monotonic() + 5
            with psycopg.connect(db.standby.dsn_for("shardd"), autocommit=True) as standby:
                while True:
                    rows = standby.execute("SELECT balance FROM accounts WHERE id = 'alice'").fetchall()
                    if rows == [(expected,)] or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            assert rows == [(expected,)]
        finally:
            cluster.stop()
