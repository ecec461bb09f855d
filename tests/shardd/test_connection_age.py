"""A shard daemon ages out its clients' connections too (SHARDD_MAX_CONNECTION_AGE_S), so a router's
connections spread again over a shard's daemons after one was replaced."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardrouter.shardd.server import ShardDaemon, start_shard
from tests.connections import connection_drops
from tests.helpers import make_settings

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
PROBE = b""  # an empty HealthCheckRequest: the whole server


@pytest.fixture(params=[1.0, 0.0], ids=["aged", "not-aged"])
def aged_shard(request: pytest.FixtureRequest, database: str) -> Iterator[tuple[ShardDaemon, float]]:
    daemon = start_shard(make_settings(database, max_connection_age_s=request.param))
    try:
        yield daemon, request.param
    finally:
        daemon.stop(0.2)


def test_clients_reconnect_after_the_connection_age(aged_shard: tuple[ShardDaemon, float]) -> None:
    daemon, age = aged_shard
    drops = connection_drops(f"127.0.0.1:{daemon.port}", HEALTH_CHECK, PROBE, watch_s=3.5)
    if age:
        assert drops >= 2
    else:
        assert drops == 0  # the control: without an age the one connection stays
