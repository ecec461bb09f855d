"""Process loss: one of a shard's two daemons (real processes over its one database, behind the
router) SIGKILLed in the middle of a keyed call, at a named failpoint (`core/failpoints.py`):

- `shardd.claimed_before_commit`: the key claimed and the transfer's writes sent, nothing committed.
  While it is paused the other daemon finds the key in flight; after the kill nothing of it is left,
  and the caller's retry, through the router to the surviving daemon, applies it exactly once.
- `shardd.committed_before_answer`: committed, not answered. The caller's attempt fails, and its
  retry replays the stored outcome byte for byte; nothing is applied twice.
- the same kill under keyed load with duplicates through the router: the callers see nothing beyond
  retried attempts, nothing is lost or applied twice, and the latency after the kill is printed.
- a daemon of several serving processes: the one that paused is found by the pid it announced.

The caller's first attempt goes to the armed daemon directly, so the kill lands on that call; the
retries go through the router, which finds the daemon gone and sends them to the other one. The
older drill, a daemon killed at a moment of the clock under load wherever its calls were, is kept
as a soak behind `--run-slow`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardrouter.core.keys import new_key
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.idempotency.steps import CLAIMED_BEFORE_COMMIT, COMMITTED_BEFORE_ANSWER
from shardrouter.v1 import transfer_pb2_grpc
from tests.faults.daemons import (
    DEPOSIT,
    TRANSFER,
    OneShard,
    balances,
    call,
    call_in_background,
    claim_holders,
    deposit_request,
    entries,
    query,
    stored_response,
    transfer_request,
    wait_for,
)
from tests.faults.load import DepositLoad, Ledger, LoadResult
from tests.processes import ServiceProcess, router_process, shardd_process

CLAIMED = CLAIMED_BEFORE_COMMIT
ANSWERED = COMMITTED_BEFORE_ANSWER
SRC, DST = "acct-src", "acct-dst"


@pytest.fixture
def shard(postgres: LocalPostgres, tmp_path: Path) -> Iterator[OneShard]:
    """Two daemons of one shard and a router, not started."""
    one = OneShard.build(postgres, tmp_path)
    yield one
    one.stop()


def _seed(shard: OneShard) -> None:
    """SRC holds 1000 and DST 1, opened through the daemon that is not armed."""
    for account, amount in ((SRC, 1000), (DST, 1)):
        opened = call(shard.daemons[1].address, DEPOSIT, deposit_request(account, amount), str(new_key()))
        assert opened.code is grpc.StatusCode.OK, opened


def _applied_once(shard: OneShard, key: str) -> None:
    assert entries(shard.dsn, key) == [("transfer_in", DST, 300), ("transfer_out", SRC, -300)]
    assert balances(shard.dsn, SRC, DST) == [700, 301]
    assert len(_transfers(shard)) == 1


def _transfers(shard: OneShard) -> list[tuple[object, ...]]:
    return query(shard.dsn, "SELECT id, state FROM transfers")


def test_a_daemon_killed_at_claimed_before_commit_leaves_nothing_and_the_retry_applies_once(
    shard: OneShard,
) -> None:
    """Failpoint `shardd.claimed_before_commit`, a keyed Transfer in flight."""
    armed, other = shard.daemons
    armed.arm(CLAIMED)
    shard.start()
    _seed(shard)
    key, request = str(new_key()), transfer_request(SRC, DST, 300)
    first = call_in_background(armed.address, TRANSFER, request, key)
    paused = armed.wait_paused(CLAIMED)

    # Paused holding the claim, its writes in an open transaction: the key is in flight for the other
    # daemon, and nothing of the transfer is visible.
    duplicate = call(other.address, TRANSFER, request, key)
    assert (duplicate.code, duplicate.reason) == (grpc.StatusCode.ABORTED, "IDEMPOTENCY_KEY_IN_FLIGHT")
    (holder,) = claim_holders(shard.dsn)
    written = query(
        shard.dsn,
        "SELECT relation::regclass::text FROM pg_locks WHERE pid = %s AND mode = 'RowExclusiveLock'",
        holder,
    )
    assert {"transfers", "ledger_entries", "accounts"} <= {r[0] for r in written}  # its writes ran
    assert entries(shard.dsn, key) == [] and stored_response(shard.dsn, key) is None
    assert balances(shard.dsn, SRC, DST) == [1000, 1]

    assert armed.proc is not None and paused.pid == armed.proc.pid
    armed.kill_paused(paused)  # and checks that it died of the SIGKILL
    assert first.result(10).code is grpc.StatusCode.UNAVAILABLE  # the caller never got an answer
    # The claim and the writes went with the killed process's session.
    wait_for("the killed daemon's claim released", lambda: claim_holders(shard.dsn) == [], logs=shard.logs)
    assert entries(shard.dsn, key) == [] and balances(shard.dsn, SRC, DST) == [1000, 1]

    retry = call(shard.router.address, TRANSFER, request, key)  # the router finds only `other`
    assert retry.code is grpc.StatusCode.OK, (retry, shard.logs())
    assert not retry.replayed  # applied now, for the first time
    assert retry.response == stored_response(shard.dsn, key)
    _applied_once(shard, key)

    armed.arm()
    armed.start()  # back, unarmed: it replays the same bytes
    again = call(armed.address, TRANSFER, request, key)
    assert again.replayed and again.response == retry.response
    _applied_once(shard, key)


def test_a_daemon_killed_at_committed_before_answer_has_its_outcome_replayed_byte_for_byte(
    shard: OneShard,
) -> None:
    """Failpoint `shardd.committed_before_answer`, a keyed Transfer in flight."""
    armed, other = shard.daemons
    armed.arm(ANSWERED)
    shard.start()
    _seed(shard)
    key, request = str(new_key()), transfer_request(SRC, DST, 300)
    first = call_in_background(armed.address, TRANSFER, request, key)
    paused = armed.wait_paused(ANSWERED)

    # Committed before the pause: the record and the writes are there, and the other daemon replays.
    stored = stored_response(shard.dsn, key)
    assert stored is not None
    _applied_once(shard, key)
    duplicate = call(other.address, TRANSFER, request, key)
    assert duplicate.code is grpc.StatusCode.OK and duplicate.replayed and duplicate.response == stored

    armed.kill_paused(paused)
    assert first.result(10).code is grpc.StatusCode.UNAVAILABLE  # the caller never got its answer

    retry = call(shard.router.address, TRANSFER, request, key)
    assert retry.code is grpc.StatusCode.OK, (retry, shard.logs())
    assert retry.replayed and retry.response == stored
    assert stored_response(shard.dsn, key) == stored  # a completed record never changes
    _applied_once(shard, key)


def test_a_serving_process_paused_at_a_failpoint_is_found_by_the_pid_it_announced(shard: OneShard) -> None:
    """Failpoint `shardd.claimed_before_commit` in a daemon of two serving processes
    (`SHARDD_PROCESSES=2`): the pid announced is one of its serving processes; killed there, only
    it dies (its parent reports the SIGKILL and lives on), and the retry applies once."""
    armed, other = shard.daemons
    armed.env["SHARDD_PROCESSES"] = "2"
    armed.arm(CLAIMED)
    shard.start()
    _seed(shard)
    key, request = str(new_key()), transfer_request(SRC, DST, 300)
    first = call_in_background(armed.address, TRANSFER, request, key)
    paused = armed.wait_paused(CLAIMED)
    assert armed.proc is not None and paused.pid != armed.proc.pid

    killed = armed.kill_paused(paused)  # checks the pid is a child of the daemon, and its end
    assert f"(pid {killed.pid}) ended with -9" in killed.after
    assert armed.proc.poll() is None  # the parent lives on, and starts the process again
    assert first.result(10).code is grpc.StatusCode.UNAVAILABLE
    wait_for("the killed process's claim released", lambda: claim_holders(shard.dsn) == [], logs=shard.logs)

    retry = call(other.address, TRANSFER, request, key)
    assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry
    _applied_once(shard, key)

    # Stopped gracefully, the parent takes its serving processes with it (a SIGKILLed parent could
    # leave one it was just starting again).
    children = Path(f"/proc/{armed.proc.pid}/task/{armed.proc.pid}/children").read_text().split()
    assert armed.terminate() == 0
    wait_for("the serving processes gone", lambda: not any(Path(f"/proc/{c}").exists() for c in children))


def test_a_daemon_killed_at_claimed_before_commit_under_load_goes_unnoticed(shard: OneShard) -> None:
    """Failpoint `shardd.claimed_before_commit` under keyed Deposits with duplicates through the
    router: one daemon is restarted armed, killed at the point on the first call that reaches it,
    and the callers see nothing beyond retried attempts."""
    armed, _ = shard.daemons
    shard.start()
    channel = grpc.insecure_channel(shard.router.address)
    try:
        with DepositLoad(transfer_pb2_grpc.TransferServiceStub(channel), seed=17, accounts=10) as load:
            time.sleep(1.0)
            armed.terminate()  # a graceful stop: its calls in flight finish
            armed.arm(CLAIMED)
            armed.start(wait=False)  # the load's calls may take every thread to the point
            killed = armed.kill_at_failpoint(CLAIMED)  # the first call the router sends it
            killed_at = time.monotonic()
            time.sleep(2.0)
            result = load.stop()
        ledger = Ledger.read([shard.dsn])
    finally:
        channel.close()
    assert killed.point == CLAIMED
    _check_loss(result, ledger, killed_at, min_operations=50)


def _check_loss(result: LoadResult, ledger: Ledger, killed_at: float, min_operations: int) -> None:
    """Print the figures of a loss under load and check that the callers saw no more than retries."""
    before = [d for start, d in result.latencies if start < killed_at]
    during = [d for start, d in result.latencies if killed_at <= start < killed_at + 2.0]
    retried = {k: v for k, v in result.counts.items() if k.isupper()}
    print(
        f"\nprocess loss: operations {len(result.outcomes)}, duplicates sent {result.counts['duplicates sent']}, "
        f"attempts {result.counts['attempts']}, retried answers {retried}; completed {len(result.completed)}, "
        f"reported failed {len(result.failed)}, lost {len(result.lost(ledger))}, "
        f"applied twice {ledger.duplicates_applied}; latency before the kill p50 {_p(before, 0.5):.1f} ms "
        f"p99 {_p(before, 0.99):.1f} ms ({len(before)} calls), in the 2 s after it p50 {_p(during, 0.5):.1f} ms "
        f"p99 {_p(during, 0.99):.1f} ms max {max(during, default=0) * 1000:.1f} ms ({len(during)} calls)"
    )
    assert len(result.outcomes) > min_operations
    assert during, "no call was answered after the kill"
    failures = {key: result.outcomes[key] for key in sorted(result.failed)}
    assert result.failed == set(), f"a caller saw a failure beyond retried attempts: {failures}"
    assert result.completed == set(result.outcomes)
    assert result.lost(ledger) == []
    assert ledger.duplicates_applied == 0
    assert ledger.unfinished == 0 and ledger.orphans == 0 and ledger.empty == 0
    assert ledger.balance == result.expected_balance(ledger)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


# -- the soak: a daemon killed at a moment of the clock, wherever its calls are ---------------------


def _soak(postgres: LocalPostgres, tmp_path: Path, before_s: float, after_s: float, seed: int) -> None:
    name = f"loss_{uuid.uuid4().hex[:8]}"
    postgres.create_database(name)
    dsn = postgres.dsn_for(name)
    daemons = [
        shardd_process(
            tmp_path,
            shard_id="shard-0",
            dsn=dsn,
            extra_env={"SHARDD_LOG_LEVEL": "WARNING", "SHARDD_RELAY_WORKERS": "0"},
        )
        for _ in range(2)
    ]
    shard_map = tmp_path / "shard-map.json"
    shard_map.write_text(
        json.dumps(
            {
                "version": 1,
                "shards": [
                    {"id": "shard-0", "addresses": [d.address for d in daemons], "slot_ranges": [[0, 16383]]}
                ],
            }
        )
    )
    for daemon in daemons:
        daemon.env["SHARDD_SHARD_MAP"] = str(shard_map)
        daemon.start()
    router: ServiceProcess = router_process(tmp_path, shard_map=shard_map)
    router.start()
    channel = grpc.insecure_channel(router.address)
    try:
        with DepositLoad(transfer_pb2_grpc.TransferServiceStub(channel), seed=seed, accounts=10) as load:
            time.sleep(before_s)
            killed_at = time.monotonic()
            daemons[1].kill()
            time.sleep(after_s)
            result = load.stop()
        ledger = Ledger.read([dsn])
    finally:
        channel.close()
        router.kill()
        for daemon in daemons:
            daemon.kill()
    _check_loss(result, ledger, killed_at, min_operations=50)


@pytest.mark.slow
def test_losing_one_of_a_shards_two_daemons_at_a_moment_of_the_clock(
    postgres: LocalPostgres, tmp_path: Path
) -> None:
    _soak(postgres, tmp_path, before_s=2.0, after_s=3.0, seed=17)


@pytest.mark.slow
def test_losing_one_of_a_shards_two_daemons_long(postgres: LocalPostgres, tmp_path: Path) -> None:
    _soak(postgres, tmp_path, before_s=10.0, after_s=20.0, seed=18)
