"""The shard map ConfigMap, watched: a change reaches a `ShardMapFile` at once under the version rule,
and the watch outlives dropped streams, a restarted API server and expired versions (a real loopback
fake API server, `tests/kube_fake.py`)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shardrouter.core.kube_configmap import ConfigMapError, KubeConfigMaps
from shardrouter.core.shardmap import (
    ShardMap,
    even_shard_map,
    load_shard_map,
    shard_map_document,
    write_shard_map,
)
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.core.shardmap_watch import (
    DEFAULT_KEY,
    ConfigMapMapWatch,
    ConfigMapSpec,
    parse_configmap_spec,
    watch_shard_map_configmap,
)
from shardrouter.router.settings import RouterSettings
from shardrouter.shardd.settings import ShardSettings
from tests.kube_fake import FakeKube, fake_kube

NS, NAME = "shard-router", "shard-map"
WAIT_S = 5.0


def _map(version: int) -> ShardMap:
    return even_shard_map(
        {"shard-0": "127.0.0.1:50061", "shard-1": f"127.0.0.1:{50062 + version}"}, version=version
    )


def _data(version: int) -> dict[str, str]:
    return {DEFAULT_KEY: yaml.safe_dump(shard_map_document(_map(version)), sort_keys=False), "other": "kept"}


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    with fake_kube(tmp_path, monkeypatch) as fake:
        fake.put_configmap(NS, NAME, _data(1))
        yield fake


@pytest.fixture
def map_file(tmp_path: Path) -> Path:
    path = tmp_path / "shard-map.yaml"
    write_shard_map(path, _map(1))
    return path


def _watch(offered: queue.Queue[tuple[int, bool]], shard_maps: ShardMapFile) -> ConfigMapMapWatch:
    """A watch whose callback offers to `shard_maps` and says what became of each map, to await."""

    def on_map(shard_map: ShardMap) -> None:
        offered.put((shard_map.version, shard_maps.offer(shard_map, "configmap:test")))

    watch = ConfigMapMapWatch(ConfigMapSpec(NS, NAME), on_map, backoff_initial_s=0.05, backoff_max_s=0.2)
    watch.start()
    return watch


def _next(offered: queue.Queue[tuple[int, bool]], version: int) -> bool:
    """Whether the map `version` took effect, skipping maps offered before it (bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        seen, took = offered.get(timeout=max(0.01, deadline - time.monotonic()))
        if seen == version:
            return took


def test_a_configmap_change_reaches_the_follower_while_the_file_stays_old(
    kube: FakeKube, map_file: Path
) -> None:
    changes: queue.Queue[ShardMap] = queue.Queue()
    shard_maps = ShardMapFile(map_file, interval_s=0.05, on_change=lambda _old, new: changes.put(new))
    shard_maps.start()
    watch = watch_shard_map_configmap(f"{NS}/{NAME}", shard_maps)
    assert watch is not None
    try:
        assert watch.synced.wait(WAIT_S)
        kube.wait_watches(1)
        started = time.monotonic()
        kube.put_configmap(NS, NAME, _data(2))
        assert changes.get(timeout=WAIT_S).version == 2
        assert time.monotonic() - started < 1.0
        assert shard_maps.version == 2
        assert load_shard_map(map_file).version == 1  # the mounted file has not caught up
    finally:
        watch.stop()
        shard_maps.stop()
    assert shard_maps.version == 2  # the old file polled meanwhile did not turn it back


def test_an_older_map_in_the_configmap_is_refused_and_counted(kube: FakeKube, map_file: Path) -> None:
    shard_maps = ShardMapFile(map_file)
    offered: queue.Queue[tuple[int, bool]] = queue.Queue()
    watch = _watch(offered, shard_maps)
    try:
        kube.wait_watches(1)
        kube.put_configmap(NS, NAME, _data(3))
        assert _next(offered, 3)
        kube.put_configmap(NS, NAME, _data(2))  # a bad rollback, or a stale copy
        assert not _next(offered, 2)
        assert shard_maps.refused_total == 1
        assert shard_maps.version == 3
        assert shard_maps.current == _map(3)
    finally:
        watch.stop()


def test_the_watch_survives_dropped_streams_restarts_expiry_and_bad_documents(
    kube: FakeKube, map_file: Path
) -> None:
    shard_maps = ShardMapFile(map_file)
    offered: queue.Queue[tuple[int, bool]] = queue.Queue()
    watch = _watch(offered, shard_maps)
    try:
        kube.wait_watches(1)
        kube.drop_watches()
        kube.wait_watches(2)
        kube.put_configmap(NS, NAME, _data(2))
        assert _next(offered, 2)

        kube.restart()  # same port, same ConfigMaps
        kube.put_configmap(NS, NAME, _data(3))
        assert _next(offered, 3)

        failures = watch.failures
        opened = kube.watches_opened
        kube.wait_watches(opened)
        kube.replace_unseen(NS, NAME, _data(4))  # the watcher comes back to a 410 Gone
        assert _next(offered, 4)
        assert kube.gone_answered == 1
        assert watch.failures == failures  # an expired version is read again, not a failure

        kube.put_configmap(NS, NAME, {DEFAULT_KEY: "shards: [unclosed"})
        kube.put_configmap(NS, NAME, {"another-key": "x"})
        kube.put_configmap(NS, NAME, _data(5))
        assert _next(offered, 5)  # the bad documents were skipped, the watch went on
        assert shard_maps.version == 5
    finally:
        watch.stop()
    assert watch._thread is not None and not watch._thread.is_alive()


def test_the_watch_reads_a_configmap_that_appears_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, map_file: Path
) -> None:
    with fake_kube(tmp_path, monkeypatch) as fake:
        shard_maps = ShardMapFile(map_file)
        offered: queue.Queue[tuple[int, bool]] = queue.Queue()
        watch = _watch(offered, shard_maps)
        try:
            fake.put_configmap(NS, NAME, _data(2))  # not found until now: retried with backoff
            assert _next(offered, 2)
        finally:
            watch.stop()


def test_replace_is_conditional_and_keeps_other_keys_and_labels(kube: FakeKube) -> None:
    client = KubeConfigMaps()
    try:
        found = client.get(NS, NAME)
        assert found.data["other"] == "kept"
        client.replace(NS, NAME, {**found.data, DEFAULT_KEY: "x"}, found.resource_version, base=found)
        with pytest.raises(ConfigMapError, match="409"):
            client.replace(NS, NAME, {**found.data, DEFAULT_KEY: "y"}, found.resource_version, base=found)
        data, _version = client.read(NS, NAME)
        assert data == {**found.data, DEFAULT_KEY: "x"}
    finally:
        client.close()


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("", "empty"),
        ("shard-map", "NAMESPACE/NAME"),
        ("/shard-map", "NAMESPACE/NAME"),
        ("ns/", "NAMESPACE/NAME"),
        ("Shard_Router/shard-map", "namespace 'Shard_Router'"),
        ("ns/Shard_Map", "name 'Shard_Map'"),
        ("ns/shard-map:bad key", "key 'bad key'"),
        ("ns/shard-map:", "key ''"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_configmap_spec(spec)
    if spec:
        with pytest.raises(ValueError, match="shard_map_configmap"):
            RouterSettings(shard_map_configmap=spec)
        with pytest.raises(ValueError, match="shard_map_configmap"):
            ShardSettings(shard_map_configmap=spec, shard_map="shard-map.yaml")


def test_good_specs() -> None:
    assert parse_configmap_spec("shard-router/shard-map") == ConfigMapSpec("shard-router", "shard-map")
    spec = parse_configmap_spec("ns/maps.v1:map.json")
    assert (spec.namespace, spec.name, spec.key, spec.where) == (
        "ns",
        "maps.v1",
        "map.json",
        "configmap:ns/maps.v1:map.json",
    )
    assert watch_shard_map_configmap("", ShardMapFile.__new__(ShardMapFile)) is None


def test_no_credentials_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigMapError, match="no Kubernetes credentials"):
        ConfigMapMapWatch(ConfigMapSpec(NS, NAME), lambda _m: None)


def test_stop_ends_an_open_watch_at_once(kube: FakeKube, map_file: Path) -> None:
    offered: queue.Queue[tuple[int, bool]] = queue.Queue()
    watch = _watch(offered, ShardMapFile(map_file))
    kube.wait_watches(1)  # blocked reading a stream the server keeps open for minutes
    started = time.monotonic()
    watch.stop()
    assert time.monotonic() - started < 1.0
    assert watch._thread is not None and not watch._thread.is_alive()


def test_a_shard_daemon_follows_the_configmap_while_its_mounted_file_stays_old(
    kube: FakeKube, map_file: Path, postgres: object
) -> None:
    """`SHARDD_SHARD_MAP_CONFIGMAP`: a ConfigMap update reaches a running shard daemon through the API
    watch, its mounted file untouched (the kubelet a minute behind)."""
    from shardrouter.shardd.server import start_shard
    from tests.helpers import make_settings

    name = f"cm{time.monotonic_ns() % 10**9}"
    postgres.create_database(name)  # type: ignore[attr-defined]
    daemon = start_shard(
        make_settings(
            postgres.dsn_for(name),  # type: ignore[attr-defined]
            shard_id="shard-0",
            shard_map=str(map_file),
            shard_map_reload_s=60.0,
            shard_map_configmap=f"{NS}/{NAME}",
        )
    )
    try:
        assert daemon.shard_map is not None and daemon.shard_map.version == 1
        kube.put_configmap(NS, NAME, _data(2))
        deadline = time.monotonic() + WAIT_S
        while daemon.shard_map.version != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.shard_map.version == 2
        assert load_shard_map(map_file).version == 1
    finally:
        daemon.stop(0.2)
