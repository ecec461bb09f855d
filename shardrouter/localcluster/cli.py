"""`shard-router dev up`: start the local cluster, run the demo, serve until Ctrl-C or SIGTERM;
`shard-router dev add-shard`: ask that running `dev up` to add a shard (owning no slots yet);
`dev backup`, `dev restore-point`, `dev restore`: ask it to back up one shard's database, mark a
point in its WAL, restore it to a point in time; `dev backups`: list a shard's backups and points."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from shardrouter.core import tracing
from shardrouter.core.shardmap import ShardMap, ShardMapError, load_shard_map
from shardrouter.core.termination import TerminationSignals
from shardrouter.localcluster import control, tracing_ui
from shardrouter.localcluster.cluster import LocalCluster, PortInUseError, default_data_dir
from shardrouter.localcluster.pitr import Backup
from shardrouter.localcluster.shard_restore import ShardRestores

#: The request `dev add-shard` sends to the running `dev up`.
_ADD_SHARD = "add-shard"
#: The requests of `dev backup`, `dev restore-point`, `dev restore`; `dev backups` reads files.
_BACKUP = "backup"
_RESTORE_POINT = "restore-point"
_RESTORE = "restore"
_BACKUPS = "backups"
#: Slots `dev add-shard` suggests moving to the new shard first: a small range, quick to try.
_SUGGESTED_SLOTS = 1024


def main(argv: Sequence[str]) -> int:
    """Entry point of `shard-router dev ...`."""
    parser = argparse.ArgumentParser(prog="shard-router dev", description="run shard-router on this machine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up_command(sub)
    add = sub.add_parser(
        _ADD_SHARD,
        help="add a shard (PostgreSQL and daemons, owning no slots) to the running `dev up`",
        description="Ask the running `shard-router dev up` of a data directory to start one more shard "
        "(with that cluster's --replicas and --standby), migrate its database and add it to the shard "
        "map owning no slots; then move slots to it with `shard-router reshard`.",
    )
    add.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"the cluster's data directory (default {default_data_dir()})",
    )
    add.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the cluster's answer (default 300)"
    )
    _add_restore_commands(sub)
    args = parser.parse_args(list(argv))
    if args.command == _ADD_SHARD:
        return _add_shard(args.data_dir or default_data_dir(), args.timeout)
    if args.command in _RESTORE_COMMANDS:
        return _RESTORE_COMMANDS[args.command](args)
    if args.shards < 1 or args.shards > 16:
        parser.error("--shards must be between 1 and 16")
    if args.replicas < 1 or args.replicas > 4:
        parser.error("--replicas must be between 1 and 4")
    if args.tracing_ui and not tracing_ui.phoenix_installed():
        print(
            "shard-router dev up: --tracing-ui needs Arize Phoenix; install the extra first:\n"
            "  .venv/bin/pip install -e '.[dev,tracing-ui]'",
            file=sys.stderr,
        )
        return 2
    cluster = LocalCluster(
        data_dir=args.data_dir or default_data_dir(),
        shards=args.shards,
        replicas=args.replicas,
        standby=args.standby,
        router_port=args.port,
        http_port=args.http_port,
        metrics=not args.no_metrics,
        otlp_endpoint=args.otlp_endpoint,
    )
    refusal = _cannot_start(cluster)
    if refusal:
        print(f"shard-router dev up: {refusal}", file=sys.stderr)
        return 1
    if args.wipe:
        cluster.wipe()
    phoenix: tracing_ui.PhoenixProcess | None = None
    if args.tracing_ui:
        print("Starting the tracing UI (Arize Phoenix) ...", flush=True)
        try:
            phoenix = tracing_ui.launch_phoenix(cluster.data_dir / "phoenix")
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"shard-router dev up: could not start the tracing UI: {exc}", file=sys.stderr)
            return 1
        cluster.otlp_endpoint = phoenix.otlp_endpoint
    if cluster.otlp_endpoint:
        # The demo's own calls start the traces: trace this process too.
        # The exporter and batch processor read the process environment itself.
        os.environ.update(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": cluster.otlp_endpoint, "OTEL_BSP_SCHEDULE_DELAY": "500"}
        )
        tracing.configure_tracing("shard-router-demo")
    try:
        return _run(args, cluster, phoenix)
    finally:
        tracing.shutdown_tracing()
        if phoenix is not None:
            phoenix.stop()


def _cannot_start(cluster: LocalCluster) -> str:
    """Why `cluster` must not start at all (checked before anything starts), or ""."""
    if control.cluster_running(cluster.data_dir):
        return (
            f"a local cluster is already running with data in {cluster.data_dir}; "
            "stop it first (Ctrl-C where it runs) or give another --data-dir"
        )
    busy = cluster.ports_in_use()
    # A router that cannot bind its port would leave it to a stranger, which the demo would call.
    return str(PortInUseError(busy)) if busy else ""


def _add_up_command(sub: Any) -> None:
    """`dev up`: its flags."""
    up = sub.add_parser("up", help="start PostgreSQL per shard, the shard daemons and the router")
    up.add_argument("--shards", type=int, default=2, help="number of shards (default 2)")
    up.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="shard daemons per shard, over its one database (default 1; 2 or more survive losing one)",
    )
    up.add_argument(
        "--standby",
        action="store_true",
        help="run each shard's PostgreSQL as a primary plus a synchronous streaming standby",
    )
    up.add_argument(
        "--data-dir", type=Path, default=None, help=f"where data lives (default {default_data_dir()})"
    )
    up.add_argument("--port", type=int, default=50051, help="router port on 127.0.0.1 (default 50051)")
    up.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="the router's HTTP/JSON front on 127.0.0.1 (default 8080; 0: no HTTP front)",
    )
    up.add_argument("--wipe", action="store_true", help="delete the data directory first")
    up.add_argument("--no-demo", action="store_true", help="do not run the demo after start")
    up.add_argument("--exit-after-demo", action="store_true", help="stop the cluster once the demo ran")
    traces = up.add_mutually_exclusive_group()
    traces.add_argument(
        "--tracing-ui",
        action="store_true",
        help="start a local tracing UI (Arize Phoenix, the tracing-ui extra) and send every span to it",
    )
    traces.add_argument(
        "--otlp-endpoint",
        default="",
        metavar="URL",
        help="send every span over OTLP/gRPC to this collector (e.g. http://127.0.0.1:4317)",
    )
    up.add_argument("--no-metrics", action="store_true", help="do not serve /metrics from the processes")


def _run(args: argparse.Namespace, cluster: LocalCluster, phoenix: tracing_ui.PhoenixProcess | None) -> int:
    signals = TerminationSignals(starting=False)
    try:
        existing = cluster.existing_shard_map()
    except ShardMapError as exc:
        print(f"shard-router dev up: {exc} (start afresh with --wipe)", file=sys.stderr)
        return 1
    shards = len(existing.shards) if existing else args.shards
    print(
        f"Starting {shards} shard(s), {args.replicas} daemon(s) each, with data in {cluster.data_dir} ...",
        flush=True,
    )
    if existing and len(existing.shards) != args.shards:
        print(f"  (the data directory's shard map has {shards} shards; --shards only sizes a new cluster)")
    try:
        cluster.start()
    except (RuntimeError, TimeoutError, OSError, ShardMapError) as exc:
        print(f"shard-router dev up: could not start the cluster: {exc}", file=sys.stderr)
        return 1
    controls = _serve_controls(cluster)
    try:
        target = f"127.0.0.1:{args.port}"
        _print_endpoints(cluster, target, phoenix)
        if not args.no_demo:
            print()
            from shardrouter.localcluster.demo import run_demo

            demo = run_demo(
                target, load_shard_map(cluster.shard_map_path), lambda line: print(line, flush=True)
            )
            if phoenix is not None and demo.replay_key:
                _show_replay_span(phoenix, demo.replay_key)
        _print_tries(cluster, target)
        if args.exit_after_demo:
            return 0
        print("\nCluster running. Ctrl-C stops it (data stays unless you pass --wipe next time).", flush=True)
        signals.wait()
        return 0
    finally:
        print("Stopping the cluster ...", flush=True)
        if controls is not None:
            controls.stop()
        cluster.stop()
        print("Stopped.", flush=True)


def _print_endpoints(cluster: LocalCluster, target: str, phoenix: tracing_ui.PhoenixProcess | None) -> None:
    """Where the started cluster's router, daemons, metrics and spans are."""
    print(
        f"\nRouter listening on {target} (shard map {cluster.shard_map_path}, logs in {cluster.data_dir}/logs)"
    )
    if cluster.http_port:
        http = f"http://127.0.0.1:{cluster.http_port}"
        print(f"HTTP/JSON front on {http} (API document {http}/openapi.json, reference page {http}/docs)")
    for daemon in cluster.shard_daemons:
        print(f"  {daemon.name}: {daemon.address}  database {daemon.env['SHARDD_DSN']}")
    for name, url in cluster.metrics_urls.items():
        print(f"  metrics of {name}: {url}")
    if phoenix is not None:
        print(f"  tracing UI: {phoenix.ui_url} (project {tracing.TRACE_PROJECT})")
        print(f"  your own callers can trace there too: OTEL_EXPORTER_OTLP_ENDPOINT={phoenix.otlp_endpoint}")
    elif cluster.otlp_endpoint:
        print(f"  spans go to {cluster.otlp_endpoint}")


def _print_tries(cluster: LocalCluster, target: str) -> None:
    """Commands to paste next."""
    command = _own_command()
    print(f"\nTry: {command} --target {target} balance alice")
    print(f"     {command} --target {target} transfer --from alice --to bob --amount 1.50 --currency EUR")
    if cluster.http_port:
        print(
            f"     curl -X POST http://127.0.0.1:{cluster.http_port}/transfers -H 'Idempotency-Key: <a UUID>'"
            """ -H 'Content-Type: application/json' -d '{"src":"alice","dst":"bob","amount":150}'"""
        )


def _serve_controls(cluster: LocalCluster) -> control.ControlServer | None:
    """The control socket `dev add-shard` asks; None (and a note) where it cannot be served."""
    restores = ShardRestores(cluster)

    def add_shard(_request: object) -> dict[str, Any]:
        added = cluster.add_shard()
        print(
            f"\nAdded {added.shard_id} in {added.seconds} s: {', '.join(added.addresses)}  database {added.dsn}"
            f" (owns no slots; shard map version {added.map_version})",
            flush=True,
        )
        return {
            "shard_id": added.shard_id,
            "addresses": list(added.addresses),
            "dsn": added.dsn,
            "map_version": added.map_version,
            "seconds": added.seconds,
        }

    def backup(request: Mapping[str, Any]) -> dict[str, Any]:
        made = restores.backup_shard(str(request["shard_id"]))
        print(f"\nBase backup of {made.shard_id}: {made.path}", flush=True)
        return made.to_json()

    def restore_point(request: Mapping[str, Any]) -> dict[str, Any]:
        return restores.restore_point(str(request["shard_id"]), str(request["name"])).to_json()

    def restore(request: Mapping[str, Any]) -> dict[str, Any]:
        shard_id = str(request["shard_id"])
        label = request.get("backup")
        chosen: Backup | None = None
        if label:
            chosen = next((b for b in restores.backups(shard_id) if b.label == label), None)
            if chosen is None:
                raise ValueError(
                    f"{shard_id} has no backup {label!r} (see `shard-router dev backups {shard_id}`)"
                )
        when = request.get("target_time")
        print(f"\nRestoring {shard_id} (its daemons stop meanwhile) ...", flush=True)
        done = restores.restore_shard(
            shard_id,
            chosen,
            target_name=request.get("target_name") or None,
            target_time=datetime.fromisoformat(when) if when else None,
        )
        print(f"Restored {shard_id} in {done.seconds} s (timeline {done.timeline})", flush=True)
        return {
            "shard_id": done.shard_id,
            "backup": done.backup.label,
            "timeline": done.timeline,
            "lsn": done.lsn,
            "seconds": done.seconds,
        }

    server = control.ControlServer(
        cluster.data_dir,
        {_ADD_SHARD: add_shard, _BACKUP: backup, _RESTORE_POINT: restore_point, _RESTORE: restore},
    )
    try:
        server.start()
    except (control.ControlError, OSError) as exc:
        print(f"  (dev add-shard, backup and restore are not available: {exc})", flush=True)
        return None
    return server


def _add_shard(data_dir: Path, timeout_s: float) -> int:
    """`dev add-shard`: ask the running cluster, print the new shard and what to do next."""
    print(f"Adding a shard to the cluster with data in {data_dir} ...", flush=True)
    try:
        answer = control.ask(data_dir, {"request": _ADD_SHARD}, timeout_s=timeout_s)
    except control.ControlError as exc:
        print(f"shard-router dev add-shard: {exc}", file=sys.stderr)
        return 1
    shard_id = answer["shard_id"]
    print(
        f"Added {shard_id} in {answer['seconds']} s, owning no slots (shard map version {answer['map_version']})."
    )
    for address in answer["addresses"]:
        print(f"  {shard_id}: {address}  database {answer['dsn']}")
    suggestion = _suggested_slots(load_shard_map(data_dir / "shard-map.yaml"))
    # reshard reads the default data directory's files unless told otherwise.
    files = (
        ""
        if data_dir == default_data_dir()
        else f" --map {shlex.quote(str(data_dir / 'shard-map.yaml'))}"
        f" --databases {shlex.quote(str(data_dir / 'databases.yaml'))}"
    )
    print("Routers and shard daemons follow the new map without a restart. Give it slots with:")
    print(f"  {_own_command()} reshard --slots {suggestion} --to {shard_id}{files}")
    return 0


def _add_restore_commands(sub: Any) -> None:
    """`dev backup`, `dev restore-point`, `dev restore` (asking the running `dev up`) and `dev
    backups` (reading the data directory)."""
    data_dir_help = f"the cluster's data directory (default {default_data_dir()})"
    backup = sub.add_parser(
        _BACKUP,
        help="take a base backup (pg_basebackup) of a shard's database in the running `dev up`",
        description="Take a base backup of one shard's PostgreSQL into DATA_DIR/backups/SHARD/; with "
        "the WAL archive (DATA_DIR/wal-archive/SHARD/) it can restore the shard to any later point.",
    )
    point = sub.add_parser(
        _RESTORE_POINT,
        help="make a named restore point in a shard's WAL (pg_create_restore_point)",
    )
    restore = sub.add_parser(
        _RESTORE,
        help="restore ONE shard's database to a restore point or a time (its daemons restart)",
        description="Restore one shard of the running `dev up` to a named restore point or a time: "
        "its daemons stop, its PostgreSQL is replaced by a base backup and replays the WAL archive up "
        "to the target, then the daemons serve again. The other shards keep what they have, so "
        "cross-shard transfers after the target no longer add up: run `shard-router reconcile`.",
    )
    listing = sub.add_parser(_BACKUPS, help="list a shard's base backups and restore points")
    for command in (backup, point, restore, listing):
        command.add_argument("shard", metavar="SHARD", help="the shard's id, e.g. shard-0")
        command.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    point.add_argument("name", metavar="NAME", help="the restore point's name (unique per shard)")
    listing.add_argument(
        "--keep",
        type=int,
        default=0,
        metavar="N",
        help="first delete all but the newest N base backups and the archived WAL before them",
    )
    target = restore.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--to",
        metavar="TIME",
        type=_aware_time,
        help="an ISO 8601 time (2026-12-05T04:30:00Z; without an offset, this machine's local time)",
    )
    target.add_argument("--point", metavar="NAME", help="a restore point's name")
    restore.add_argument(
        "--backup",
        metavar="LABEL",
        default="",
        help="the base backup to start from (default: the newest before the target)",
    )
    for command in (backup, point, restore):
        command.add_argument(
            "--timeout",
            type=float,
            default=300.0,
            help="seconds to wait for the cluster's answer (default 300)",
        )


def _aware_time(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return when if when.tzinfo is not None else when.astimezone()


def _ask(args: argparse.Namespace, request: dict[str, Any]) -> dict[str, Any] | None:
    data_dir = args.data_dir or default_data_dir()
    try:
        return control.ask(data_dir, request, timeout_s=args.timeout)
    except control.ControlError as exc:
        print(f"shard-router dev {args.command}: {exc}", file=sys.stderr)
        return None


def _backup(args: argparse.Namespace) -> int:
    answer = _ask(args, {"request": _BACKUP, "shard_id": args.shard})
    if answer is None:
        return 1
    print(
        f"Base backup {answer['label']} of {answer['shard_id']}: {answer['path']}\n"
        f"  restorable to any time from {answer['finished_at']} (WAL {answer['end_lsn']} on)"
    )
    return 0


def _restore_point(args: argparse.Namespace) -> int:
    answer = _ask(args, {"request": _RESTORE_POINT, "shard_id": args.shard, "name": args.name})
    if answer is None:
        return 1
    print(
        f"Restore point {answer['name']!r} of {answer['shard_id']} at WAL {answer['lsn']}, {answer['created_at']}"
    )
    return 0


def _restore(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"request": _RESTORE, "shard_id": args.shard, "backup": args.backup}
    if args.point:
        request["target_name"] = args.point
    else:
        request["target_time"] = args.to.isoformat()
    target = f"restore point {args.point!r}" if args.point else args.to.isoformat()
    print(f"Restoring {args.shard} to {target} ...", flush=True)
    answer = _ask(args, request)
    if answer is None:
        return 1
    print(
        f"Restored {answer['shard_id']} from backup {answer['backup']} in {answer['seconds']} s: it writes "
        f"on timeline {answer['timeline']} from WAL {answer['lsn']}, and its daemons serve again.\n"
        "Other shards still hold what they received from it after the target: compare and repair with "
        f"`{_own_command()} reconcile`."
    )
    return 0


def _backups(args: argparse.Namespace) -> int:
    cluster = LocalCluster(data_dir=args.data_dir or default_data_dir())
    restores = ShardRestores(cluster)
    if args.keep:
        try:
            dropped = restores.prune_backups(args.shard, args.keep)
        except ValueError as exc:
            print(f"shard-router dev backups: {exc}", file=sys.stderr)
            return 2
        for b in dropped:
            print(f"deleted backup {b.label}")
    backups = restores.backups(args.shard)
    points = restores.restore_points(args.shard)
    if not backups and not points:
        print(f"{args.shard} has no base backup and no restore point in {cluster.data_dir}")
        return 0
    for b in backups:
        print(f"backup {b.label}: restorable from {b.finished_at.isoformat()} (WAL {b.end_lsn})  {b.path}")
    for p in points:
        print(f"restore point {p.name!r}: {p.created_at.isoformat()} (WAL {p.lsn})")
    return 0


_RESTORE_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    _BACKUP: _backup,
    _RESTORE_POINT: _restore_point,
    _RESTORE: _restore,
    _BACKUPS: _backups,
}


def _suggested_slots(shard_map: ShardMap) -> str:
    """A small range to move first: the start of the largest range of the map."""
    first, last, _ = max(shard_map.ranges, key=lambda r: r[1] - r[0])
    return f"{first}-{min(last, first + _SUGGESTED_SLOTS - 1)}"


def _show_replay_span(phoenix: tracing_ui.PhoenixProcess, key: str, timeout_s: float = 20.0) -> None:
    """Print a link to the demo's replay span once Phoenix has it (the exporters batch for 0.5 s)."""
    tracing.force_flush()
    spans = tracing_ui.replay_spans(phoenix.ui_url, tracing.TRACE_PROJECT, key, timeout_s=timeout_s)
    if spans:
        span_id = spans[0]["context"]["span_id"]
        print(f"\nThe replay of step 2 in the tracing UI: {tracing_ui.span_url(phoenix.ui_url, span_id)}")
        print(f"  (spans of every attempt: search the attribute idempotency.key = {key})", flush=True)
        return
    print(f"\nThe replay span has not reached the tracing UI yet; search idempotency.key = {key}")


def _own_command() -> str:
    """How to type this very `shard-router` again: its bare name if that is what PATH finds, else
    its path (relative to the working directory when inside it), so a pasted "Try:" line works."""
    own = Path(sys.argv[0]).resolve()
    found = shutil.which("shard-router")
    if found and Path(found).resolve() == own:
        return "shard-router"
    try:
        return shlex.quote(str(own.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(own))


__all__ = [
    "main",
]
