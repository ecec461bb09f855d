"""The kill run: a server SIGKILLed and restarted under duplicate-laden Deposit load, then the database
says which deposits were applied twice and which acknowledged ones were lost.

Callers (threads of this process, one call in flight each) send Deposits; a share of the operations
resend an earlier operation's key with the same request (a duplicate, possibly while the first is still
in flight). Every operation is retried with its key until it is answered OK, as a real client would
(UNAVAILABLE while the server is down, ABORTED while the key is in flight, a deadline passed). A killer
thread SIGKILLs the server `kills` times, evenly over the run, and restarts it on the same port.

Afterwards, from the database alone: each key's number of ledger rows (`ledger_entries.idempotency_key`:
the shard's Deposit writes it, and the peer runs the same Deposit), and the accounts' balances against
the sum of the acknowledged operations' amounts.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import psycopg

from shardrouter.core.callers import CALLER_METADATA
from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.localcluster.cluster import Daemon
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

#: Answers after which resending the key cannot change anything: the operation is settled (not OK).
_FINAL = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
#: A restarted server must be found again quickly (grpc's default reconnect backoff starts at 1 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 300),
]


@dataclass(frozen=True)
class KillPlan:
    """How hard the run is: kills spread over `seconds`, at most `max_ops` operations."""

    kills: int = 5
    duplicates: float = 0.25
    seconds: float = 20.0
    #: A bound, not the usual end: the run is timed, and a kill must land under load.
    max_ops: int = 50_000
    callers: int = 8
    deadline_s: float = 1.0
    #: How long one operation may keep being resent before it counts as unresolved.
    give_up_s: float = 30.0
    seed: int = 1


@dataclass
class KillRunResult:
    """What the run sent and what the database holds afterwards."""

    side: str
    kills: int = 0
    operations: int = 0
    duplicates_sent: int = 0
    calls: int = 0
    acknowledged: int = 0
    unresolved: int = 0
    applied_twice: int = 0
    extra_rows: int = 0
    lost: int = 0
    balance_off: int = 0
    seconds: float = 0.0
    #: Operations in flight when each SIGKILL landed (a kill of an idle server proves nothing).
    in_flight_at_kills: list[int] = field(default_factory=list)
    answers: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return dict(self.__dict__)


class _Load:
    """The operations sent so far (key -> account, amount), which were answered OK, and counters."""

    def __init__(self, accounts: list[str], plan: KillPlan) -> None:
        self.accounts, self.plan = accounts, plan
        self.lock = threading.Lock()
        self.ops: dict[str, tuple[str, int]] = {}
        self.keys: list[str] = []
        self.acked: set[str] = set()
        self.answers: dict[str, int] = {}
        self.duplicates = 0
        self.calls = 0
        self.in_flight = 0
        self.stop = threading.Event()

    def next_op(self, rng: random.Random) -> tuple[str, str, int] | None:
        """A new operation, or a duplicate of an earlier one; None once the run is over."""
        with self.lock:
            if self.stop.is_set() or len(self.keys) >= self.plan.max_ops:
                return None
            self.in_flight += 1
            if self.keys and rng.random() < self.plan.duplicates:
                self.duplicates += 1
                key = rng.choice(self.keys)
                return key, *self.ops[key]
            key = str(new_key())
            self.ops[key] = (rng.choice(self.accounts), rng.randint(1, 1000))
            self.keys.append(key)
            return key, *self.ops[key]

    def answered(self, key: str, code: grpc.StatusCode) -> None:
        with self.lock:
            self.calls += 1
            self.answers[code.name] = self.answers.get(code.name, 0) + 1
            if code is grpc.StatusCode.OK:
                self.acked.add(key)


def _send_until_settled(
    stub: transfer_pb2_grpc.TransferServiceStub, load: _Load, key: str, account: str, amount: int
) -> None:
    """Resend one operation with its key until it is answered OK or finally refused (or give_up_s)."""
    request = transfer_pb2.DepositRequest(
        account_id=account,
        amount=transfer_pb2.Money(amount_minor=amount, currency="EUR"),
        reference="bench-kill",
    )
    metadata = ((KEY_METADATA, key), (CALLER_METADATA, "bench"))
    give_up = time.monotonic() + load.plan.give_up_s
    while time.monotonic() < give_up:
        try:
            stub.Deposit(request, metadata=metadata, timeout=load.plan.deadline_s)
            load.answered(key, grpc.StatusCode.OK)
            return
        except grpc.RpcError as error:
            code = error.code()
            load.answered(key, code)
            if code in _FINAL:
                return
        time.sleep(0.02)


def _caller(address: str, load: _Load, seed: int) -> None:
    rng = random.Random(seed)
    with grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
        stub = transfer_pb2_grpc.TransferServiceStub(channel)
        while (op := load.next_op(rng)) is not None:
            try:
                _send_until_settled(stub, load, *op)
            finally:
                with load.lock:
                    load.in_flight -= 1


def _killer(daemon: Daemon, load: _Load, kills: list[int]) -> None:
    """SIGKILL the server `plan.kills` times, evenly over the run, restarting it each time; then end the
    run one interval after the last kill (at once if a restart fails: the callers stop too)."""
    plan = load.plan
    interval = plan.seconds / (plan.kills + 1)
    try:
        for _ in range(plan.kills):
            if load.stop.wait(interval):
                return
            assert daemon.proc is not None
            os.kill(daemon.proc.pid, signal.SIGKILL)
            kills.append(load.in_flight)
            daemon.proc.wait(10)
            daemon.start(timeout_s=60)
        load.stop.wait(interval)
    finally:
        load.stop.set()


def balance_sum(dsn: str, accounts: list[str]) -> int:
    """The sum of the accounts' balances, now."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(balance), 0) FROM accounts WHERE id = ANY(%s)", (accounts,)
        ).fetchone()
    return int(row[0]) if row else 0


def count_from_database(
    dsn: str,
    ops: dict[str, tuple[str, int]],
    acked: set[str],
    balances: tuple[list[str], int],
    result: KillRunResult,
) -> None:
    """Into `result`: ledger rows per key of `ops` (key -> account, amount), and the change of the
    accounts' balances (`balances`: the accounts and their sum before the run) against the amounts
    of the operations the callers were told were done (`acked`)."""
    keys = list(ops)
    with psycopg.connect(dsn) as conn:
        rows: dict[str, int] = dict(
            conn.execute(
                "SELECT idempotency_key, count(*) FROM ledger_entries WHERE idempotency_key = ANY(%s)"
                " GROUP BY 1",
                (keys,),
            ).fetchall()
        )
    counts = {key: int(rows.get(key, 0)) for key in keys}
    result.applied_twice = sum(1 for n in counts.values() if n > 1)
    result.extra_rows = sum(n - 1 for n in counts.values() if n > 1)
    result.lost = sum(1 for key in acked if counts[key] == 0)
    accounts, balance_before = balances
    acked_amount = sum(ops[key][1] for key in acked)
    result.balance_off = balance_sum(dsn, accounts) - balance_before - acked_amount


def kill_run(side: str, daemon: Daemon, dsn: str, accounts: list[str], plan: KillPlan) -> KillRunResult:
    """Load `daemon` (which serves database `dsn`), kill and restart it, count from the database."""
    load = _Load(accounts, plan)
    balance_before = balance_sum(dsn, accounts)
    started = time.monotonic()
    kills: list[int] = []
    killer = threading.Thread(target=_killer, args=(daemon, load, kills), name="bench-killer", daemon=True)
    callers = [
        threading.Thread(target=_caller, args=(daemon.address, load, plan.seed * 1000 + i), daemon=True)
        for i in range(plan.callers)
    ]
    killer.start()
    for thread in callers:
        thread.start()
    killer.join(plan.seconds + 120 * (plan.kills + 1))
    load.stop.set()  # also when the killer failed: the callers finish what they hold and stop
    for thread in callers:
        thread.join(plan.give_up_s + 10)
    result = KillRunResult(
        side=side,
        kills=len(kills),
        in_flight_at_kills=kills,
        operations=len(load.keys),
        duplicates_sent=load.duplicates,
        calls=load.calls,
        acknowledged=len(load.acked),
        unresolved=len(load.keys) - len(load.acked),
        seconds=round(time.monotonic() - started, 1),
        answers=dict(load.answers),
    )
    count_from_database(dsn, load.ops, load.acked, (accounts, balance_before), result)
    if daemon.proc is None or daemon.proc.poll() is not None:  # the killer died between kill and start
        daemon.start(timeout_s=60)
    return result
