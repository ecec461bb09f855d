"""What a replica identity costs in WAL: bytes per Deposit and per Transfer, side by side in one run.

    .venv/bin/python -m bench.replica_identity_wal [--rounds 5] [--calls 500] [--threads 4]

A move's publication filters rows by `account_hash`, so every moved table needs a replica identity
holding that column (migration 15 sets it once). With `wal_level = logical` an UPDATE or DELETE
then logs the old row's identity as well: the whole old row under FULL, only the key columns
under USING INDEX, and only when they changed; an index costs its own WAL on every INSERT. This
starts a throw-away PostgreSQL (wal_level = logical, as every shard's) and one real shard daemon
per variant, each on its own database, and gives their moved tables (partitions included):

- `default`: the primary key, what schema 14 had between moves;
- `full`: REPLICA IDENTITY FULL on every moved table;
- `index`: USING INDEX on a unique (primary key, account_hash) index where account_hash is NOT NULL
  (all but `idempotency_record`, whose hash is NULL for calls routed by a transfer id: FULL there).

Then, round after round and variant after variant (one at a time, so the WAL position counts that
variant's calls alone), it sends `--calls` Deposits with new keys and `--calls` same-shard
Transfers, and reads `pg_current_wal_lsn()` before and after each. A CHECKPOINT and a warm-up
precede every cell; autovacuum and full-page writes are off (a page's first change after a checkpoint
logs the whole page whatever the identity, which only adds noise here). Prints WAL bytes per call, the
median over rounds, and each variant's ratio to `default`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

if TYPE_CHECKING:
    from shardrouter.localcluster.postgres import LocalPostgres
    from shardrouter.shardd.server import ShardDaemon

VARIANTS = ("default", "full", "index")
ACCOUNTS = 64
#: Tables whose account_hash is NOT NULL, with their primary key columns.
_KEYED = {
    "accounts": ("id",),
    "ledger_entries": ("id",),
    "transfers": ("id",),
    "outbox": ("id",),
    "delivery_attempts": ("id",),
    "dead_letters": ("transfer_id",),
}


def apply_identity(conn: psycopg.Connection[Any], variant: str) -> None:
    """Give every moved table (and partition) the variant's replica identity."""
    from shardrouter.reshard.replication import replicated_relations

    for table in replicated_relations(conn):
        ident = sql.Identifier(table)
        if variant == "index" and table in _KEYED:
            index = sql.Identifier(f"{table}_replica_identity")
            columns = sql.SQL(", ").join(sql.Identifier(c) for c in (*_KEYED[table], "account_hash"))
            conn.execute(
                sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} ({})").format(index, ident, columns)
            )
            conn.execute(sql.SQL("ALTER TABLE {} REPLICA IDENTITY USING INDEX {}").format(ident, index))
        elif variant == "default":
            conn.execute(sql.SQL("ALTER TABLE {} REPLICA IDENTITY DEFAULT").format(ident))
        else:
            conn.execute(sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(ident))


def _calls(address: str, method: str, calls: int, threads: int) -> int:
    """Send `calls` calls with new keys from `threads` threads; returns the errors."""
    import grpc

    from shardrouter.core.keys import new_key
    from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

    errors = [0] * threads

    def run(slot: int) -> None:
        rng = random.Random(slot)
        with grpc.insecure_channel(address) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            for _ in range(calls // threads + (1 if slot < calls % threads else 0)):
                meta = (("idempotency-key", str(new_key())),)
                source, dest = rng.sample(range(ACCOUNTS), 2)
                try:
                    if method == "Deposit":
                        stub.Deposit(
                            transfer_pb2.DepositRequest(
                                account_id=f"wal-{source}",
                                amount=transfer_pb2.Money(amount_minor=100, currency="EUR"),
                                reference="bench",
                            ),
                            metadata=meta,
                            timeout=10,
                        )
                    else:
                        stub.Transfer(
                            transfer_pb2.TransferRequest(
                                source_account_id=f"wal-{source}",
                                destination_account_id=f"wal-{dest}",
                                amount=transfer_pb2.Money(amount_minor=1, currency="EUR"),
                                reference="bench",
                            ),
                            metadata=meta,
                            timeout=10,
                        )
                except grpc.RpcError:
                    errors[slot] += 1

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(errors)


def _wal_lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _cell(conn: psycopg.Connection[Any], address: str, method: str, calls: int, threads: int) -> float:
    """WAL bytes per call of one method against one daemon."""
    conn.execute("CHECKPOINT")
    _calls(address, method, max(threads, calls // 10), threads)  # warm-up: pages touched, plans made
    before = _wal_lsn(conn)
    errors = _calls(address, method, calls, threads)
    after = _wal_lsn(conn)
    if errors:
        raise RuntimeError(f"{errors} of {calls} {method} calls failed")
    return (after - before) / calls


def main(argv: list[str] | None = None) -> int:
    """Measure every variant, round after round, and print the medians and ratios."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=500, help="calls per cell")
    parser.add_argument("--threads", type=int, default=4, help="calls in flight")
    args = parser.parse_args(argv)

    from shardrouter.localcluster.postgres import LocalPostgres

    with tempfile.TemporaryDirectory(prefix="bench-wal-") as work:
        postgres = LocalPostgres(Path(work) / "pg")
        postgres.start()
        daemons: dict[str, ShardDaemon] = {}
        admin = psycopg.connect(postgres.dsn_for("postgres"), autocommit=True)
        _count_only_the_calls(admin)
        try:
            for variant in VARIANTS:
                daemons[variant] = _variant_shard(postgres, variant)
            figures = _measure(admin, {v: f"127.0.0.1:{d.port}" for v, d in daemons.items()}, args)
        finally:
            admin.close()
            for daemon in daemons.values():
                daemon.stop(1.0)
            postgres.destroy()
    _print_medians(figures, args)
    return 0


def _count_only_the_calls(admin: psycopg.Connection[Any]) -> None:
    """Nothing but the calls' own records may be counted: no autovacuum, no timed checkpoint, and
    no full-page images (the first change of a page after a checkpoint logs the whole page,
    whatever the identity: with 64 accounts' index leaves that swung a cell by 20 %)."""
    admin.execute("ALTER SYSTEM SET autovacuum = off")
    admin.execute("ALTER SYSTEM SET checkpoint_timeout = '1h'")
    admin.execute("ALTER SYSTEM SET full_page_writes = off")
    admin.execute("SELECT pg_reload_conf()")


def _variant_shard(postgres: LocalPostgres, variant: str) -> ShardDaemon:
    """A shard daemon on a database of its own with the variant's replica identity, its accounts
    funded for the transfers."""
    from shardrouter.shardd.server import start_shard
    from shardrouter.shardd.settings import ShardSettings

    postgres.create_database(f"wal_{variant}")
    settings = ShardSettings(
        dsn=postgres.dsn_for(f"wal_{variant}"),
        listen="127.0.0.1:0",
        metrics_port=0,
        dev_mode=True,
        relay_workers=0,
        max_in_flight=64,
        max_waiting=64,
        workers=136,
    )
    daemon = start_shard(settings)
    with psycopg.connect(postgres.dsn_for(f"wal_{variant}"), autocommit=True) as conn:
        apply_identity(conn, variant)
    for account in range(ACCOUNTS):
        _calls_one_deposit(f"127.0.0.1:{daemon.port}", f"wal-{account}")
    return daemon


def _measure(
    admin: psycopg.Connection[Any], addresses: dict[str, str], args: argparse.Namespace
) -> dict[tuple[str, str], list[float]]:
    """(variant, method) -> WAL bytes per call of each round; every other round in reverse order."""
    figures: dict[tuple[str, str], list[float]] = {
        (v, m): [] for v in VARIANTS for m in ("Deposit", "Transfer")
    }
    for number in range(1, args.rounds + 1):
        order = list(VARIANTS) if number % 2 else list(reversed(VARIANTS))
        for variant in order:
            for method in ("Deposit", "Transfer"):
                figures[(variant, method)].append(
                    _cell(admin, addresses[variant], method, args.calls, args.threads)
                )
        print(
            f"round {number}: "
            + "; ".join(
                f"{v} {figures[(v, 'Deposit')][-1]:.0f} / {figures[(v, 'Transfer')][-1]:.0f}"
                for v in VARIANTS
            )
            + " WAL bytes per Deposit / Transfer",
            flush=True,
        )
    return figures


def _print_medians(figures: dict[tuple[str, str], list[float]], args: argparse.Namespace) -> None:
    print(
        f"\nWAL bytes per call, median of {args.rounds} rounds of {args.calls} calls ({args.threads} in flight);"
    )
    print(
        "x default: the median of each round's ratio to that round's default (the tables grow between rounds)"
    )
    print(f"{'identity':<10} {'Deposit':>9} {'x default':>10} {'Transfer':>9} {'x default':>10}")
    for variant in VARIANTS:
        cells = []
        for method in ("Deposit", "Transfer"):
            ratios = [
                v / d for v, d in zip(figures[(variant, method)], figures[("default", method)], strict=True)
            ]
            cells.append(
                f"{statistics.median(figures[(variant, method)]):>9.0f} {statistics.median(ratios):>10.3f}"
            )
        print(f"{variant:<10} {' '.join(cells)}")


def _calls_one_deposit(address: str, account: str) -> None:
    import grpc

    from shardrouter.core.keys import new_key
    from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
            transfer_pb2.DepositRequest(
                account_id=account, amount=transfer_pb2.Money(amount_minor=10**9, currency="EUR")
            ),
            metadata=(("idempotency-key", str(new_key())),),
            timeout=10,
        )


if __name__ == "__main__":
    sys.exit(main())
