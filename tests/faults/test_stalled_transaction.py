"""A daemon that stalls inside a call's transaction (here paused at the failpoint
`shardd.claimed_before_commit`: the key claimed, the Deposit's row written and locked, nothing
committed) holds its row locks and the key only until the call's deadline: PostgreSQL then ends its
session (the transaction's `idle_in_transaction_session_timeout` is the deadline), which rolls it
back, so another call on the same account goes on, and the stalled call's retry runs once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from shardrouter.core.keys import new_key
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.idempotency.steps import CLAIMED_BEFORE_COMMIT
from tests.faults.daemons import DEPOSIT, OneShard, balances, call, deposit_request, entries

POINT = CLAIMED_BEFORE_COMMIT
DEADLINE_S = 1.5


def test_a_stalled_transaction_ends_at_its_calls_deadline(postgres: LocalPostgres, tmp_path: Path) -> None:
    # The other daemon waits long enough for a row lock that only the stalled session's end frees it.
    shard = OneShard.build(postgres, tmp_path, extra_env={"SHARDD_HANDLER_LOCK_TIMEOUT_MS": "8000"})
    stalled, other = shard.daemons
    stalled.arm(POINT)
    try:
        shard.start()
        key, request = str(new_key()), deposit_request("acct-s", 100)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(call, stalled.address, DEPOSIT, request, key, DEADLINE_S)
            paused = stalled.wait_paused(POINT)
            assert first.result(10).code is grpc.StatusCode.DEADLINE_EXCEEDED
        # Another key on the same account, at the other daemon: it waits for the row lock, which the
        # stalled session gives up at the call's deadline, not when (or if) its daemon goes on.
        started = time.monotonic()
        another = call(other.address, DEPOSIT, deposit_request("acct-s", 7), str(new_key()), timeout_s=20)
        waited = time.monotonic() - started
        assert another.code is grpc.StatusCode.OK, another
        assert waited < 6.0, f"the row lock was held {waited:.1f} s past the stalled call's deadline"
        # The stalled call's key is free again: its retry runs, once.
        retried = call(other.address, DEPOSIT, request, key, timeout_s=20)
        assert retried.code is grpc.StatusCode.OK and not retried.replayed, retried
        stalled.kill_paused(paused)
        assert entries(shard.dsn, key) == [("deposit", "acct-s", 100)]
        assert balances(shard.dsn, "acct-s") == [107]
    finally:
        shard.stop()
