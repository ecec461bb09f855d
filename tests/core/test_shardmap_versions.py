"""Versioned shard maps with several daemons per shard, and the rule a follower applies on reload."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import yaml

from shardrouter.core.shardmap import (
    RESERVED_SHARD_IDS,
    ShardMap,
    ShardMapError,
    even_shard_map,
    load_shard_map,
    parse_shard_map,
    shard_map_document,
    update_shard_map,
    write_shard_map,
)
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.router.metrics import NO_SHARD


def _doc(version: int | None, *addresses: str) -> dict[str, object]:
    shard0: dict[str, object] = {"id": "shard-0", "slot_ranges": [[0, 8191]]}
    if len(addresses) == 1:
        shard0["address"] = addresses[0]
    else:
        shard0["addresses"] = list(addresses)
    doc: dict[str, object] = {
        "slots": 16384,
        "shards": [shard0, {"id": "shard-1", "address": "127.0.0.1:2000", "slot_ranges": [[8192, 16383]]}],
    }
    if version is not None:
        doc["version"] = version
    return doc


def test_a_shard_may_list_several_daemons() -> None:
    shard_map = parse_shard_map(_doc(3, "127.0.0.1:1000", "127.0.0.1:1001"), source="t")
    assert shard_map.version == 3
    assert shard_map.shards[0].addresses == ("127.0.0.1:1000", "127.0.0.1:1001")
    assert shard_map.shards[0].address == "127.0.0.1:1000"
    assert shard_map.addresses() == {"127.0.0.1:1000", "127.0.0.1:1001", "127.0.0.1:2000"}
    # The document round-trips, version and addresses included.
    assert parse_shard_map(shard_map_document(shard_map), source="t") == shard_map


def test_a_shard_may_own_no_slots_and_round_trips(tmp_path: Path) -> None:
    """A shard just added (or moved out of) has no range but stays in the map, reachable."""
    doc = _doc(2, "127.0.0.1:1000")
    doc["shards"].append({"id": "shard-2", "address": "127.0.0.1:3000", "slot_ranges": []})  # type: ignore[attr-defined]
    shard_map = parse_shard_map(doc, source="t")
    assert shard_map.shard_by_id("shard-2") is not None
    assert "127.0.0.1:3000" in shard_map.addresses()
    assert {shard_map.owner_of_slot(s).id for s in range(shard_map.slots)} == {"shard-0", "shard-1"}
    write_shard_map(tmp_path / "m.yaml", shard_map)
    assert load_shard_map(tmp_path / "m.yaml") == shard_map


def test_an_unversioned_map_is_version_0() -> None:
    assert parse_shard_map(_doc(None, "127.0.0.1:1000"), source="t").version == 0


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"version": -1}, "'version' must be a non-negative integer"),
        ({"version": "7"}, "'version' must be a non-negative integer"),
        ({"version": True}, "'version' must be a non-negative integer"),
    ],
)
def test_bad_versions_are_refused(change: dict[str, object], problem: str) -> None:
    with pytest.raises(ShardMapError, match=problem):
        parse_shard_map({**_doc(1, "127.0.0.1:1000"), **change}, source="t")


@pytest.mark.parametrize(
    ("shard0", "problem"),
    [
        ({"address": "a:1", "addresses": ["b:2"]}, "needs 'address' (host:port) or 'addresses'"),
        ({}, "needs 'address' (host:port) or 'addresses'"),
        ({"addresses": []}, "addresses must be a non-empty list"),
        ({"addresses": ["a:1", "nocolon"]}, "addresses entry 'nocolon' must be host:port"),
        ({"addresses": ["a:1", "a:1"]}, "lists an address twice"),
        (
            {"addresses": ["a:1", "127.0.0.1:2000"]},
            "address 127.0.0.1:2000 is given to both shard-0 and shard-1",
        ),
    ],
)
def test_bad_address_lists_are_refused(shard0: dict[str, object], problem: str) -> None:
    doc = _doc(1, "x:1")
    shards = doc["shards"]
    assert isinstance(shards, list)
    shards[0] = {"id": "shard-0", "slot_ranges": [[0, 8191]], **shard0}
    with pytest.raises(ShardMapError) as caught:
        parse_shard_map(doc, source="t")
    assert problem in str(caught.value)


def _write(path: Path, doc: dict[str, object]) -> None:
    path.write_text(yaml.safe_dump(doc))


def test_a_follower_takes_only_a_higher_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "shard-map.yaml"
    _write(path, _doc(5, "127.0.0.1:1000"))
    follower = ShardMapFile(path)
    assert follower.version == 5

    _write(path, _doc(4, "127.0.0.1:1999"))  # a stale copy: refused
    assert follower.check() is False
    assert follower.version == 5 and follower.current.shards[0].address == "127.0.0.1:1000"
    assert "older than the map in force" in caplog.text

    _write(path, _doc(5, "127.0.0.1:1998"))  # changed without a new version: refused
    assert follower.check() is False
    assert follower.current.shards[0].address == "127.0.0.1:1000"
    assert "kept version 5" in caplog.text

    _write(path, _doc(6, "127.0.0.1:1000", "127.0.0.1:1001"))
    assert follower.check() is True
    assert follower.version == 6 and follower.current.shards[0].addresses == (
        "127.0.0.1:1000",
        "127.0.0.1:1001",
    )

    _write(path, _doc(None, "127.0.0.1:1000"))  # dropping the version is going back to 0: refused
    assert follower.check() is False
    assert follower.version == 6


def test_unversioned_maps_replace_each_other(tmp_path: Path) -> None:
    path = tmp_path / "shard-map.yaml"
    _write(path, _doc(None, "127.0.0.1:1000"))
    follower = ShardMapFile(path)
    _write(path, _doc(None, "127.0.0.1:1001"))
    assert follower.check() is True
    assert follower.current.shards[0].address == "127.0.0.1:1001"


def test_writers_of_one_map_file_take_turns_and_lose_no_change(tmp_path: Path) -> None:
    path = tmp_path / "shard-map.yaml"
    write_shard_map(path, even_shard_map({"shard-0": "127.0.0.1:1", "shard-1": "127.0.0.1:2"}, version=1))

    def bump(current: ShardMap) -> ShardMap:
        time.sleep(0.001)  # widen the window between reading and writing
        return dataclasses.replace(current, version=current.version + 1)

    def writer() -> None:
        for _ in range(25):
            update_shard_map(path, bump)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert load_shard_map(path).version == 1 + 4 * 25
    assert update_shard_map(path, lambda current: None).version == 101


def test_a_shard_cannot_take_the_id_the_router_metrics_use_for_no_shard() -> None:
    assert NO_SHARD in RESERVED_SHARD_IDS
    doc = _doc(1, "x:1")
    shards = doc["shards"]
    assert isinstance(shards, list)
    shards[0] = {**shards[0], "id": NO_SHARD}
    with pytest.raises(ShardMapError, match="'none' is reserved"):
        parse_shard_map(doc, source="t")
