"""The keyed load the fault tests run while they inject faults, and what it left in the databases.

`DepositLoad` sends Deposits from a pool of threads until stopped: each operation has its own
idempotency key and amount, is sent 1 to 3 times (the copies are duplicates), and each copy is retried
on a transient status code until it succeeds, fails for good, or 30 s have gone by. Every caller thread
keeps its own figures and adds them to the shared ones under one lock when its operation ends.

Bounded in time: the load runs until `stop()`, each call has a 3 s deadline and each copy gives up
after 30 s; `stop()` waits for the operations already begun to finish (those still queued are
dropped unsent).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
import psycopg

from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

#: Status codes a caller retries: the answer may change on a later attempt.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


@dataclass(frozen=True)
class Ledger:
    """What the load left in one or more shard databases."""

    entries: Counter[str]  # idempotency key -> ledger entries written under it, over all the databases
    balance: int  # sum of all account balances
    unfinished: int  # idempotency records in a state other than completed
    orphans: int  # ledger entries without a completed idempotency record
    empty: int  # records completed OK that wrote no ledger entry

    @classmethod
    def read(cls, dsns: Iterable[str]) -> Ledger:
        """Read and add up each database."""
        entries: Counter[str] = Counter()
        balance = unfinished = orphans = empty = 0
        for dsn in dsns:
            with psycopg.connect(dsn) as conn:
                entries.update(
                    dict(
                        conn.execute(
                            "SELECT idempotency_key::text, count(*) FROM ledger_entries GROUP BY idempotency_key"
                        ).fetchall()
                    )
                )
                balance += _scalar(conn, "SELECT coalesce(sum(balance), 0) FROM accounts")
                unfinished += _scalar(
                    conn, "SELECT count(*) FROM idempotency_record WHERE state <> 'completed'"
                )
                orphans += _scalar(
                    conn,
                    "SELECT count(*) FROM ledger_entries e WHERE NOT EXISTS (SELECT 1 FROM idempotency_record r"
                    " WHERE r.key = e.idempotency_key AND r.state = 'completed')",
                )
                empty += _scalar(
                    conn,
                    "SELECT count(*) FROM idempotency_record r WHERE r.status_code = 0 AND NOT EXISTS"
                    " (SELECT 1 FROM ledger_entries e WHERE e.idempotency_key = r.key)",
                )
        return cls(entries, balance, unfinished, orphans, empty)

    @property
    def duplicates_applied(self) -> int:
        """Ledger entries beyond the first under one key."""
        return sum(n - 1 for n in self.entries.values() if n > 1)


def _scalar(conn: psycopg.Connection[tuple[Any, ...]], sql: str) -> int:
    row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


@dataclass
class LoadResult:
    """What the callers saw: one outcome per copy sent of each operation, and the figures."""

    outcomes: dict[str, list[str]] = field(default_factory=dict)  # key -> "OK" or "FAILED:<code>" per copy
    amounts: dict[str, int] = field(default_factory=dict)  # key -> amount deposited
    counts: Counter[str] = field(default_factory=Counter)  # "duplicates sent", "attempts", transient codes
    errors: list[BaseException] = field(default_factory=list)  # operations that raised
    #: (monotonic start, seconds until answered OK) of every copy answered OK, retries included
    latencies: list[tuple[float, float]] = field(default_factory=list)

    @property
    def completed(self) -> set[str]:
        """Keys every copy of which was answered OK."""
        return {k for k, v in self.outcomes.items() if v and all(o == "OK" for o in v)}

    @property
    def failed(self) -> set[str]:
        """Keys a copy of which was reported failed to its caller."""
        return {k for k, v in self.outcomes.items() if any(o.startswith("FAILED") for o in v)}

    def lost(self, ledger: Ledger) -> list[str]:
        """Completed keys without exactly one ledger entry."""
        return [k for k in self.completed if ledger.entries.get(k, 0) != 1]

    def applied_unreported(self, ledger: Ledger) -> list[str]:
        """Keys neither completed nor reported failed that nonetheless wrote a ledger entry."""
        completed, failed = self.completed, self.failed
        return [k for k in self.outcomes if k not in completed and k not in failed and ledger.entries.get(k)]

    def expected_balance(self, ledger: Ledger) -> int:
        """The sum of the amounts of the operations that wrote a ledger entry."""
        return sum(self.amounts[k] for k in ledger.entries if k in self.amounts)

    def summary(self, faults: Counter[str], ledger: Ledger) -> str:
        """The figures line the fault tests print."""
        transient = {k: v for k, v in self.counts.items() if k.isupper()}
        return (
            f"\nfaults: {dict(faults)}; operations {len(self.outcomes)}, "
            f"duplicates sent {self.counts['duplicates sent']}, attempts {self.counts['attempts']}, "
            f"transient answers {transient}; completed {len(self.completed)}, "
            f"reported failed {len(self.failed)}; duplicates applied {ledger.duplicates_applied}; "
            f"operations lost {len(self.lost(ledger))}"
        )


class DepositLoad:
    """Keyed Deposits with duplicates and retries, from a pool of threads, while faults are injected.

    Use as a context manager, or call `start()` and `stop()`; `stop()` returns the `LoadResult` and
    raises if an operation failed other than with a gRPC error.
    """

    def __init__(
        self,
        stub: transfer_pb2_grpc.TransferServiceStub,
        *,
        seed: int,
        accounts: int,
        transient: Iterable[grpc.StatusCode] = TRANSIENT,
        workers: int = 8,
        interval_s: float = 0.01,
        call_timeout_s: float = 3.0,
        give_up_after_s: float = 30.0,
    ) -> None:
        self._stub = stub
        self._seed = seed
        self._accounts = accounts
        self._transient = frozenset(transient)
        self._workers = workers
        self._interval_s = interval_s
        self._call_timeout_s = call_timeout_s
        self._give_up_after_s = give_up_after_s
        self._result = LoadResult()
        self._lock = threading.Lock()  # guards self._result
        self._stop = threading.Event()
        self._loader = threading.Thread(target=self._submit, name="deposit-load")

    def start(self) -> DepositLoad:
        """Start submitting operations."""
        self._loader.start()
        return self

    def stop(self) -> LoadResult:
        """Stop submitting, wait for the operations under way to end, return what they saw."""
        self._stop.set()
        if self._loader.is_alive():
            self._loader.join()
        if self._result.errors:
            raise AssertionError(
                f"{len(self._result.errors)} load operations raised; the first: {self._result.errors[0]!r}"
            ) from self._result.errors[0]
        return self._result

    def __enter__(self) -> DepositLoad:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._loader.is_alive():
            self._loader.join()

    def _submit(self) -> None:
        n = 0
        with ThreadPoolExecutor(self._workers, thread_name_prefix="deposit-load") as pool:
            while not self._stop.is_set():
                pool.submit(self._operation, n)
                n += 1
                time.sleep(self._interval_s)

    def _operation(self, n: int) -> None:
        if self._stop.is_set():
            # Queued but not begun when the load stopped: never sent, so not an operation. While the
            # calls hang (a daemon paused at a failpoint) the queue grows; this keeps `stop()` short.
            return
        rng = random.Random(f"{self._seed}:{n}")  # one generator per operation: no sharing across threads
        key, amount, copies = str(new_key()), rng.randint(1, 100), rng.choice([1, 2, 3])
        outcomes: list[str] = []  # this thread's own figures, added to the shared ones at the end
        latencies: list[tuple[float, float]] = []
        counts: Counter[str] = Counter({"duplicates sent": copies - 1})
        with self._lock:  # registered before the first send: a key counts as an operation once sent
            self._result.outcomes[key], self._result.amounts[key] = [], amount
        request = transfer_pb2.DepositRequest(
            account_id=f"acct-{n % self._accounts}",
            amount=transfer_pb2.Money(amount_minor=amount, currency="EUR"),
        )
        try:
            for _ in range(copies):
                started = time.monotonic()
                outcomes.append(self._send(request, key, rng, counts))
                if outcomes[-1] == "OK":
                    latencies.append((started, time.monotonic() - started))
        except BaseException as err:
            with self._lock:
                self._result.errors.append(err)
            raise
        finally:
            with self._lock:
                self._result.outcomes[key].extend(outcomes)
                self._result.counts.update(counts)
                self._result.latencies.extend(latencies)

    def _send(
        self, request: transfer_pb2.DepositRequest, key: str, rng: random.Random, counts: Counter[str]
    ) -> str:
        """One copy, retried on transient codes: "OK" or "FAILED:<code>"."""
        give_up = time.monotonic() + self._give_up_after_s
        while True:
            counts["attempts"] += 1
            try:
                self._stub.Deposit(request, metadata=[(KEY_METADATA, key)], timeout=self._call_timeout_s)
                return "OK"
            except grpc.RpcError as err:
                code = err.code()
                if code not in self._transient or time.monotonic() > give_up:
                    return f"FAILED:{code.name}"
                counts[code.name] += 1
                time.sleep(0.05 + rng.random() * 0.1)
