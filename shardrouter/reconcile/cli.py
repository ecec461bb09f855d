"""`shard-router reconcile`: compare what the shards say about each other, and repair.

    shard-router reconcile                           # the local cluster's shards: report, exit 0/1
    shard-router reconcile --json                    # the same report for machines
    shard-router reconcile --dsn shard-0=DSN --dsn shard-1=DSN
    shard-router reconcile --databases databases.yaml --since 2026-12-05T04:00:00Z
    shard-router reconcile --repair                  # repair what is safe, wait for it, report again
    shard-router reconcile --repair --reverse-orphan-credits   # also take back credits without debit

Each shard's database DSN comes from a YAML file of `shard-id: DSN` (`--databases`) or from
`--dsn SHARD=DSN` (`--shard` is the same); the local cluster (`shard-router dev up`) writes
`databases.yaml` into its data directory, which is the default. Every shard must be given: a credit
on a shard left out would look missing; with `--map FILE` (by default the local cluster's
`shard-map.yaml`, with its `databases.yaml`), a shard of the map without a database is a usage error.

Exit codes: 0 consistent (after `--repair`: consistent once the repairs landed), 1 mismatches
remain, 2 usage or connection errors.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from shardrouter.core.shard_dsns import parse_shard_dsn_pairs, read_shard_dsns
from shardrouter.core.shardmap import ShardMapError, load_shard_map
from shardrouter.reconcile import repair
from shardrouter.reconcile.check import Report, check
from shardrouter.reconcile.facts import connect
from shardrouter.reconcile.report import render

#: How long `--repair` waits, by default, for the relays to deliver what it re-queued (s).
WAIT_S = 30.0
_POLL_S = 0.2


class UsageError(Exception):
    """A command line or configuration that cannot work (exit 2)."""


def _parser(default_dir: Path | None) -> argparse.ArgumentParser:
    where = f" (default: {default_dir}/databases.yaml, the local cluster's)" if default_dir else ""
    parser = argparse.ArgumentParser(
        prog="shard-router reconcile",
        description="Compare what the shards' databases say about each other's transfers; report "
        "every mismatch with what to do; with --repair, repair what is safely repairable, exactly once.",
    )
    parser.add_argument("--databases", type=Path, help="YAML of shard-id: DSN" + where)
    parser.add_argument(
        "--dsn",
        "--shard",
        dest="dsn",
        action="append",
        default=[],
        metavar="SHARD=DSN",
        help="a shard's database (repeatable; overrides --databases for that shard)",
    )
    parser.add_argument(
        "--map",
        type=Path,
        help="a shard map file: every shard it names must be given a database"
        + (
            f" (default: {default_dir}/shard-map.yaml when the databases are the local cluster's)"
            if default_dir
            else ""
        ),
    )
    parser.add_argument(
        "--since",
        help="only transfers touched since then (ISO time, or an age like 90m, 6h, 2d); money is then "
        "not added up",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="re-queue lost credits with their original keys, queue credits never queued, hand refunds "
        "back to the refund path; then wait for the relays and report again",
    )
    parser.add_argument(
        "--reverse-orphan-credits",
        action="store_true",
        help="with --repair: also take back credits whose debit no shard holds (or that were refunded "
        "too), one reversal entry per transfer",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=WAIT_S,
        help="seconds --repair waits for the relays to deliver what it re-queued (default %(default)s)",
    )
    return parser


def databases(args: argparse.Namespace, default_dir: Path | None) -> dict[str, str]:
    """Shard id -> DSN, from --databases (or the local cluster's file) and --dsn."""
    dsns: dict[str, str] = {}
    path = args.databases or (default_dir / "databases.yaml" if default_dir else None)
    if path is not None and (args.databases is not None or (path.exists() and not args.dsn)):
        try:
            dsns.update(read_shard_dsns(path))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    try:
        dsns.update(parse_shard_dsn_pairs("--dsn", args.dsn))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not dsns:
        raise UsageError("no shard databases given: --databases FILE or --dsn SHARD=DSN (one per shard)")
    local = default_dir is not None and args.databases is None and not args.dsn
    shard_map = args.map or (default_dir / "shard-map.yaml" if local and default_dir else None)
    if shard_map is not None and (args.map is not None or shard_map.exists()):
        try:
            named = [s.id for s in load_shard_map(shard_map).shards]
        except (OSError, ShardMapError) as exc:
            raise UsageError(f"--map {shard_map}: {exc}") from exc
        missing = [s for s in named if s not in dsns]
        if missing:
            raise UsageError(
                f"the shard map {shard_map} names {', '.join(missing)}, with no database given: a credit "
                "there would look missing (give every shard: --databases or --dsn SHARD=DSN)"
            )
    return dsns


_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO time (UTC unless it says) or an age (90m, 6h, 2d) before `now`."""
    match = _AGE.fullmatch(text.strip())
    if match:
        seconds = float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(
            f"--since {text!r}: give an ISO time (2026-12-05T04:00:00Z) or an age (90m, 6h, 2d)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _show(report: Report, as_json: bool, title: str) -> None:
    if as_json:
        print(json.dumps(report.as_json(), indent=2, default=str))
    else:
        print(render(report, title=title), flush=True)


def run_repair(
    dsns: dict[str, str], before: Report, *, reverse_orphans: bool, wait_s: float, since: datetime | None
) -> Report:
    """Repair what `before` found, wait (up to `wait_s`) for the relays to carry the repairs out, and
    return the report read after them (its `repairs` say what this run did)."""
    conns = {shard: connect(dsn) for shard, dsn in dsns.items()}
    try:
        for conn in conns.values():
            conn.autocommit = True  # each repair opens its own transaction
        outcomes = repair.apply(conns, before.mismatches, reverse_orphans=reverse_orphans)
    finally:
        for conn in conns.values():
            conn.close()
    touched: set[uuid.UUID] = {o.mismatch.transfer_id for o in outcomes if o.mismatch.transfer_id}
    give_up = time.monotonic() + max(0.0, wait_s)
    while True:
        after = check(dsns, since=since)
        # Settled means seen settled by both of the check's reads: a repaired credit delivered
        # between its two shards' reads is still moving, and its money still counted in flight.
        waiting = [m for m in after.mismatches if m.transfer_id in touched and m.repair] + [
            t for t in touched if t in after.in_flight_ids or t in after.moving_ids
        ]
        if not waiting or time.monotonic() >= give_up:
            break
        time.sleep(_POLL_S)
    after.repairs = [o.said for o in outcomes]
    if waiting:
        after.notes.append(
            f"{len(waiting)} repaired transfer(s) not settled after {wait_s:g} s: are the shards' relays "
            "running? run reconcile again later"
        )
    return after


def main(argv: Sequence[str] | None = None, *, default_dir: Path | None = None) -> int:
    """Entry point; returns the exit code (0 consistent, 1 mismatches, 2 usage or connection errors)."""
    args = _parser(default_dir).parse_args(argv)
    try:
        if args.reverse_orphan_credits and not args.repair:
            raise UsageError("--reverse-orphan-credits goes with --repair")
        dsns = databases(args, default_dir)
        since = parse_since(args.since) if args.since else None
        report = check(dsns, since=since)
        if not args.repair:
            _show(report, args.json, "reconcile")
            return 0 if report.consistent else 1
        if not args.json:
            _show(report, False, "before repair")
        if report.consistent:
            if args.json:
                print(
                    json.dumps({"before": report.as_json(), "after": report.as_json()}, indent=2, default=str)
                )
            return 0
        after = run_repair(
            dsns, report, reverse_orphans=args.reverse_orphan_credits, wait_s=args.wait, since=since
        )
        if args.json:
            print(json.dumps({"before": report.as_json(), "after": after.as_json()}, indent=2, default=str))
        else:
            _show(after, False, "after repair")
        return 0 if after.consistent else 1
    except UsageError as exc:
        print(f"shard-router reconcile: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        print(f"shard-router reconcile: a shard database is unreachable: {reason}", file=sys.stderr)
        return 2
    except psycopg.errors.UndefinedTable as exc:
        print(
            f"shard-router reconcile: a database is not a shard's (or not migrated): {exc.diag.message_primary}",
            file=sys.stderr,
        )
        return 2


__all__ = ["UsageError", "databases", "main", "parse_since", "run_repair"]
