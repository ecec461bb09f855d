"""The cut-over's drain decides by the transactions themselves: it waits for the virtual transaction
ids that were running when the fence committed (not for whatever a clock says began earlier), and
refuses while the database has a prepared transaction, which no session holds and which may commit
into the fenced range at any time. On a server of its own, with prepared transactions enabled."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from shardrouter.core.shardmap import DEFAULT_SLOTS
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd import fences
from shardrouter.shardd.fences import DrainTimeout, PreparedTransactions, SlotFence
from shardrouter.shardd.server import prepare_database
from tests.helpers import pg_data_dir

FENCE = SlotFence("m-drain", DEFAULT_SLOTS, 0, DEFAULT_SLOTS - 1)  # every slot


@pytest.fixture(scope="module")
def two_phase_dsn() -> Iterator[str]:
    server = LocalPostgres(pg_data_dir())
    server.start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET max_prepared_transactions = 4")
        server.restart()
        server.create_database("drain")
        dsn = server.dsn_for("drain")
        prepare_database(dsn, timedelta(days=30))
        yield dsn
    finally:
        server.destroy()


def test_a_prepared_writer_from_before_the_fence_stops_the_drain(two_phase_dsn: str) -> None:
    with psycopg.connect(two_phase_dsn, autocommit=True) as control, psycopg.connect(two_phase_dsn) as writer:
        writer.execute("INSERT INTO accounts (id, currency) VALUES ('prepared-acct', 'EUR')")
        writer.execute("PREPARE TRANSACTION 'writer-1'")  # its session is free; the write may commit later
        raised = fences.raise_fence(control, FENCE)
        try:
            with pytest.raises(PreparedTransactions, match="writer-1"):
                fences.drain(control, raised, timeout_s=1)
        finally:
            control.execute("ROLLBACK PREPARED 'writer-1'")
            fences.lower_fence(control, FENCE.move_id)
        fences.drain(control, fences.raise_fence(control, FENCE), timeout_s=1)
        fences.lower_fence(control, FENCE.move_id)


def test_the_drain_waits_for_the_transactions_running_at_the_fence_and_no_others(two_phase_dsn: str) -> None:
    with (
        psycopg.connect(two_phase_dsn, autocommit=True) as control,
        psycopg.connect(two_phase_dsn) as before,
        psycopg.connect(two_phase_dsn) as after,
    ):
        before.execute("SELECT 1")  # in a transaction from before the fence
        pid = before.info.backend_pid
        raised = fences.raise_fence(control, FENCE)
        try:
            assert pid in raised.writers.values()
            after.execute("SELECT 1")  # began after the fence: it sees the fence, nothing to wait for
            with pytest.raises(DrainTimeout) as waited:
                fences.drain(control, raised, timeout_s=0.3)
            assert waited.value.pids == [pid]
            before.commit()
            before.execute("SELECT 1")  # the same session's next transaction is another one
            fences.drain(control, raised, timeout_s=0.3)
        finally:
            fences.lower_fence(control, FENCE.move_id)
