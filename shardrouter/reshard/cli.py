"""`shard-router reshard`: move a slot range to another shard, see moves, resume or abort one.

    shard-router reshard --slots 0-1023 --to shard-2     # plan, copy, catch up, cut over, clean up
    shard-router reshard status [MOVE]                   # every move (or one), phase and figures
    shard-router reshard status --watch [MOVE]           # a line per active move every 2 s, until done
    shard-router reshard resume MOVE                     # after a crash or a stop: go on from the journal
    shard-router reshard abort MOVE                      # roll back a move that has not committed
    shard-router reshard show-map [MOVE]                 # the map to follow (or the one MOVE committed)

It needs where the shard map that routers and shard daemons follow is published (`--map`: a file,
or `configmap:NAMESPACE/NAME` on Kubernetes; the move publishes its change there after recording
its commit in the shards' databases) and each shard's database DSN, from a YAML file of `shard-id: DSN` (`--databases`)
or `--dsn shard-id=DSN`. The local cluster (`shard-router dev up`) writes both into its data
directory, which is the default.

`status --watch` reads the journal (and the move's replication slot, for the lag) again every
`--interval` seconds and prints one line per active move: its phase and the step under way, rows
copied, lag, and the seconds each finished step took; it ends, with 0, once the move (without
MOVE: every move it saw) is done or aborted, or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
import yaml
from psycopg.conninfo import conninfo_to_dict

from shardrouter.core import failpoints
from shardrouter.core.shard_dsns import parse_shard_dsn_pairs, read_shard_dsns
from shardrouter.core.shardmap import ShardMapError, is_shard_id, shard_map_document
from shardrouter.reshard import replication
from shardrouter.reshard.agreement import wait_for_agreement
from shardrouter.reshard.journal import MoveRecord
from shardrouter.reshard.map_store import MapStore, map_store_from
from shardrouter.reshard.move import (
    Move,
    MoveSettings,
    ShardDatabases,
    current_map,
    find_move,
    list_moves,
    phase_failpoint,
    start_move,
)
from shardrouter.reshard.plan import ACTIVE_PHASES, MoveError, Phase, parse_slot_range
from shardrouter.shardd.fences import DrainError

_COMMANDS = ("status", "resume", "abort", "show-map")
WATCH_INTERVAL_S = 2.0
#: What a move is doing while its journal says it reached a phase: the next step.
_STEP_AFTER = {
    Phase.PLANNED: "preparing",
    Phase.PREPARED: "copying",
    Phase.COPIED: "catching up",
    Phase.CAUGHT_UP: "cutting over",
    Phase.FENCED: "verifying",
    Phase.VERIFIED: "committing",
    Phase.COMMITTED: "cleaning up",
}


def _parser(default_dir: Path | None) -> argparse.ArgumentParser:
    where = f" (default: {default_dir}/%s, the local cluster's)" if default_dir else ""
    parser = argparse.ArgumentParser(
        prog="shard-router reshard",
        description="Move a slot range, its accounts' rows and idempotency records, to another shard.",
    )
    parser.add_argument(
        "command",
        nargs="?",
        choices=_COMMANDS,
        help="status, resume, abort or show-map (default: a new move)",
    )
    parser.add_argument("move_id", nargs="?", help="the move, for status, resume, abort and show-map")
    parser.add_argument("--slots", help="the range to move, FIRST-LAST (inclusive), e.g. 0-1023")
    parser.add_argument("--to", dest="target", help="the shard that takes the range")
    parser.add_argument(
        "--map",
        help="where the shard map is published: a file, or configmap:NAMESPACE/NAME[:KEY]"
        + (where % "shard-map.yaml" if where else ""),
    )
    parser.add_argument(
        "--databases", type=Path, help="YAML of shard-id: DSN" + (where % "databases.yaml" if where else "")
    )
    parser.add_argument(
        "--dsn", action="append", default=[], metavar="SHARD=DSN", help="a shard's DSN (repeatable)"
    )
    parser.add_argument(
        "--replication-dsn",
        action="append",
        default=[],
        metavar="SHARD=DSN",
        help="how the new owner's PostgreSQL reaches this shard's database, when not by its DSN (repeatable)",
    )
    parser.add_argument(
        "--replication-databases",
        type=Path,
        metavar="FILE",
        help="YAML of shard-id: DSN, as --replication-dsn for several shards (--replication-dsn wins)",
    )
    parser.add_argument(
        "--stop-after",
        choices=[p.value for p in Phase if p not in (Phase.PLANNED, Phase.DONE, Phase.ABORTED)],
        help="stop once this phase is reached (copy now, cut over later with resume)",
    )
    parser.add_argument(
        "--cutover-lag-bytes",
        type=int,
        default=MoveSettings.cutover_lag_bytes,
        help="cut over once the new owner is this close behind (default %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=MoveSettings.drain_timeout_s,
        help="seconds the fence waits for older transactions before ending them (default %(default)s)",
    )
    parser.add_argument(
        "--agreement",
        action="append",
        default=[],
        metavar="URL",
        help="a router's or shard daemon's /metrics URL (repeatable): after the move, wait until each "
        "follows the published map and report the ones that do not",
    )
    parser.add_argument(
        "--agreement-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for --agreement (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="status as JSON")
    parser.add_argument(
        "--watch",
        action="store_true",
        help="status: print the active moves again and again until they are done or aborted (or Ctrl-C)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=WATCH_INTERVAL_S,
        help="seconds between two looks of --watch (default %(default)s)",
    )
    return parser


def _databases(args: argparse.Namespace, default_dir: Path | None) -> ShardDatabases:
    dsns: dict[str, str] = {}
    path = args.databases or (default_dir / "databases.yaml" if default_dir else None)
    if path is not None and (args.databases is not None or path.exists()):
        try:
            dsns.update(read_shard_dsns(path))
        except ValueError as exc:
            raise MoveError(str(exc)) from exc
    dsns.update(_pairs("--dsn", args.dsn))
    if not dsns:
        raise MoveError("no shard databases given: --databases FILE or --dsn SHARD=DSN")
    return ShardDatabases(dsns, _replication_dsns(args, dsns) or None)


#: libpq's values of sslmode (its parser takes any value; another fails only once connecting).
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _replication_dsns(args: argparse.Namespace, dsns: dict[str, str]) -> dict[str, str]:
    """--replication-databases FILE and --replication-dsn SHARD=DSN (which wins), each checked now:
    the new owner's server reads one only when a move creates or points its subscription, and a bad
    one would stop the move there. The messages never repeat a DSN (it may hold a password)."""
    given: dict[str, tuple[str, str]] = {}
    if args.replication_databases is not None:
        try:
            from_file = read_shard_dsns(args.replication_databases, "--replication-databases")
        except ValueError as exc:
            raise MoveError(str(exc)) from exc
        given.update(
            (s, (f"--replication-databases {args.replication_databases}", d)) for s, d in from_file.items()
        )
    given.update(
        (s, ("--replication-dsn", d)) for s, d in _pairs("--replication-dsn", args.replication_dsn).items()
    )
    for shard, (source, dsn) in given.items():
        if shard not in dsns:
            # A DSN given without SHARD= may split at a '=' of its own: never show such a "shard".
            named = f"shard {shard!r}" if is_shard_id(shard) else "SHARD of SHARD=DSN"
            raise MoveError(f"{source}: {named} has no database (known: {', '.join(sorted(dsns))})")
        try:
            params = conninfo_to_dict(dsn)
        except psycopg.ProgrammingError:
            raise MoveError(
                f"{source}: shard {shard}'s DSN is not a connection string libpq can read"
            ) from None
        sslmode = params.get("sslmode")
        if sslmode is not None and sslmode not in _SSLMODES:
            raise MoveError(
                f"{source}: shard {shard}'s DSN has sslmode={sslmode}; give one of {', '.join(_SSLMODES)}"
            )
    return {shard: dsn for shard, (_, dsn) in given.items()}


def _pairs(flag: str, items: list[str]) -> dict[str, str]:
    try:
        return parse_shard_dsn_pairs(flag, items)
    except ValueError as exc:
        raise MoveError(str(exc)) from None


def _map_store(args: argparse.Namespace, default_dir: Path | None) -> MapStore:
    where: str | Path | None = args.map or (default_dir / "shard-map.yaml" if default_dir else None)
    if where is None:
        raise MoveError("no shard map given: --map FILE or --map configmap:NAMESPACE/NAME")
    return map_store_from(where)


def _show_map(store: MapStore, databases: ShardDatabases, move_id: str | None) -> int:
    """`show-map`: the map every process should follow (the published one with the databases'
    newer facts), or with MOVE the map that move committed (from its journal); YAML on stdout."""
    if move_id:
        record = find_move(databases, move_id)
        if record.committed_map is None:
            raise MoveError(f"move {move_id} is {record.phase.value}: it has not committed a map")
        document = record.committed_map
    else:
        document = shard_map_document(current_map(store, databases))
    print(yaml.safe_dump(document, sort_keys=False), end="")
    return 0


def _print_progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def _describe(record: MoveRecord) -> str:
    p, f = record.plan, record.figures
    parts = [
        f"{p.move_id}: slots {p.first_slot}-{p.last_slot} {p.source} -> {p.target}, {record.phase.value}"
    ]
    if "rows_moved" in f:
        parts.append(f"rows moved {sum(f['rows_moved'].values())}")
    elif "rows_copied" in f:
        parts.append(f"rows copied {f['rows_copied']}")
    if "lag_bytes" in f and record.phase in (Phase.COPIED, Phase.PREPARED):
        parts.append(f"lag {f['lag_bytes']} bytes")
    if "write_pause_s" in f:
        parts.append(f"write pause {f['write_pause_s']} s")
    seconds = _finished_seconds(record)
    if seconds:
        parts.append("seconds: " + seconds)
    return "; ".join(parts)


#: The journal's figures of seconds, in the order of the steps (jsonb keeps its keys in its own order).
_STEP_SECONDS = (
    "prepare_s",
    "copy_s",
    "catch_up_s",
    "drain_s",
    "final_sync_s",
    "verify_s",
    "commit_s",
    "clean_up_s",
)


def _finished_seconds(record: MoveRecord) -> str:
    """The seconds each finished step took, from the journal's figures, in the order of the steps."""
    f = record.figures
    keys = [k for k in f if k.endswith("_s") and k != "write_pause_s"]
    keys.sort(key=lambda k: _STEP_SECONDS.index(k) if k in _STEP_SECONDS else len(_STEP_SECONDS))
    return ", ".join(f"{k[:-2]} {f[k]}" for k in keys)


@dataclass(frozen=True)
class _PhaseClock:
    """When the watch saw a move in its phase first; `from_start` if it saw the phase begin (else
    the phase was under way at the first look, and the time in it is a lower bound)."""

    phase: Phase
    since: float
    from_start: bool


def _progress_line(record: MoveRecord, lag_bytes: int | None, in_phase_s: float, exact: bool) -> str:
    """One line of the watch: phase and step under way, rows copied, lag, seconds per step."""
    p, f = record.plan, record.figures
    took = f"{in_phase_s:.0f} s" if exact else f">= {in_phase_s:.0f} s"
    parts = [
        f"{p.move_id}: slots {p.first_slot}-{p.last_slot} {p.source} -> {p.target}, {record.phase.value}"
        f" ({_STEP_AFTER[record.phase]} for {took})",
        f"rows copied {f.get('rows_copied', 0)}",
        "lag -" if lag_bytes is None else f"lag {lag_bytes} bytes",
    ]
    seconds = _finished_seconds(record)
    if seconds:
        parts.append("seconds: " + seconds)
    return "; ".join(parts)


def _live_lag(databases: ShardDatabases, record: MoveRecord) -> int | None:
    """The move's lag now, from its slot on the old owner (None: no slot, not made yet or dropped)."""
    with psycopg.connect(databases.dsn(record.plan.source), autocommit=True, connect_timeout=10) as conn:
        return replication.slot_lag_bytes(conn, record.plan.object_name)


class _Watch:
    """The state of `status --watch` between two looks: the moves seen active, and since when in
    their phase (the journal keeps no start time of a phase, so the watch times what it sees)."""

    def __init__(self, databases: ShardDatabases, move_id: str | None) -> None:
        self._databases = databases
        self._move_id = move_id
        self._clocks: dict[str, _PhaseClock] = {}
        self._looked = False

    def look(self) -> bool:
        """Print a line per active move, and the last one of each move that ended since the last
        look; False once there is nothing left to watch."""
        now = time.monotonic()
        first = not self._looked
        self._looked = True
        records = (
            [find_move(self._databases, self._move_id)] if self._move_id else list_moves(self._databases)
        )
        going = False
        for record in records:
            move_id = record.plan.move_id
            if record.phase in ACTIVE_PHASES:
                clock = self._clocks.get(move_id)
                if clock is None or clock.phase is not record.phase:
                    # A move first seen at a later look was journaled since the one before.
                    clock = _PhaseClock(record.phase, now, from_start=clock is not None or not first)
                    self._clocks[move_id] = clock
                lag = _live_lag(self._databases, record)
                _print_progress(_progress_line(record, lag, now - clock.since, clock.from_start))
                going = True
            elif move_id in self._clocks or (first and self._move_id):
                self._clocks.pop(move_id, None)
                _print_progress(_describe(record))
        if first and not going and not self._move_id:
            _print_progress("no active moves")
        return going


def watch_moves(
    databases: ShardDatabases,
    move_id: str | None = None,
    *,
    interval_s: float = WATCH_INTERVAL_S,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """`status --watch`: a line per active move every `interval_s`, until the move (without one:
    every move seen) is done or aborted, or Ctrl-C; 0 either way."""
    if interval_s <= 0:
        raise MoveError(f"--interval {interval_s}: give a positive number of seconds")
    watch = _Watch(databases, move_id)
    try:
        while watch.look():
            sleep(interval_s)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends watching, not the move: nothing went wrong
    return 0


def _run(move: Move, stop_after: str | None, agreement: Sequence[str] = (), timeout_s: float = 30.0) -> int:
    until = Phase(stop_after) if stop_after else Phase.DONE
    record = move.run(until=until)
    print(_describe(record))
    fact = record.committed_fact
    if agreement and fact is not None:
        _print_progress(f"waiting up to {timeout_s:g} s for every process to follow the published map")
        print(wait_for_agreement(agreement, fact.map_version, timeout_s=timeout_s).summary())
    if record.phase is not Phase.DONE:
        print(
            f"stopped after {record.phase.value}; go on with: shard-router reshard resume {record.plan.move_id}"
        )
    return 0


def main(argv: Sequence[str] | None = None, *, default_dir: Path | None = None) -> int:
    """Entry point; returns the exit code (2: the move cannot start or go on, with the reason)."""
    # Intermixed: `status --watch MOVE` puts an option between the two positionals.
    args = _parser(default_dir).parse_intermixed_args(argv)
    try:
        databases = _databases(args, default_dir)
        settings = MoveSettings(cutover_lag_bytes=args.cutover_lag_bytes, drain_timeout_s=args.drain_timeout)
        if args.watch and args.command != "status":
            raise MoveError("--watch goes with status: shard-router reshard status --watch [MOVE]")
        if args.command == "status":
            return _status(args, databases)
        store = _map_store(args, default_dir)
        if args.command == "show-map":
            return _show_map(store, databases, args.move_id)
        if args.command in ("resume", "abort"):
            if not args.move_id:
                raise MoveError(f"reshard {args.command} needs the move's id (see reshard status)")
            record = find_move(databases, args.move_id)
        else:
            record = _start(args, store, databases)
        with Move(
            record, map_store=store, databases=databases, settings=settings, progress=_print_progress
        ) as mv:
            if args.command == "abort":
                print(_describe(mv.abort()))
                return 0
            return _run(mv, args.stop_after, args.agreement, args.agreement_timeout)
    except (MoveError, ShardMapError, DrainError) as exc:
        print(f"shard-router reshard: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(
            f"shard-router reshard: a shard database is unreachable: {exc}; resume the move", file=sys.stderr
        )
        return 2


def _status(args: argparse.Namespace, databases: ShardDatabases) -> int:
    """`reshard status [MOVE]`: the moves once (as text or JSON), or `--watch`ed."""
    if args.watch:
        if args.json:
            raise MoveError("--watch prints lines; leave out --json")
        return watch_moves(databases, args.move_id, interval_s=args.interval)
    moves = [find_move(databases, args.move_id)] if args.move_id else list_moves(databases)
    if args.json:
        print(json.dumps([_as_json(m) for m in moves], indent=2))
    else:
        print("\n".join(_describe(m) for m in moves) or "no moves")
    return 0


def _start(args: argparse.Namespace, store: MapStore, databases: ShardDatabases) -> MoveRecord:
    """A new move of `--slots` to `--to`, planned and journaled (nothing made yet)."""
    if not args.slots or not args.target:
        raise MoveError("a move needs --slots FIRST-LAST and --to SHARD")
    first, last = parse_slot_range(args.slots, store.load().slots)
    record = start_move(store, databases, first, last, args.target)
    _print_progress(
        f"move {record.plan.move_id}: slots {first}-{last} from {record.plan.source} to {record.plan.target}"
    )
    failpoints.reached(phase_failpoint(Phase.PLANNED))  # journaled, nothing made yet
    return record


def _as_json(record: MoveRecord) -> dict[str, object]:
    p = record.plan
    return {
        "move_id": p.move_id,
        "slots": [p.first_slot, p.last_slot],
        "source": p.source,
        "target": p.target,
        "phase": record.phase.value,
        "objects": [o.as_json() for o in record.objects],
        "figures": record.figures,
    }


__all__ = ["main", "watch_moves"]
