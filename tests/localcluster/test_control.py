"""The control socket of `dev up` and `dev add-shard` without a cluster: a clear refusal when no
`dev up` runs, a stale socket replaced, a second server refused, handler errors answered; and the
next shard's id and the map entry of an added shard."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from shardrouter.core.shardmap import even_shard_map, load_shard_map, write_shard_map
from shardrouter.localcluster import cli, control
from shardrouter.localcluster.cluster import LocalCluster, _with_empty_shard


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A short path: a Unix socket's path has at most 107 bytes, pytest's tmp_path can be longer."""
    where = Path(tempfile.mkdtemp(prefix="sr-ctl-"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _serving(data_dir: Path, handlers: Mapping[str, control.Handler]) -> control.ControlServer:
    server = control.ControlServer(data_dir, handlers)
    server.start()
    return server


def test_asking_with_no_cluster_running_names_the_data_directory(data_dir: Path) -> None:
    with pytest.raises(
        control.NoClusterRunning, match=f"no local cluster is running with data in {data_dir}"
    ):
        control.ask(data_dir, {"request": "add-shard"}, timeout_s=2)
    assert not control.cluster_running(data_dir)


def test_dev_add_shard_without_a_cluster_fails_clearly(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["add-shard", "--data-dir", str(data_dir)]) == 1
    err = capsys.readouterr().err
    assert f"no local cluster is running with data in {data_dir}" in err
    assert "shard-router dev up" in err


def test_a_stale_socket_refuses_and_a_new_server_replaces_it(data_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(control.socket_path(data_dir)))  # what a SIGKILLed `dev up` leaves behind
    stale.close()
    with pytest.raises(control.NoClusterRunning):
        control.ask(data_dir, {"request": "ping"}, timeout_s=2)
    server = _serving(data_dir, {"ping": lambda request: {"pong": request["n"]}})
    try:
        assert control.ask(data_dir, {"request": "ping", "n": 7}, timeout_s=5) == {"ok": True, "pong": 7}
        assert control.cluster_running(data_dir)
        assert control.socket_path(data_dir).stat().st_mode & 0o077 == 0
    finally:
        server.stop()
    assert not control.socket_path(data_dir).exists()
    assert not control.cluster_running(data_dir)


def test_a_second_server_on_one_data_directory_is_refused(data_dir: Path) -> None:
    server = _serving(data_dir, {})
    try:
        with pytest.raises(control.ControlError, match="already running"):
            _serving(data_dir, {})
        assert control.cluster_running(data_dir), "the refused second server must not break the first"
    finally:
        server.stop()


def test_refusals_and_failures_are_answered_and_the_server_goes_on(data_dir: Path) -> None:
    def failing(_request: Mapping[str, Any]) -> dict[str, Any]:
        raise RuntimeError("the database did not start")

    server = _serving(data_dir, {"add-shard": failing, "ping": lambda _r: {}})
    try:
        with pytest.raises(control.ControlError, match="refused: the database did not start"):
            control.ask(data_dir, {"request": "add-shard"}, timeout_s=5)
        with pytest.raises(control.ControlError, match="unknown request 'nope'"):
            control.ask(data_dir, {"request": "nope"}, timeout_s=5)
        assert control.ask(data_dir, {"request": "ping"}, timeout_s=5) == {"ok": True}
    finally:
        server.stop()


def test_requests_are_answered_one_at_a_time(data_dir: Path) -> None:
    running = threading.Semaphore(1)
    overlaps: list[bool] = []

    def slow(_request: Mapping[str, Any]) -> dict[str, Any]:
        overlaps.append(not running.acquire(blocking=False))
        threading.Event().wait(0.2)
        running.release()
        return {}

    server = _serving(data_dir, {"slow": slow})
    try:
        askers = [
            threading.Thread(
                target=control.ask, args=(data_dir, {"request": "slow"}), kwargs={"timeout_s": 5}
            )
            for _ in range(3)
        ]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()
    finally:
        server.stop()
    assert overlaps == [False, False, False]


def test_a_data_directory_too_deep_for_a_socket_is_named(data_dir: Path) -> None:
    deep = data_dir / ("d" * 120)
    with pytest.raises(control.ControlError, match="too long for its control socket"):
        control.ControlServer(deep, {}).start()
    with pytest.raises(control.ControlError, match="use a shorter --data-dir"):
        control.ask(deep, {"request": "add-shard"}, timeout_s=1)


def test_the_next_shard_is_numbered_above_the_map_and_the_database_folders(data_dir: Path) -> None:
    cluster = LocalCluster(data_dir=data_dir)
    write_shard_map(cluster.shard_map_path, even_shard_map({"shard-0": "h:1", "shard-1": "h:2"}, version=4))
    assert cluster.next_shard_id() == "shard-2"
    (data_dir / "pg-shard-4-replicated").mkdir()  # an earlier, larger cluster's database: never reused
    assert cluster.next_shard_id() == "shard-5"


def test_an_added_shard_owns_no_slots_under_a_higher_version(data_dir: Path) -> None:
    before = even_shard_map({"shard-0": "h:1", "shard-1": ["h:2", "h:3"]}, version=4)
    after = _with_empty_shard(before, "shard-2", ["h:4", "h:5"])
    write_shard_map(data_dir / "map.yaml", after)
    reread = load_shard_map(data_dir / "map.yaml")
    assert reread == after
    assert after.version == 5
    assert [s.id for s in after.shards] == ["shard-0", "shard-1", "shard-2"]
    assert after.shards[2].addresses == ("h:4", "h:5")
    assert after.ranges == before.ranges
