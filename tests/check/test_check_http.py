"""`shard-router check --http`: the same workload over the router's HTTP/JSON front of a real local
cluster passes, its answers recorded as the JSON the front wrote; and an edited replay is named."""

from __future__ import annotations

import base64
import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardrouter.check import cli
from shardrouter.localcluster.cluster import LocalCluster
from shardrouter.localcluster.postgres import free_port
from tests.helpers import pg_data_dir


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    started = LocalCluster(
        data_dir=pg_data_dir().parent / "cluster", shards=2, router_port=free_port(), http_port=free_port()
    )
    started.start()
    try:
        yield started
    finally:
        started.stop()
        started.wipe()


def _check(*args: str) -> tuple[int, dict[str, object]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([*args, "--json", "--settle", "20"])
    return code, json.loads(out.getvalue())


def test_over_http_the_proofs_hold_and_a_changed_replay_is_named(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    history = tmp_path / "http.jsonl"
    databases = ["--databases", str(cluster.databases_path)]
    code, verdict = _check(
        "--http", f"http://127.0.0.1:{cluster.http_port}", *databases, "--history", str(history),
        "--operations", "150", "--concurrency", "6", "--seed", "5",
    )  # fmt: skip
    assert code == 0, verdict["violations"]
    figures = verdict["figures"]
    assert isinstance(figures, dict)
    assert figures["pending"] == 0 and figures["replays"] > 0 and figures["cross_shard"] > 0
    assert figures["reused_refused"] == figures["reused_bodies"] > 0
    assert figures["expired_refused"] == 2
    records = [json.loads(line) for line in history.read_text().splitlines()]
    replay = next(r for r in records if r["type"] == "attempt" and r["replayed"] and r["code"] == "OK")
    assert json.loads(base64.b64decode(replay["response_b64"]))  # the front's JSON, as it wrote it
    replay["response_b64"] = base64.b64encode(base64.b64decode(replay["response_b64"]) + b" ").decode()
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, verdict = _check("--verify", str(edited), *databases)
    assert code == 1
    violations = verdict["violations"]
    assert isinstance(violations, list)
    assert [(v["kind"], v["key"]) for v in violations] == [("answer_changed", replay["key"])]
