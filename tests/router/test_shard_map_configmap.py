"""The router follows the shard map's ConfigMap (ROUTER_SHARD_MAP_CONFIGMAP) beside its file, and says
which version is in force and how many older maps it refused on /metrics (a real loopback fake API
server, `tests/kube_fake.py`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from shardrouter.core.shardmap import even_shard_map, shard_map_document, write_shard_map
from shardrouter.localcluster.postgres import free_port
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings
from tests.kube_fake import fake_kube
from tests.metrics import scrape_text

NS, NAME = "shard-router", "shard-map"


def _data(version: int) -> dict[str, str]:
    shard_map = even_shard_map({"shard-0": f"127.0.0.1:{50060 + version}"}, version=version)
    return {"shard-map.yaml": yaml.safe_dump(shard_map_document(shard_map), sort_keys=False)}


def _metric(port: int, series: str) -> float | None:
    for line in scrape_text(port).splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _await_metric(port: int, series: str, value: float, timeout_s: float = 5.0) -> None:
    # A scrape is how an operator sees it; there is nothing else to wait on from outside the router.
    deadline = time.monotonic() + timeout_s
    while (seen := _metric(port, series)) != value:
        assert time.monotonic() < deadline, f"{series} is {seen}, wanted {value}"
        time.sleep(0.05)


def test_router_follows_the_configmap_and_exports_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "shard-map.yaml"
    write_shard_map(path, even_shard_map({"shard-0": "127.0.0.1:50061"}, version=1))
    with fake_kube(tmp_path, monkeypatch) as kube:
        kube.put_configmap(NS, NAME, _data(1))
        router = start_router_thread(
            RouterSettings(
                listen="127.0.0.1:0",
                shard_map=str(path),
                dev_mode=True,
                metrics_port=free_port(),
                reload_interval_s=0.1,
                shard_map_configmap=f"{NS}/{NAME}",
            )
        )
        try:
            port = router.router.metrics_port
            watch = router.router.map_watch
            assert watch is not None and watch.synced.wait(5)
            assert _metric(port, "router_shard_map_version") == 1
            assert _metric(port, "router_shard_map_refused_total") == 0
            kube.put_configmap(NS, NAME, _data(2))
            _await_metric(port, "router_shard_map_version", 2)
            assert router.router.shard_maps.current.shards[0].address == "127.0.0.1:50062"
            kube.put_configmap(NS, NAME, _data(1))  # a stale copy
            _await_metric(port, "router_shard_map_refused_total", 1)
            assert _metric(port, "router_shard_map_version") == 2
        finally:
            router.stop(0.5)
        assert watch._thread is not None and not watch._thread.is_alive()


def test_router_refuses_a_bad_configmap_setting() -> None:
    with pytest.raises(ValueError, match="shard_map_configmap: shard map ConfigMap 'nonamespace'"):
        RouterSettings(shard_map_configmap="nonamespace")
