"""Faults between a shard daemon (a real process) and its PostgreSQL, under steady keyed load with
duplicates: the connection cut and restored, PostgreSQL restarted (crash-like), and the daemon
killed -9 in the middle of a call, at a named failpoint (`core/failpoints.py`): it is stopped
gracefully, started again with `shardd.claimed_before_commit` (a claimed key's writes sent, nothing
committed) or `shardd.committed_before_answer` (committed, not answered) armed, SIGKILLed on the first
call that reaches the point, and started again unarmed.

Afterwards every operation either completed exactly once or was reported failed to its caller, and
nothing is left half-done. Figures are printed. The long soak (`--run-slow`) kills the daemon at a
moment of the clock instead, wherever its calls are.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.idempotency.steps import CLAIMED_BEFORE_COMMIT, COMMITTED_BEFORE_ANSWER
from shardrouter.v1 import transfer_pb2_grpc
from tests.faults.load import TRANSIENT, DepositLoad, Ledger
from tests.faults.tcp_proxy import TcpProxy
from tests.helpers import pg_data_dir
from tests.processes import shardd_process

#: A shard daemon whose database connection broke mid-call may answer INTERNAL; its caller retries.
SHARD_TRANSIENT = TRANSIENT | {grpc.StatusCode.INTERNAL}


def _run(tmp_path: Path, seconds: float, seed: int, kill_at: str | None) -> None:
    """The load for `seconds`, with the three faults spread over it; the daemon's kill lands at the
    failpoint `kill_at` (None: at whatever its calls are doing)."""
    pg = LocalPostgres(pg_data_dir())
    pg.start()
    proxy = TcpProxy("127.0.0.1", pg.port)
    dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?connect_timeout=3"
    shard = shardd_process(
        tmp_path,
        shard_id="shard-0",
        dsn=dsn,
        extra_env={"SHARDD_POOL_TIMEOUT_S": "1", "SHARDD_LOG_LEVEL": "WARNING"},
    )
    shard.start()
    channel = grpc.insecure_channel(shard.address)
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    faults: Counter[str] = Counter()
    try:
        with DepositLoad(stub, seed=seed, accounts=10, transient=SHARD_TRANSIENT) as load:
            plan = [
                "cut shard<->database",
                "restart PostgreSQL",
                f"kill -9 shardd at {kill_at or 'a moment'}",
            ]
            start = time.monotonic()
            step = seconds / (len(plan) + 1)
            for i, fault in enumerate(plan):
                time.sleep(max(0.0, start + step * (i + 1) - time.monotonic()))
                faults[fault] += 1
                if fault.startswith("cut"):
                    proxy.cut()
                    time.sleep(1.0)
                    proxy.restore()
                elif fault.startswith("restart"):
                    pg.stop("immediate")
                    time.sleep(0.5)
                    pg.start()
                elif kill_at is None:
                    shard.kill()
                    shard.start()
                else:
                    shard.terminate()  # a graceful stop: its calls in flight finish
                    shard.arm(kill_at)
                    shard.start(wait=False)  # the load's calls may take every thread to the point
                    killed = shard.kill_at_failpoint(kill_at)  # the first call that reaches it
                    assert killed.point == kill_at
                    shard.arm()
                    shard.start()
            time.sleep(1.0)
        result = load.stop()

        ledger = Ledger.read([pg.dsn])
        print(result.summary(faults, ledger))
        assert ledger.duplicates_applied == 0
        lost = result.lost(ledger)
        assert not lost, f"{len(lost)} acknowledged operations have no single ledger entry"
        assert not result.applied_unreported(ledger)
        assert ledger.unfinished == 0 and ledger.orphans == 0 and ledger.empty == 0
        assert ledger.balance == result.expected_balance(ledger)
        assert sum(faults.values()) == 3
        assert len(result.completed) > 50
    finally:
        channel.close()
        shard.kill()
        proxy.close()
        pg.destroy()
        shutil.rmtree(pg.data_dir.parent, ignore_errors=True)


@pytest.mark.parametrize("point", [CLAIMED_BEFORE_COMMIT, COMMITTED_BEFORE_ANSWER])
def test_faults_between_shard_and_database_and_a_kill_at_a_failpoint(tmp_path: Path, point: str) -> None:
    _run(tmp_path, seconds=6.0, seed=3, kill_at=point)


@pytest.mark.slow
def test_faults_between_shard_and_database_long(tmp_path: Path) -> None:
    _run(tmp_path, seconds=60.0, seed=5, kill_at=None)
