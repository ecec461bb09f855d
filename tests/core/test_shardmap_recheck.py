"""`ShardMapFile.recheck`: an on-demand read of the shard map file between polls, rate-limited."""

from __future__ import annotations

import threading
from pathlib import Path

from shardrouter.core.shardmap import even_shard_map, write_shard_map
from shardrouter.core.shardmap_file import ShardMapFile


def _write(path: Path, version: int) -> None:
    write_shard_map(path, even_shard_map({"shard-0": "127.0.0.1:1"}, version=version))


def test_recheck_takes_a_new_file_between_polls_but_reads_it_at_most_once_per_interval(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shard-map.yaml"
    _write(path, 1)
    maps = ShardMapFile(path, interval_s=60)  # never started: no poll
    assert maps.recheck(min_interval_s=3600).version == 1  # the first recheck reads

    _write(path, 2)
    assert maps.recheck(min_interval_s=3600).version == 1  # within the interval: no read
    assert maps.version == 1
    assert maps.recheck(min_interval_s=0).version == 2  # past it: read


def test_concurrent_rechecks_read_the_file_once(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "shard-map.yaml"
    _write(path, 1)
    maps = ShardMapFile(path, interval_s=60)
    _write(path, 2)
    reads: list[int] = []
    check = maps.check

    def counted() -> bool:
        reads.append(1)
        return check()

    monkeypatch.setattr(maps, "check", counted)
    seen: list[int] = []
    threads = [
        threading.Thread(target=lambda: seen.append(maps.recheck(min_interval_s=3600).version))
        for _ in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert len(reads) == 1
    assert seen == [2] * 16  # every caller sees the map the one read took
