"""The database work of a guarded call, pinned: how many statements PostgreSQL runs for a new-key
Deposit and for a replay, nested ones (inside functions and triggers) included, so it cannot regrow
without this test saying so.

A PostgreSQL server of its own (pg_stat_statements must be preloaded: `own_postgres`, restarted with
`bench.statement_cost`'s settings), a real shard daemon served in this process under a login of its
own, and the counting of `bench.statement_cost` (calls per statement, one call at a time, an idle
interval subtracted). Counts, not times: they do not depend on the machine's load.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from bench.statement_cost import (
    DATABASE,
    Cell,
    cost_shards,
    create_measured_database,
    preload_statement_stats,
    run_cells,
)
from shardrouter.localcluster.postgres import LocalPostgres
from tests.helpers import own_postgres

#: Per call: statements the daemon sends (BEGIN and COMMIT are not counted once psycopg prepared them)
#: and statements run inside functions and triggers. A new key: the claim (its record read and its
#: lock tried, in one statement), the handler transaction's bounds, the Deposit (a slot fence check
#: on each of its two rows), the record's insert with the lock's hand-over (a fence check). A key
#: dated by receipt reads its record a second time, after the lock. A replay: the claim alone.
BUDGET = {
    "new key (UUIDv7)": (4, 3),
    "replay (UUIDv7)": (1, 0),
    "new key (opaque)": (5, 3),
    "replay (opaque)": (1, 0),
    # The claim with the handler: the bounds go in the claim's statement, and a statement checks
    # that it took the key (which fails for a duplicate, and PostgreSQL skips the rest).
    "new key (UUIDv7, claim ahead)": (4, 3),
    "replay (UUIDv7, claim ahead)": (2, 0),
}
CALLS = 40


@pytest.fixture(scope="module")
def counted() -> Iterator[tuple[LocalPostgres, str]]:
    """A server of this module's own with pg_stat_statements, and the measured database's DSN."""
    servers = own_postgres()
    pg = next(servers)
    preload_statement_stats(pg)
    pg.restart()
    yield pg, create_measured_database(pg)
    next(servers, None)  # stops and deletes it


def _cells(pg: LocalPostgres, dsn: str) -> dict[str, Cell]:
    with cost_shards(pg, dsn) as senders, psycopg.connect(pg.dsn_for(DATABASE), autocommit=True) as conn:
        cells = run_cells(conn, senders, CALLS, 8)
    return {c.name: c for c in cells}


def test_a_guarded_call_runs_no_more_statements_than_its_budget(counted: tuple[LocalPostgres, str]) -> None:
    cells = _cells(*counted)
    found: dict[str, Any] = {}
    for name in BUDGET:
        totals = cells[name].totals()
        found[name] = (round(totals["statements_top"], 2), round(totals["statements_nested"], 2))
    listing = {
        name: [
            f"{s['calls']:.2f} {'top' if s['toplevel'] else 'nested'}: {s['query'][:90]}"
            for s in c.statements
        ]
        for name, c in cells.items()
    }
    for name, (sent, nested) in BUDGET.items():
        top, inner = found[name]
        # A statement the daemon runs by itself during a cell (the partition keeper) counts a
        # fraction of a call: allowed up to a tenth.
        assert top <= sent + 0.1 and inner <= nested + 0.1, (name, found[name], listing[name])
    # One SQL text is one statement: a parameter whose type follows its value (psycopg sends an int
    # as int2, int4 or int8 by size; an account hash is above 2**31 half the time) would split it
    # into two rows here, two prepared statements and plans per connection.
    for name, cell in cells.items():
        texts = [s["query"] for s in cell.statements if s["toplevel"]]
        assert len(texts) == len(set(texts)), (name, listing[name])
    # The counting sees the work at all (a broken snapshot would pass every budget with zeros).
    assert found["new key (UUIDv7)"][0] >= 3.9 and found["new key (UUIDv7)"][1] >= 1
    assert cells["new key (UUIDv7)"].totals()["wal_bytes"] > 0
