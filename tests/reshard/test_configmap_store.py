"""Publishing the shard map to its ConfigMap by compare-and-swap: concurrent moves both land, in
turn, nothing lost; other keys and labels are kept (a real loopback fake API server,
`tests/kube_fake.py`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from shardrouter.core.shardmap import (
    Shard,
    ShardMap,
    ShardMapChange,
    ShardMapError,
    even_shard_map,
    shard_map_document,
)
from shardrouter.reshard.configmap_store import ConfigMapStore, MapPublishError
from shardrouter.reshard.map_store import map_store_from
from tests.kube_fake import FakeKube, fake_kube

NS, NAME, KEY = "shard-router", "shard-map", "shard-map.yaml"


def _text(shard_map: ShardMap) -> str:
    return yaml.safe_dump(shard_map_document(shard_map), sort_keys=False)


INITIAL = even_shard_map({"shard-0": "127.0.0.1:50061", "shard-1": "127.0.0.1:50062"}, version=1)


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    with fake_kube(tmp_path, monkeypatch) as fake:
        fake.put_configmap(NS, NAME, {KEY: _text(INITIAL), "README": "kept"}, labels={"app": "shard-router"})
        yield fake


def _with_shard(shard_map: ShardMap, shard_id: str, port: int) -> ShardMap:
    """The map plus an empty shard (as `dev add-shard` publishes), one version up."""
    return ShardMap(
        slots=shard_map.slots,
        shards=(*shard_map.shards, Shard(shard_id, (f"127.0.0.1:{port}",))),
        ranges=shard_map.ranges,
        version=shard_map.version + 1,
    )


def test_concurrent_publishes_both_land_in_turn(kube: FakeKube) -> None:
    both_read = threading.Barrier(2, timeout=5)
    calls: dict[str, int] = {"shard-2": 0, "shard-3": 0}

    def adding(shard_id: str, port: int) -> ShardMapChange:
        def change(current: ShardMap) -> ShardMap | None:
            calls[shard_id] += 1
            if current.shard_by_id(shard_id) is not None:
                return None  # already published
            if calls[shard_id] == 1:
                both_read.wait()  # both made their map from the same version: one must retry
            return _with_shard(current, shard_id, port)

        return change

    stores = [ConfigMapStore.from_spec(f"{NS}/{NAME}") for _ in range(2)]  # two moves, two clients
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(stores[0].publish, adding("shard-2", 50063)),
            pool.submit(stores[1].publish, adding("shard-3", 50064)),
        ]
        published = sorted(f.result(timeout=10).version for f in futures)
    assert published == [2, 3]
    assert kube.conflicts >= 1
    assert sorted(calls.values()) == [1, 2]  # the loser read again and made its map from the winner's
    final = stores[0].load()
    assert final.version == 3
    assert {s.id for s in final.shards} == {"shard-0", "shard-1", "shard-2", "shard-3"}
    assert final.ranges == INITIAL.ranges
    stored = kube.configmap(NS, NAME)
    assert stored["data"]["README"] == "kept"
    assert stored["metadata"]["labels"] == {"app": "shard-router"}


def test_no_change_writes_nothing(kube: FakeKube) -> None:
    store = map_store_from(f"configmap:{NS}/{NAME}")
    assert isinstance(store, ConfigMapStore)
    assert store.where == f"configmap:{NS}/{NAME}"
    assert store.publish(lambda _current: None) == INITIAL
    assert kube.puts == 0
    assert store.load() == INITIAL


def test_a_writer_storm_is_a_clear_error(kube: FakeKube) -> None:
    store = ConfigMapStore.from_spec(f"{NS}/{NAME}")
    store._max_attempts = 3

    def change(current: ShardMap) -> ShardMap:
        # Another writer lands between every read and its replace.
        kube.put_configmap(NS, NAME, {KEY: _text(current), "README": "kept"})
        return _with_shard(current, "shard-9", 50069)

    with pytest.raises(MapPublishError, match="changed under each of 3 attempts"):
        store.publish(change)
    assert kube.conflicts == 3


def test_a_missing_key_or_configmap_is_a_shard_map_error(kube: FakeKube) -> None:
    with pytest.raises(ShardMapError, match=r"no key 'other\.yaml'"):
        ConfigMapStore.from_spec(f"{NS}/{NAME}:other.yaml").load()
    with pytest.raises(ShardMapError, match="not found"):
        ConfigMapStore.from_spec(f"{NS}/absent").load()


def test_no_credentials_is_the_error_moves_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ShardMapError, match="no Kubernetes credentials"):
        map_store_from(f"configmap:{NS}/{NAME}")


@pytest.mark.parametrize("spec", ["configmap:", "configmap:shard-map", "configmap:ns/Bad", "configmap:ns/x:"])
def test_bad_specs_say_what_is_wrong(spec: str) -> None:
    with pytest.raises(ShardMapError, match=r"expected NAMESPACE/NAME|not a lower-case|key ''|empty"):
        map_store_from(spec)
