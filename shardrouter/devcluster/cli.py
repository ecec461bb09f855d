"""`shard-router dev up`: start the local cluster, run the demo, serve until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from shardrouter.devcluster.cluster import LocalCluster, default_data_dir
from shardrouter.shardmap import load_shard_map


def main(argv: Sequence[str]) -> int:
    """Entry point of `shard-router dev ...`."""
    parser = argparse.ArgumentParser(prog="shard-router dev", description="run shard-router on this machine")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start PostgreSQL per shard, the shard daemons and the router")
    up.add_argument("--shards", type=int, default=2, help="number of shards (default 2)")
    up.add_argument(
        "--data-dir", type=Path, default=None, help=f"where data lives (default {default_data_dir()})"
    )
    up.add_argument("--port", type=int, default=50051, help="router port on 127.0.0.1 (default 50051)")
    up.add_argument("--wipe", action="store_true", help="delete the data directory first")
    up.add_argument("--no-demo", action="store_true", help="do not run the demo after start")
    up.add_argument("--exit-after-demo", action="store_true", help="stop the cluster once the demo ran")
    args = parser.parse_args(list(argv))
    if args.shards < 1 or args.shards > 16:
        parser.error("--shards must be between 1 and 16")
    cluster = LocalCluster(
        data_dir=args.data_dir or default_data_dir(), shards=args.shards, router_port=args.port
    )
    if args.wipe:
        cluster.wipe()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"Starting {args.shards} shard(s) with data in {cluster.data_dir} ...", flush=True)
    try:
        cluster.start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"shard-router dev up: could not start the cluster: {exc}", file=sys.stderr)
        return 1
    try:
        target = f"127.0.0.1:{args.port}"
        print(
            f"\nRouter listening on {target} (shard map {cluster.shard_map_path}, logs in {cluster.data_dir}/logs)"
        )
        for daemon, db in zip(cluster.shard_daemons, cluster.databases, strict=True):
            print(f"  {daemon.name}: {daemon.address}  database {db.dsn_for('shardd')}")
        if not args.no_demo:
            print()
            from shardrouter.devcluster.demo import run_demo

            run_demo(target, load_shard_map(cluster.shard_map_path), lambda line: print(line, flush=True))
        print(f"\nTry: shard-router --target {target} balance alice")
        print(
            f"     shard-router --target {target} transfer --from alice --to bob --amount 1.50 --currency EUR"
        )
        if args.exit_after_demo:
            return 0
        print("\nCluster running. Ctrl-C stops it (data stays unless you pass --wipe next time).", flush=True)
        stop.wait()
        return 0
    finally:
        print("Stopping the cluster ...", flush=True)
        cluster.stop()
        print("Stopped.", flush=True)
