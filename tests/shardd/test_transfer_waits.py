"""`GetTransfer` waiting for a cross-shard transfer is woken by the state change, not by its poll.

Unit tests of `TransferWaits`, then real daemons and PostgreSQL (the fixtures of
`test_cross_shard.py`). The evidence that a wake-up answered is the waiters' counters, not timing:
the poll steps are set far beyond the call's wait, so a wait that ended early and was counted as
woken was ended by a signal, and `timed_out == 0` says no wait ran out (one read, one wake-up, one
re-read that found COMPLETED).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import psycopg
import pytest

from shardrouter.shardd.ledger import service
from shardrouter.shardd.relay import OutboxRelay
from shardrouter.shardd.server import start_shard
from shardrouter.shardd.transfer_waits import TRANSFER_CHANNEL, TransferWaits
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import make_settings
from tests.shardd.test_cross_shard import (  # noqa: F401  (two_shards is a fixture)
    TwoShards,
    _open,
    _transfer,
    accounts_on,
    two_shards,
)

# --- the notifier alone ---------------------------------------------------------------------------


def test_a_wake_up_between_the_read_and_the_wait_is_not_lost():
    waits = TransferWaits()
    transfer_id = uuid.uuid4()
    with waits.watch(transfer_id) as watch:
        watch.before_read()
        # ... the read finds PENDING; the state changes and is signalled before the waiter waits:
        waits.notify([transfer_id])
        assert watch.wait(30.0) is True  # returns at once: lost, it would run 30 s and say False
    assert (waits.woken, waits.timed_out, waits.notified) == (1, 0, 1)


def test_a_signal_before_the_read_is_forgotten_by_it():
    waits = TransferWaits()
    transfer_id = uuid.uuid4()
    with waits.watch(transfer_id) as watch:
        waits.notify([transfer_id])
        watch.before_read()  # the read that follows sees the change itself
        assert watch.wait(0.0) is False
    assert (waits.woken, waits.timed_out) == (0, 1)


def test_only_the_watchers_of_that_transfer_wake_and_ended_watches_are_forgotten():
    waits = TransferWaits()
    mine, other = uuid.uuid4(), uuid.uuid4()
    with waits.watch(mine) as a, waits.watch(mine) as b, waits.watch(other) as c:
        for watch in (a, b, c):
            watch.before_read()
        waits.notify([mine])
        waits.notify_payload("not a transfer id")  # ignored
        assert (a.wait(0.0), b.wait(0.0), c.wait(0.0)) == (True, True, False)
    waits.notify([mine, other])  # nobody watches any more
    assert waits.notified == 1


def test_a_blocked_waiter_is_woken_by_another_thread():
    waits = TransferWaits()
    transfer_id = uuid.uuid4()
    answers: list[bool] = []

    def wait() -> None:
        with waits.watch(transfer_id) as watch:
            watch.before_read()
            answers.append(watch.wait(30.0))

    thread = threading.Thread(target=wait)
    thread.start()
    _until(lambda: waits.asleep == 1)
    waits.notify_payload(str(transfer_id))
    thread.join(30)
    assert answers == [True] and waits.woken == 1


# --- real daemons -------------------------------------------------------------------------------


def _until(condition: Callable[[], bool], what: str = "condition") -> None:
    """Wait for a state of the test's own making (not for the behaviour under test)."""
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextmanager
def _credit_held(cluster: TwoShards, account: str) -> Iterator[None]:
    """Hold the destination account's row lock: a credit to it waits until the block ends."""
    with cluster.db(account) as conn, conn.transaction():
        conn.execute("SELECT 1 FROM accounts WHERE id = %s FOR UPDATE", (account,))
        yield


def _get_transfer_in_background(
    port: int, src: str, transfer_id: str
) -> tuple[threading.Thread, list[transfer_pb2.Transfer]]:
    answers: list[transfer_pb2.Transfer] = []

    def call() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            request = transfer_pb2.GetTransferRequest(
                source_account_id=src, transfer_id=transfer_id, wait_for_completion_ms=5000
            )
            answers.append(stub.GetTransfer(request, timeout=15).transfer)

    thread = threading.Thread(target=call)
    thread.start()
    return thread, answers


@pytest.fixture
def no_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Poll steps far beyond the calls' 5 s wait: only a wake-up can end a wait early."""
    monkeypatch.setattr(service, "_POLL_INTERVAL_S", 600.0)
    monkeypatch.setattr(service, "_UNHEARD_POLL_INTERVAL_S", 600.0)


def _patient_destination(cluster: TwoShards) -> None:
    """The destination waits for its held account row instead of refusing the credit after 2 s."""
    cluster.daemons["shard-1"].stop(0.2)
    cluster.start("shard-1", handler_lock_timeout_ms=60_000)


def test_the_relay_in_the_same_daemon_wakes_get_transfer(two_shards, no_polling):  # noqa: F811  (the imported fixture)
    _patient_destination(two_shards)
    two_shards.daemons["shard-0"].stop(0.2)
    two_shards.start("shard-0", relay_workers=1, relay_call_timeout_s=60.0)
    daemon = two_shards.daemons["shard-0"]
    waits = daemon.transfer_waits
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    dst = accounts_on(two_shards.shard_map, "shard-1", 1)[0]
    _open(two_shards, src, 1000)
    _open(two_shards, dst, 1)
    _until(lambda: waits.listening, "the relay's listener")
    with _credit_held(two_shards, dst):
        transfer = _transfer(two_shards, src, dst, 10)
        thread, answers = _get_transfer_in_background(daemon.port, src, transfer.transfer_id)
        _until(lambda: waits.asleep == 1, "GetTransfer to wait")  # it has read PENDING
    thread.join(30)
    assert [t.state for t in answers] == [transfer_pb2.TRANSFER_STATE_COMPLETED]
    assert (waits.woken, waits.timed_out) == (1, 0)


def test_the_relay_of_another_daemon_of_the_shard_wakes_get_transfer(two_shards, no_polling):  # noqa: F811  (the imported fixture)
    """Daemon B (listening, its relay idle) answers GetTransfer; another relay on the same database
    delivers the credit, and B hears its commit through `pg_notify`."""
    _patient_destination(two_shards)
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    dst = accounts_on(two_shards.shard_map, "shard-1", 1)[0]
    _open(two_shards, src, 1000)
    _open(two_shards, dst, 1)
    settings_a = two_shards.daemons["shard-0"].settings
    relay_a = OutboxRelay(
        dataclasses.replace(settings_a, relay_call_timeout_s=60.0),
        two_shards.daemons["shard-0"].database,
        lambda: two_shards.shard_map,
    )
    daemon_b = None
    try:
        with _credit_held(two_shards, dst):
            transfer = _transfer(two_shards, src, dst, 10)
            stats = []
            delivering = threading.Thread(target=lambda: stats.append(relay_a.run_once()))
            delivering.start()
            with psycopg.connect(two_shards.dsns["shard-1"], autocommit=True) as dst_db:
                _until(
                    lambda: (
                        dst_db.execute(
                            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        ).fetchone()
                        is not None
                    ),
                    "relay A's credit to wait for the held row",
                )  # so relay A holds the outbox row: B's relay skips it
            daemon_b = start_shard(
                make_settings(
                    two_shards.dsns["shard-0"],
                    shard_id="shard-0",
                    shard_map=str(two_shards.map_path),
                    relay_workers=1,
                )
            )
            waits_b = daemon_b.transfer_waits
            _until(lambda: waits_b.listening, "daemon B's listener")
            thread, answers = _get_transfer_in_background(daemon_b.port, src, transfer.transfer_id)
            _until(lambda: waits_b.asleep == 1, "GetTransfer to wait")
        delivering.join(60)
        thread.join(30)
        assert stats and stats[0].delivered == 1  # relay A, not B's own, delivered it
        assert [t.state for t in answers] == [transfer_pb2.TRANSFER_STATE_COMPLETED]
        assert (waits_b.woken, waits_b.timed_out) == (1, 0)
    finally:
        if daemon_b is not None:
            daemon_b.stop(0.2)


def test_a_refund_wakes_get_transfer_here_and_is_announced_to_the_other_daemons(two_shards, no_polling):  # noqa: F811  (the imported fixture)
    """A credit that cannot land is refunded; the relay that saw the refund confirmed wakes this
    process's waiters and notifies the shard's other daemons."""
    daemon = two_shards.daemons["shard-0"]  # relay_workers=0: the test runs the relay's pass
    waits = daemon.transfer_waits
    src = accounts_on(two_shards.shard_map, "shard-0", 1)[0]
    ghost = accounts_on(two_shards.shard_map, "shard-1", 3)[2]  # never opened: dead-lettered
    _open(two_shards, src, 1000)
    transfer = _transfer(two_shards, src, ghost, 10)
    relay = OutboxRelay(daemon.settings, daemon.database, lambda: two_shards.shard_map, waits)
    with psycopg.connect(two_shards.dsns["shard-0"], autocommit=True) as other_daemon:
        other_daemon.execute(f"LISTEN {TRANSFER_CHANNEL}")
        thread, answers = _get_transfer_in_background(daemon.port, src, transfer.transfer_id)
        _until(lambda: waits.asleep == 1, "GetTransfer to wait")
        stats = relay.run_once()
        heard = [n.payload for n in other_daemon.notifies(timeout=20, stop_after=1)]
    thread.join(30)
    assert (stats.dead_lettered, stats.refunded) == (1, 1)
    assert [t.state for t in answers] == [transfer_pb2.TRANSFER_STATE_REFUNDED]
    assert (waits.woken, waits.timed_out) == (1, 0)
    assert heard == [transfer.transfer_id]
