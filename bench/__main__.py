"""`python -m bench`: run the benchmark and print its table (bench/README.md).

.venv/bin/python -m bench                                  # everything, default sizes (~8 min)
.venv/bin/python -m bench --duration 2 --concurrency 1,8 --scenarios shard-deposit,pgbench-limit
.venv/bin/python -m bench --growth 0,1e6,1e7 --markdown bench/last-run.md --json bench/last-run.json
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

from bench.report import text_report, write_reports
from bench.run import SCENARIOS, RunOptions, run


def _ints(text: str) -> tuple[int, ...]:
    """ "1,8,32" or "0,1e6,1e7" -> integers; "" or "none" -> ()."""
    if text.strip().lower() in ("", "none", "off"):
        return ()
    return tuple(int(float(part)) for part in text.split(","))


def _scenarios(text: str) -> tuple[str, ...]:
    if text == "all":
        return SCENARIOS
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    return names


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("SHARDD_"):
        raise argparse.ArgumentTypeError("expected SHARDD_NAME=value")
    return name, value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell (default 5)")
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="unmeasured seconds before each cell (default 1)"
    )
    parser.add_argument(
        "--concurrency",
        type=_ints,
        default=(1, 8, 32, 128),
        help="comma-separated concurrencies (default 1,8,32,128)",
    )
    parser.add_argument(
        "--scenarios",
        type=_scenarios,
        default=SCENARIOS,
        help="comma-separated scenarios or 'all' (default); see --list",
    )
    parser.add_argument(
        "--growth",
        type=_ints,
        default=(0, 1_000_000),
        help="key-table sizes for the growth rows, e.g. 0,1e6,1e7; 'none' skips (default 0,1e6)",
    )
    parser.add_argument(
        "--growth-concurrency",
        type=int,
        default=0,
        help="concurrency of the growth cells (default: the best of shard-deposit, else 32)",
    )
    parser.add_argument("--accounts", type=int, default=1000, help="accounts per shard the load picks from")
    parser.add_argument(
        "--replay-keys", type=int, default=5000, help="distinct completed keys the replay rows resend"
    )
    parser.add_argument(
        "--shard-env",
        type=_env_pair,
        action="append",
        default=[],
        help="extra SHARDD_NAME=value for every shard daemon (repeatable)",
    )
    parser.add_argument(
        "--round-trip-calls",
        type=int,
        default=300,
        help="calls counted in each round-trips cell, one at a time (default 300)",
    )
    parser.add_argument(
        "--statement-stats",
        choices=("on", "off"),
        default="on",
        help="preload pg_stat_statements (statements per call in the round-trips rows; default on)",
    )
    parser.add_argument("--json", type=Path, help="also write the full results as JSON here")
    parser.add_argument(
        "--markdown", type=Path, help="also write the tables (and captured SQL) as Markdown here"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the temp dir (logs, scripts) for inspection"
    )
    parser.add_argument("--list", action="store_true", help="describe the scenarios and exit")
    return parser.parse_args(argv)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM takes the same way out as Ctrl-C: the context managers stop every process.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        from bench import run as run_module

        print(run_module.__doc__)
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)
    options = RunOptions(
        duration_s=args.duration,
        warmup_s=args.warmup,
        concurrencies=args.concurrency,
        scenarios=args.scenarios,
        growth=args.growth,
        growth_concurrency=args.growth_concurrency,
        accounts=args.accounts,
        replay_keys=args.replay_keys,
        shard_env=dict(args.shard_env),
        keep=args.keep,
        round_trip_calls=args.round_trip_calls,
        statement_stats=args.statement_stats == "on",
    )
    try:
        result = run(options, progress=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("bench: interrupted; every process was stopped and the temp dir removed", file=sys.stderr)
        return 130
    print()
    print(text_report(result))
    write_reports(result, json_path=args.json, markdown_path=args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
