"""What tracing costs a shard: the real daemon with tracing off and on, side by side in one run.

    .venv/bin/python -m bench.tracing_overhead [--rounds 4] [--seconds 5] [--clients 2] [--threads 8]

Starts a throw-away PostgreSQL on loopback and two real shard daemons (`shardd.server.start_shard`) on
four databases of it: one with tracing off (no provider: no tracing interceptor, no spans, no
statement instrumentation), one with tracing on (SERVER, idempotency, db.transaction and statement
spans, a batch processor exporting to an exporter that only counts), one with tracing on but no
statement spans (`SHARDD_TRACE_STATEMENTS=false`), and one with tracing on but sampling 10 % of traces (`parentbased_traceidratio` 0.1, what a busy production shard would run). Load comes from separate processes
(threads sending `Deposit` with fresh keys, and every fourth call a replay of an earlier key), and the
two daemons are loaded in turn, round after round, so both see the same machine. Prints calls per
second of each round and the ratio on/off; the figures are only comparable within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased


class CountingExporter(SpanExporter):
    """Drops spans after counting them: the cost measured is making spans, not shipping them."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Count the spans and drop them."""
        self.count += len(spans)
        return SpanExportResult.SUCCESS


def _load(address: str, seconds: float, threads: int, results: multiprocessing.Queue[int]) -> None:
    import grpc

    from shardrouter.core.keys import new_key
    from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

    done = [0] * threads
    stop_at = time.monotonic() + seconds

    def run(slot: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            request = transfer_pb2.DepositRequest(
                account_id=f"bench-{slot}", amount=transfer_pb2.Money(amount_minor=1, currency="EUR")
            )
            earlier = str(new_key())
            n = 0
            while time.monotonic() < stop_at:
                key = earlier if n % 4 == 3 else str(new_key())
                stub.Deposit(request, metadata=(("idempotency-key", key),), timeout=10)
                earlier = key
                n += 1
            done[slot] = n

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    results.put(sum(done))


def _round(address: str, seconds: float, clients: int, threads: int) -> float:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[int] = context.Queue()
    procs = [context.Process(target=_load, args=(address, seconds, threads, results)) for _ in range(clients)]
    started = time.monotonic()
    for p in procs:
        p.start()
    total = sum(results.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    return total / (time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    """Load the four daemons in turn, round after round, and print the medians."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=2, help="load processes")
    parser.add_argument("--threads", type=int, default=8, help="threads per load process")
    args = parser.parse_args(argv)

    from shardrouter.core import tracing
    from shardrouter.localcluster.postgres import LocalPostgres
    from shardrouter.shardd.server import start_shard
    from shardrouter.shardd.settings import ShardSettings

    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as work:
        postgres = LocalPostgres(Path(work) / "pg")
        postgres.start()
        exporter = CountingExporter()
        providers = {
            "off": None,
            "on": tracing.new_tracer_provider("shardd/bench", [exporter]),
            "on-no-sql": tracing.new_tracer_provider("shardd/bench", [exporter]),
            "sampled": tracing.new_tracer_provider(
                "shardd/bench", [exporter], sampler=ParentBased(TraceIdRatioBased(0.1))
            ),
        }
        daemons = {}
        try:
            for name, provider in providers.items():
                postgres.create_database(f"bench_{name}")
                settings = ShardSettings(
                    dsn=postgres.dsn_for(f"bench_{name}"),
                    listen="127.0.0.1:0",
                    metrics_port=0,
                    dev_mode=True,
                    relay_workers=0,
                    max_in_flight=64,
                    max_waiting=64,
                    workers=80,
                    trace_statements=name != "on-no-sql",
                )
                daemons[name] = start_shard(settings, tracer_provider=provider)
            rates: dict[str, list[float]] = {name: [] for name in providers}
            for number in range(1, args.rounds + 1):
                order = list(providers) if number % 2 else list(reversed(providers))
                for name in order:
                    address = f"127.0.0.1:{daemons[name].port}"
                    rates[name].append(_round(address, args.seconds, args.clients, args.threads))
                print(
                    f"round {number}: "
                    + ", ".join(f"{name} {rates[name][-1]:7.1f} calls/s" for name in providers),
                    flush=True,
                )
        finally:
            for daemon in daemons.values():
                daemon.stop(1.0)
            for provider in providers.values():
                if provider is not None:
                    provider.shutdown()
            postgres.destroy()
    off = statistics.median(rates["off"])
    for name in ("on", "on-no-sql", "sampled"):
        median = statistics.median(rates[name])
        print(f"median {name}: {median:.1f} calls/s = {median / off:.3f} x tracing off ({off:.1f} calls/s)")
    print(f"spans exported: {exporter.count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
