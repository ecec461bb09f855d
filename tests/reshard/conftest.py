"""The `pair` fixture: two in-process shard daemons (gRPC on loopback, relays on) over two new
databases of the session's PostgreSQL, following one shard map file that they re-read every 0.1 s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shardrouter.localcluster.postgres import LocalPostgres
from tests.reshard.cluster import Pair, new_pair, start_daemons


@pytest.fixture
def pair(postgres: LocalPostgres, tmp_path: Path) -> Iterator[Pair]:
    cluster = new_pair(postgres, tmp_path)
    daemons = start_daemons(cluster)
    yield cluster
    cluster.close()
    for daemon in daemons.values():
        daemon.stop(0.2)
