"""Hedged keyed calls (`TransferClient.send_hedged`) against two real daemons of one shard.

A daemon stopped with SIGSTOP (a long GC pause, a starved node) never answers the first attempt;
the hedge, sent to the other daemon with the same key, applies the operation and wins, and the
stalled daemon, resumed, replays it. A first attempt that is merely slow (waiting for a row the
test holds) makes the hedge wait for its outcome instead of being answered ABORTED. Either way the
operation applies once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from shardrouter.client import Hedge, SqliteOperationStore, TransferClient
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.idempotency.waiting import WAIT_CHANNEL
from tests.faults.daemons import OneShard, query
from tests.faults.test_duplicate_waits import SRC, Notes, RowHold


@pytest.fixture
def shard(postgres: LocalPostgres, tmp_path: Path) -> Iterator[OneShard]:
    one = OneShard.build(postgres, tmp_path, extra_env={"SHARDD_HANDLER_LOCK_TIMEOUT_MS": "30000"})
    one.start()
    yield one
    one.stop()


def _deposits(dsn: str, key: str) -> int:
    return len(query(dsn, "SELECT 1 FROM ledger_entries WHERE idempotency_key::text = %s", key))


def test_a_hedge_to_another_daemon_wins_over_a_stalled_one_and_applies_once(
    shard: OneShard, tmp_path: Path
) -> None:
    stalled, other = shard.daemons
    assert stalled.proc is not None
    store = SqliteOperationStore(tmp_path / "ops.db")
    with grpc.insecure_channel(other.address) as to_other, TransferClient(stalled.address, store=store) as client:
        op = client.create_deposit("acct-hedged", 500, "EUR")
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            result = client.send_hedged(op, Hedge(after_s=0.2, channel=to_other), attempt_timeout_s=5.0)
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        assert result.ok, result
        assert not result.replayed  # the hedge ran it
        assert (client.hedges_sent, client.hedges_won) == (1, 1)
        # The stalled daemon, resumed, knows the operation: the same key replays there.
        again = client.send_with_retries(op)
        assert again.ok and again.replayed
    assert _deposits(shard.dsn, op.idempotency_key) == 1


def test_a_hedge_that_lands_while_the_first_attempt_works_waits_for_its_outcome(
    shard: OneShard, tmp_path: Path
) -> None:
    first_daemon, other = shard.daemons
    store = SqliteOperationStore(tmp_path / "ops.db")
    with grpc.insecure_channel(other.address) as to_other, TransferClient(first_daemon.address, store=store) as client:
        assert client.deposit(SRC, 100, "EUR").ok
        op = client.create_deposit(SRC, 500, "EUR")
        notes, hold = Notes(shard.dsn), RowHold(shard.dsn)
        try:
            with ThreadPoolExecutor(1) as pool:
                sending = pool.submit(
                    client.send_hedged, op, Hedge(after_s=0.2, channel=to_other), attempt_timeout_s=8.0
                )
                notes.await_note(WAIT_CHANNEL, op.idempotency_key)  # the hedge waits for the first
                assert not sending.done()
                hold.release()
                result = sending.result(30)
        finally:
            notes.close()
    assert result.ok, result
    assert client.hedges_sent == 1
    assert result.attempts == 1  # the winner answered; the other was cancelled, not recorded
    assert _deposits(shard.dsn, op.idempotency_key) == 1
