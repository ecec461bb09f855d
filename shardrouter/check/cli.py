"""`shard-router check`: drive a workload through your router, then prove from its history and your
shard databases that every operation took effect exactly once.

    shard-router check                                  # the local cluster: its router, its databases
    shard-router check --target router:50051 --databases databases.yaml --operations 2000 \\
        --duration 600 --concurrency 16 --seed 7 --history check.jsonl
    shard-router check --verify check.jsonl --databases databases.yaml   # prove an earlier run again

`--databases` is the YAML file of `shard-id: DSN` that `shard-router reconcile` reads (`--dsn
SHARD=DSN` adds or overrides one); every shard must be given, or a credit on a shard left out looks
lost. Run it while your own chaos tool kills daemons, routers or database primaries: every attempt
the faults break is resent with its key until it has a definite answer (or the operation's time runs
out: it is then reported pending, and its effect, if any, is counted as such).

Exit codes: 0 every proof holds, 1 a violation (each named by key, with its attempts), 2 usage or
connection errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from shardrouter.check.drive import Workload, drive
from shardrouter.check.history import History, read_history
from shardrouter.check.http import CallerTls
from shardrouter.check.verify import Verdict, prove
from shardrouter.core.shard_dsns import parse_shard_dsn_pairs, read_shard_dsns

#: `--kill-orchestrator-mid-move` without `--move-every` moves this often (s); the local cluster's
#: faults (`localcluster.check_faults`) read it from here.
DEFAULT_MOVE_EVERY_S = 3.0


class UsageError(Exception):
    """A command line that cannot work (exit 2)."""


def _parser(default_dir: Path | None) -> argparse.ArgumentParser:
    w = Workload()
    local = f" (default: the local cluster's, in {default_dir})" if default_dir else ""
    p = argparse.ArgumentParser(
        prog="shard-router check",
        description="Drive a workload through a router and prove from the history and the shard "
        "databases that every operation has one answer and took effect exactly once.",
    )
    p.add_argument(
        "--target", default="127.0.0.1:50051", help="the router's gRPC address (default %(default)s)"
    )
    p.add_argument(
        "--http",
        default="",
        metavar="URL",
        help="send over the router's HTTP/JSON front at URL (e.g. http://127.0.0.1:8080) instead of gRPC",
    )
    _tls_flags(p)
    p.add_argument("--databases", type=Path, help="YAML of shard-id: DSN" + local)
    p.add_argument(
        "--dsn", action="append", default=[], metavar="SHARD=DSN", help="a shard's database (repeatable)"
    )
    p.add_argument(
        "--history",
        type=Path,
        help="the history file to write (default: check-<time>.jsonl, in the local cluster's data directory when it is checked, else here)",
    )
    p.add_argument(
        "--verify", type=Path, metavar="HISTORY", help="send nothing: prove an earlier run's history"
    )
    p.add_argument(
        "--operations",
        type=int,
        default=w.operations,
        help="operations after the seed deposits (default %(default)s)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=w.duration_s,
        help="start no operation after this many seconds (default %(default)s)",
    )
    p.add_argument(
        "--concurrency", type=int, default=w.concurrency, help="operations at once (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=w.seed, help="the mix's random seed (default %(default)s)")
    p.add_argument(
        "--accounts", type=int, default=w.accounts, help="accounts the run opens (default %(default)s)"
    )
    p.add_argument("--currency", default=w.currency, help="(default %(default)s)")
    p.add_argument(
        "--expired-keys",
        type=int,
        default=w.expired_keys,
        help="deposits under a 400-day-old key (default %(default)s)",
    )
    p.add_argument("--caller", default="", help="x-caller-id to send (a router that trusts it forwards it)")
    p.add_argument(
        "--operation-timeout",
        type=float,
        default=w.operation_timeout_s,
        help="how long one operation is resent before it is left pending (default %(default)s s)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="how long to wait for transfers in flight before proving (default %(default)s s)",
    )
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    _fault_flags(p)
    return p


def _tls_flags(p: argparse.ArgumentParser) -> None:
    """How the checker reaches a router that speaks TLS (`_tls` checks them)."""
    p.add_argument(
        "--tls-ca",
        default="",
        metavar="FILE",
        help="call the router over TLS, trusting this CA (PEM) for its certificate",
    )
    p.add_argument(
        "--tls-cert",
        default="",
        metavar="FILE",
        help="with --tls-ca: a client certificate (PEM) for a router that verifies its callers (mTLS)",
    )
    p.add_argument("--tls-key", default="", metavar="FILE", help="with --tls-cert: its private key (PEM)")


def _fault_flags(p: argparse.ArgumentParser) -> None:
    """Flags `shard-router check --local-cluster` reads (`localcluster.check_faults`), listed here for --help."""
    faults = p.add_argument_group(
        "faults on a local cluster of the check's own (`shard-router check --local-cluster`)"
    )
    faults.add_argument(
        "--local-cluster", action="store_true", help="start a local cluster for the run, delete it after"
    )
    faults.add_argument("--shards", type=int, default=2, help="its shards (default %(default)s)")
    faults.add_argument(
        "--kill-shard-daemon-every",
        type=float,
        default=0,
        metavar="S",
        help="SIGKILL a shard daemon (each in turn) every S seconds, start it again 0.5 s later",
    )
    faults.add_argument(
        "--kill-router-every", type=float, default=0, metavar="S", help="the same for the router"
    )
    faults.add_argument(
        "--kill-postgres-every",
        type=float,
        default=0,
        metavar="S",
        help="SIGKILL a shard's PostgreSQL (each in turn; postmaster and backends) every S seconds, "
        "start it again 0.5 s later",
    )
    faults.add_argument(
        "--failover-every",
        type=float,
        default=0,
        metavar="S",
        help="run each shard as primary plus synchronous standby; every S seconds, SIGKILL a shard's "
        "primary and promote its standby (each shard once)",
    )
    faults.add_argument(
        "--move-every",
        type=float,
        default=0,
        metavar="S",
        help="every S seconds, move half of the first shard's first slot range to the second shard, "
        "then back (shard-router reshard)",
    )
    faults.add_argument(
        "--kill-orchestrator-mid-move",
        action="store_true",
        help="SIGKILL each move's orchestrator after one of its steps (in turn), then resume the move "
        f"from its journal with a new one (moves every {DEFAULT_MOVE_EVERY_S:g} s unless --move-every)",
    )


def _databases(args: argparse.Namespace, default_dir: Path | None) -> dict[str, str]:
    dsns: dict[str, str] = {}
    path = args.databases or (default_dir / "databases.yaml" if default_dir else None)
    try:
        if path is not None and (args.databases is not None or (path.exists() and not args.dsn)):
            dsns.update(read_shard_dsns(path))
        dsns.update(parse_shard_dsn_pairs("--dsn", args.dsn))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not dsns:
        raise UsageError("no shard databases given: --databases FILE or --dsn SHARD=DSN (one per shard)")
    return dsns


def _default_history(args: argparse.Namespace, default_dir: Path | None) -> Path:
    """check-<time>.jsonl: in the local cluster's data directory when its databases are checked,
    else here."""
    local = default_dir is not None and args.databases is None and not args.dsn
    where = default_dir if local and default_dir is not None else Path.cwd()
    return where / datetime.now(UTC).strftime("check-%Y%m%dT%H%M%SZ.jsonl")


def _tls(args: argparse.Namespace) -> CallerTls | None:
    """The TLS flags, checked: a client certificate needs its key and the router's CA."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        raise UsageError("--tls-cert needs --tls-ca (the CA of the router's certificate)")
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not Path(path).is_file():
            raise UsageError(f"{flag} {path}: no such file")
    return CallerTls(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None


def _workload(args: argparse.Namespace) -> Workload:
    if args.operations < 0 or args.concurrency < 1 or args.accounts < 2:
        raise UsageError("--operations must be >= 0, --concurrency >= 1, --accounts >= 2")
    return Workload(
        operations=args.operations,
        duration_s=args.duration,
        concurrency=args.concurrency,
        seed=args.seed,
        accounts=args.accounts,
        currency=args.currency,
        expired_keys=args.expired_keys,
        operation_timeout_s=args.operation_timeout,
        caller=args.caller,
    )


def _attempt_lines(history: History, key: str) -> list[str]:
    lines = []
    for a in history.attempts.get(key, []):
        when = datetime.fromtimestamp(a.ended_at, UTC).strftime("%H:%M:%S.%f")[:-3]
        said = f"{a.code}" + (f" {a.reason}" if a.reason else "") + (" replayed" if a.replayed else "")
        lines.append(
            f"      {when} {a.role:<19} {a.method.rsplit('/', 1)[-1]:<8} {said} response {a.response_b64[:24] or '-'}"
        )
    return lines


def render(verdict: Verdict, history: History) -> str:
    """The verdict in words: figures, money, each violation with its key's attempts."""
    f, m = verdict.figures, verdict.money
    lines = [
        f"operations {f['operations']} ({f['deposits']} deposits, {f['same_shard']} same-shard, "
        f"{f['cross_shard']} cross-shard and {f['to_unopened']} to an unopened account), attempts {f['attempts']}",
        f"answers: {f['acknowledged']} acknowledged, {f['refused']} refused, {f['pending']} pending",
        f"duplicates: {f['in_flight_duplicates']} in flight, {f['later_duplicates']} after the answer, "
        f"{f['resends']} resends; {f['replays']} replays; {f['reused_bodies']} keys reused with another body "
        f"({f['reused_refused']} refused as reused); {f['expired_keys']} expired keys ({f['expired_refused']} refused as expired)",
        f"transfers: {f['credited_same_shard']} credited on their shard; across shards {f['credited']} credited, "
        f"{f['refunded']} refunded, {f['in_flight_transfers']} in flight",
        f"money: deposits acknowledged {m['acknowledged_deposits']} + applied unanswered {m['unanswered_deposits_applied']}"
        f" = balances {m['balances']} + in flight {m['in_flight']}",
    ]
    for v in verdict.violations:
        lines.append(
            f"  {v.kind.value}: " + (f"key {v.key}" if v.key else f"account {v.account}") + f": {v.detail}"
        )
        lines += _attempt_lines(history, v.key)
    if verdict.pending:
        lines.append(f"pending (no definite answer): {', '.join(verdict.pending[:20])}")
    if f["acknowledged"] == 0:
        lines.append(
            "note: no operation was acknowledged, so little was proven: is the caller allowed to call?"
        )
    lines.append(
        "verdict: PASS, every proof holds"
        if verdict.ok
        else f"verdict: FAIL, {len(verdict.violations)} violation(s)"
    )
    return "\n".join(lines)


def as_json(verdict: Verdict) -> dict[str, object]:
    """The verdict for `--json`."""
    return {
        "ok": verdict.ok,
        "figures": verdict.figures,
        "money": verdict.money,
        "pending": verdict.pending,
        "in_flight": verdict.in_flight,
        "violations": [{**dataclasses.asdict(v), "kind": v.kind.value} for v in verdict.violations],
    }


def main(
    argv: Sequence[str] | None = None,
    *,
    default_dir: Path | None = None,
    before_proof: Callable[[], str] | None = None,
) -> int:
    """Entry point; 0 all proofs hold, 1 violations, 2 usage or connection errors. `before_proof`
    runs once the workload is sent (the local cluster's faults stop there) and says what it did."""
    args = _parser(default_dir).parse_args(argv)
    out = sys.stderr if args.json else sys.stdout  # --json prints one document
    try:
        if before_proof is None and (
            args.local_cluster
            or args.kill_shard_daemon_every
            or args.kill_router_every
            or args.kill_postgres_every
            or args.failover_every
            or args.move_every
            or args.kill_orchestrator_mid_move
        ):
            raise UsageError(
                "--local-cluster and its faults are options of the installed `shard-router check`"
            )
        dsns = _databases(args, default_dir)
        path = args.verify
        if path is None:
            path = args.history or _default_history(args, default_dir)
            summary = drive(args.target, dsns, _workload(args), path, args.http, _tls(args))
            print(
                f"sent {summary.operations} operations in {summary.attempts} attempts, {summary.seconds:.1f} s; history {path}",
                file=out,
                flush=True,
            )
        if before_proof is not None:
            print(before_proof(), file=out, flush=True)
        history = read_history(path)
        verdict = prove(history, dsns, settle_s=args.settle)
    except UsageError as exc:
        print(f"shard-router check: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"shard-router check: {exc}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        reason = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
        print(f"shard-router check: a shard database: {reason}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(verdict), indent=2) if args.json else render(verdict, history), flush=True)
    return 0 if verdict.ok else 1


__all__ = ["DEFAULT_MOVE_EVERY_S", "UsageError", "as_json", "main", "render"]
