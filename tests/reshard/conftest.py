"""The `pair` fixture: two in-process shard daemons (gRPC on loopback, relays on) over two new
databases of the session's PostgreSQL, following one shard map file that they re-read every 0.1 s."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardrouter.core.shardmap import even_shard_map, write_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd.server import ShardDaemon, start_shard
from tests.conftest import make_settings
from tests.reshard.cluster import Pair


def new_pair(postgres: LocalPostgres, tmp_path: Path) -> Pair:
    """Two new databases and a map file giving each shard half of the slots (version 1)."""
    ports = {"shard-0": free_port(), "shard-1": free_port()}
    map_path = tmp_path / "shard-map.yaml"
    write_shard_map(map_path, even_shard_map({s: f"127.0.0.1:{p}" for s, p in ports.items()}, version=1))
    dsns = {}
    for sid in ports:
        name = f"mv{uuid.uuid4().hex[:10]}"
        postgres.create_database(name)
        dsns[sid] = postgres.dsn_for(name)
    return Pair(map_path, dsns, ports)


def start_daemons(pair: Pair, *, metrics: bool = False) -> dict[str, ShardDaemon]:
    """An in-process daemon per shard of `pair`, on its port, following its map file (re-read every
    0.1 s), relays on; with `metrics`, each serves /metrics on a free loopback port."""
    return {
        sid: start_shard(
            make_settings(
                pair.dsns[sid],
                shard_id=sid,
                listen=f"127.0.0.1:{port}",
                shard_map=str(pair.map_path),
                shard_map_reload_s=0.1,
                relay_workers=1,
                **({"metrics_port": free_port()} if metrics else {}),
            ),
            metrics_host="127.0.0.1" if metrics else None,
        )
        for sid, port in pair.ports.items()
    }


@pytest.fixture
def pair(postgres: LocalPostgres, tmp_path: Path) -> Iterator[Pair]:
    cluster = new_pair(postgres, tmp_path)
    daemons = start_daemons(cluster)
    yield cluster
    cluster.close()
    for daemon in daemons.values():
        daemon.stop(0.2)
