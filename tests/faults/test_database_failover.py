"""A shard's database fails over under load: the primary is killed -9 and its synchronous standby is
promoted, while a real `shardd` process serves keyed Deposits with duplicates and retries.

The shard's DSN names both servers with `target_session_attrs=read-write`, so the daemon's pool
reconnects to whichever accepts writes. Afterwards, on the new primary: every operation a caller saw
acknowledged is there exactly once, nothing was applied twice, the balances add up to the amounts
applied, and acknowledged keys sent again are replayed with the answer their callers first got.
Figures are printed: operations, acknowledged, lost, applied twice, seconds of unavailability.

A shard daemon killed mid-call across a failover is shown deterministically, at a named failpoint
(`core/failpoints.py`): one of the shard's two daemons is paused at `shardd.claimed_before_commit`
(a keyed Deposit's claim and writes in an open transaction) or `shardd.committed_before_answer`
(committed, not answered) when the primary is killed and the standby promoted, then SIGKILLed there.
The caller's retry at the other daemon, whose pool must find the new primary, applies the deposit
once (nothing had committed) or replays the stored outcome byte for byte (the synchronous standby
has it).

That the drill would catch asynchronous replication is shown separately and deterministically:
with the standby down, an asynchronous primary acknowledges a commit the promoted standby never had,
while a synchronous one never acknowledges it. The drill also checks that the standby was the
synchronous one (`pg_stat_replication.sync_state = 'sync'`) just before the kill.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
import psycopg
import pytest

from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.localcluster.postgres import ReplicatedPostgres
from shardrouter.shardd.idempotency.steps import CLAIMED_BEFORE_COMMIT, COMMITTED_BEFORE_ANSWER
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.faults.daemons import (
    DEPOSIT,
    balances,
    call,
    call_in_background,
    deposit_request,
    entries,
    stored_response,
)
from tests.faults.load import TRANSIENT, DepositLoad, Ledger
from tests.helpers import pg_data_dir
from tests.processes import shardd_process

#: A shard daemon whose database connection broke mid-call may answer INTERNAL; its caller retries.
SHARD_TRANSIENT = TRANSIENT | {grpc.StatusCode.INTERNAL}
REPLAYED = ("idempotency-replayed", "true")


@dataclass(frozen=True)
class Attempt:
    """One call the load made: its key, when it started and ended, and whether it was answered OK."""

    key: str
    started: float
    ended: float
    ok: bool


class RecordingStub:
    """Stands in for the stub `DepositLoad` calls: records every attempt and every answer OK."""

    def __init__(self, stub: transfer_pb2_grpc.TransferServiceStub) -> None:
        self._stub = stub
        self._lock = threading.Lock()
        self.attempts: list[Attempt] = []
        self.answers: defaultdict[str, list[transfer_pb2.DepositResponse]] = defaultdict(list)
        self.requests: dict[str, transfer_pb2.DepositRequest] = {}

    def Deposit(
        self,
        request: transfer_pb2.DepositRequest,
        metadata: Sequence[tuple[str, str]],
        timeout: float,
    ) -> transfer_pb2.DepositResponse:
        key = dict(metadata)[KEY_METADATA]
        started = time.monotonic()
        try:
            response, _call = self._stub.Deposit.with_call(request, metadata=tuple(metadata), timeout=timeout)
        except grpc.RpcError:
            with self._lock:
                self.attempts.append(Attempt(key, started, time.monotonic(), ok=False))
            raise
        with self._lock:
            self.attempts.append(Attempt(key, started, time.monotonic(), ok=True))
            self.answers[key].append(response)
            self.requests[key] = request
        return response


def _drill(tmp_path: Path, before_s: float, after_s: float, seed: int) -> None:
    rep = ReplicatedPostgres(pg_data_dir())
    rep.start()
    shard = shardd_process(
        tmp_path,
        shard_id="shard-0",
        dsn=rep.dsn,
        extra_env={"SHARDD_POOL_TIMEOUT_S": "1", "SHARDD_LOG_LEVEL": "WARNING"},
    )
    shard.start()
    channel = grpc.insecure_channel(shard.address)
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    recorder = RecordingStub(stub)
    faults: Counter[str] = Counter()
    try:
        load_stub = cast(transfer_pb2_grpc.TransferServiceStub, recorder)
        with DepositLoad(load_stub, seed=seed, accounts=10, transient=SHARD_TRANSIENT) as load:
            time.sleep(before_s)
            # The standby is the synchronous one right up to the kill: no acknowledged commit is only
            # on the primary.
            standby = [r for r in rep.replication() if r["application_name"] == rep.STANDBY_NAME]
            assert [(r["state"], r["sync_state"]) for r in standby] == [("streaming", "sync")]
            killed_at = time.monotonic()
            rep.kill_primary()
            faults["kill -9 primary"] += 1
            rep.promote()
            promoted_at = time.monotonic()
            faults["promote standby"] += 1
            time.sleep(after_s)
        result = load.stop()

        with psycopg.connect(rep.dsn, autocommit=True) as conn:  # the DSN now reaches the standby
            assert conn.info.port == rep.standby.port
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
        ledger = Ledger.read([rep.dsn])
        lost = result.lost(ledger)
        # Unavailability: from the kill until a call sent after it is the first to acknowledge its
        # key. A duplicate of a key already acknowledged may be answered from the daemon's memory
        # without the database, so such replays do not count as the database being back.
        first_oks: dict[str, Attempt] = {}
        for a in sorted(recorder.attempts, key=lambda a: a.ended):
            if a.ok:
                first_oks.setdefault(a.key, a)
        oks_after = [a for a in first_oks.values() if a.started >= killed_at]
        assert oks_after, "no operation was acknowledged after the failover"
        unavailable_s = min(a.ended for a in oks_after) - killed_at
        print(result.summary(faults, ledger))
        print(
            f"failover: operations {len(result.outcomes)}, acknowledged {len(result.completed)}, "
            f"lost {len(lost)}, applied twice {ledger.duplicates_applied}, "
            f"unavailable {unavailable_s:.2f} s (kill to the first new acknowledgement; "
            f"kill to promoted {promoted_at - killed_at:.2f} s), "
            f"attempts {len(recorder.attempts)} of which failed "
            f"{sum(not a.ok for a in recorder.attempts)}"
        )

        assert not lost, f"{len(lost)} acknowledged operations have no single ledger entry"
        assert ledger.duplicates_applied == 0
        assert not result.applied_unreported(ledger)
        assert set(ledger.entries) <= set(result.outcomes), "ledger entries no caller sent"
        assert ledger.unfinished == 0 and ledger.orphans == 0 and ledger.empty == 0
        assert ledger.balance == result.expected_balance(ledger)  # no money created or lost
        assert not result.failed, f"callers saw failures: {sorted(result.failed)[:5]}"
        assert len(result.completed) > 50
        assert len(oks_after) > 20
        # Every copy of one key, before and after the failover, got the same answer.
        differing = [k for k, answers in recorder.answers.items() if any(a != answers[0] for a in answers)]
        assert not differing, f"{len(differing)} keys answered differently"

        # Acknowledged keys sent again are replayed from the new primary with their first answer:
        # the keys retried the most (across the failover), and some from before and after the kill.
        tries = Counter(a.key for a in recorder.attempts)
        first_ok = {k: a.ended for k, a in first_oks.items()}
        acked = sorted(result.completed, key=lambda k: first_ok[k])
        retried = sorted(result.completed, key=lambda k: -tries[k])[:15]
        before = [k for k in acked if first_ok[k] < killed_at][-10:]
        after = [k for k in acked if first_ok[k] >= killed_at][:10]
        sample = list(dict.fromkeys([*retried, *before, *after]))
        assert before and after and any(tries[k] > 1 for k in retried)
        for key in sample:
            response, call = stub.Deposit.with_call(
                recorder.requests[key], metadata=((KEY_METADATA, key),), timeout=5
            )
            assert REPLAYED in tuple(call.trailing_metadata() or ()), key
            assert response == recorder.answers[key][0], key
        assert Ledger.read([rep.dsn]).entries == ledger.entries  # the replays applied nothing
    finally:
        channel.close()
        shard.kill()
        rep.destroy()
        shutil.rmtree(rep.base_dir.parent, ignore_errors=True)


def test_database_failover_loses_no_acknowledged_deposit(tmp_path: Path) -> None:
    _drill(tmp_path, before_s=3.0, after_s=4.0, seed=11)


@pytest.mark.slow
def test_database_failover_loses_no_acknowledged_deposit_long(tmp_path: Path) -> None:
    _drill(tmp_path, before_s=20.0, after_s=20.0, seed=13)


@pytest.mark.parametrize("point", [CLAIMED_BEFORE_COMMIT, COMMITTED_BEFORE_ANSWER])
def test_a_daemon_killed_at_a_failpoint_across_a_failover_applies_the_retry_once(
    tmp_path: Path, point: str
) -> None:
    """Failpoints `shardd.claimed_before_commit` and `shardd.committed_before_answer`, the primary
    killed and the standby promoted while the daemon is paused there."""
    rep = ReplicatedPostgres(pg_data_dir())
    rep.start()
    env = {"SHARDD_POOL_TIMEOUT_S": "1", "SHARDD_LOG_LEVEL": "WARNING", "SHARDD_RELAY_WORKERS": "0"}
    armed, other = (
        shardd_process(tmp_path, shard_id="shard-0", dsn=rep.dsn, extra_env=env) for _ in range(2)
    )
    armed.name, armed.log_path = "shard-0-armed", tmp_path / "shard-0-armed.log"
    armed.arm(point)
    try:
        armed.start()
        other.start()
        key, request = str(new_key()), deposit_request("acct-f", 250)
        first = call_in_background(armed.address, DEPOSIT, request, key)
        paused = armed.wait_paused(point)
        committed = point == COMMITTED_BEFORE_ANSWER
        stored = stored_response(rep.dsn, key)
        assert (stored is not None) is committed
        standby = [r for r in rep.replication() if r["application_name"] == rep.STANDBY_NAME]
        assert [(r["state"], r["sync_state"]) for r in standby] == [("streaming", "sync")]

        rep.kill_primary()
        rep.promote()
        armed.kill_paused(paused)
        assert first.result(10).code is grpc.StatusCode.UNAVAILABLE  # the caller never got an answer

        retry = call(other.address, DEPOSIT, request, key)  # its pool finds the new primary
        for _ in range(50):  # until it has: a call on a connection to the dead primary fails first
            if retry.code is grpc.StatusCode.OK:
                break
            assert retry.code in SHARD_TRANSIENT, retry
            time.sleep(0.2)
            retry = call(other.address, DEPOSIT, request, key)
        assert retry.code is grpc.StatusCode.OK, (retry, other.log_text()[-3000:])
        with psycopg.connect(rep.dsn, autocommit=True) as conn:  # the DSN now reaches the standby
            assert conn.info.port == rep.standby.port
        assert retry.replayed is committed
        if committed:
            assert retry.response == stored
        assert stored_response(rep.dsn, key) == retry.response
        assert entries(rep.dsn, key) == [("deposit", "acct-f", 250)]
        assert balances(rep.dsn, "acct-f") == [250]
    finally:
        armed.kill()
        other.kill()
        rep.destroy()
        shutil.rmtree(rep.base_dir.parent, ignore_errors=True)


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "synchronous"])
def test_only_synchronous_replication_keeps_acknowledged_commits(synchronous: bool) -> None:
    """With the standby unreachable, an asynchronous primary acknowledges a commit that a failover
    then loses; a synchronous one never acknowledges it (the caller sees the connection break)."""
    rep = ReplicatedPostgres(pg_data_dir(), synchronous=synchronous)
    try:
        rep.start()
        with psycopg.connect(rep.primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE entries (id int PRIMARY KEY)")
            conn.execute("INSERT INTO entries VALUES (1)")
        rep.wait_streaming()
        rep.wait_replayed()  # row 1 is on the standby before it is cut off (an asynchronous one may lag)
        rep.standby.stop()  # its machine is cut off: the primary cannot reach it

        acknowledged = threading.Event()
        outcome: list[BaseException] = []

        def commit() -> None:
            try:
                with psycopg.connect(rep.primary.dsn, autocommit=True) as conn:
                    conn.execute("INSERT INTO entries VALUES (2)")
                acknowledged.set()
            except psycopg.OperationalError as err:
                outcome.append(err)

        committer = threading.Thread(target=commit, daemon=True)
        committer.start()
        assert acknowledged.wait(1.5) is not synchronous

        rep.kill_primary()
        committer.join(10)
        assert not committer.is_alive()
        assert bool(outcome) is synchronous  # synchronous: the connection broke, never acknowledged
        rep.standby.start()
        rep.promote()
        with psycopg.connect(rep.dsn, autocommit=True) as conn:
            rows = [r[0] for r in conn.execute("SELECT id FROM entries ORDER BY id").fetchall()]
        # Row 2 is missing in both cases, but only the asynchronous primary had acknowledged it.
        assert rows == [1]
        assert acknowledged.is_set() is not synchronous
    finally:
        rep.destroy()
        shutil.rmtree(rep.base_dir.parent, ignore_errors=True)
