"""The workload a check sends through a router over gRPC: the mix a real caller sends.

Deposits, transfers within a shard and across shards (and a few to an account nobody opened, which the
destination refuses and the source refunds), each under its own UUIDv7 key and resent with that key
until it has a definite answer; some sent two or three times at once (duplicates in flight), some sent
again after their answer (a late retry), some keys sent again with another body (a caller's bug the
shard must refuse), and a few deposits under a key older than the retention window. Every attempt
and its answer goes to the history file as it comes back.

Bytes go out and come back untouched (no stub re-encodes them), so the history holds what the caller
saw, and a replay can be compared byte for byte.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from shardrouter.check.history import Attempt, HistoryWriter, Operation, b64, sha256_hex
from shardrouter.check.http import CallerTls, Exchange, post
from shardrouter.check.ledgers import owners
from shardrouter.client.status import error_details, pushback_s, trailer, was_replayed
from shardrouter.core.keys import new_key
from shardrouter.core.rpcs import rpc
from shardrouter.core.tls import channel_credentials
from shardrouter.core.wire_names import CALLER_METADATA, KEY_METADATA, OUTCOME_TRAILER
from shardrouter.v1 import transfer_pb2

_SERVICE = "shardrouter.v1.TransferService"
DEPOSIT = rpc(_SERVICE, "Deposit").full_name
TRANSFER = rpc(_SERVICE, "Transfer").full_name
#: Every account the check opens or names starts so: a run's accounts are its own, and an
#: authorization policy can allow the check on them alone (`chk-*`).
ACCOUNT_PREFIX = "chk-"
#: How old the expired keys are: past any retention a deployment is likely to keep (30 days by
#: default). A shard that keeps keys longer applies them, which the proofs accept.
EXPIRED_KEY_AGE_DAYS = 400
_DAY_MS = 86_400_000


@dataclass(frozen=True)
class Workload:
    """How much to send, how, and in what mix."""

    operations: int = 300
    duration_s: float = 120.0
    concurrency: int = 8
    seed: int = 1
    #: Accounts opened (by a seed deposit each) for the run, spread over the shards by their ids.
    accounts: int = 12
    currency: str = "EUR"
    seed_amount: int = 100_000
    in_flight_duplicates: float = 0.15
    later_duplicates: float = 0.15
    reused_bodies: float = 0.05
    expired_keys: int = 2
    #: Each send's deadline, and how long one operation is resent before it is left pending (s).
    attempt_timeout_s: float = 5.0
    operation_timeout_s: float = 60.0
    caller: str = ""


@dataclass(frozen=True)
class DriveSummary:
    """What a drive did."""

    operations: int
    attempts: int
    seconds: float
    #: Operations planned but not started before the time bound.
    not_started: int


def request_bytes(op: Operation, amount_minor: int | None = None) -> tuple[str, bytes]:
    """The operation's method and request bytes (with another amount: the reused-body request)."""
    money = transfer_pb2.Money(
        amount_minor=op.amount_minor if amount_minor is None else amount_minor, currency=op.currency
    )
    if op.kind == "deposit":
        message: Any = transfer_pb2.DepositRequest(account_id=op.account, amount=money, reference=op.label)
        return DEPOSIT, message.SerializeToString(deterministic=True)
    message = transfer_pb2.TransferRequest(
        source_account_id=op.account, destination_account_id=op.destination, amount=money, reference=op.label
    )
    return TRANSFER, message.SerializeToString(deterministic=True)


class Sender:
    """Sends request bytes with a key through one channel and records each attempt."""

    def __init__(
        self,
        target: str,
        writer: HistoryWriter,
        workload: Workload,
        http: str = "",
        tls: CallerTls | None = None,
    ) -> None:
        #: The HTTP front's base URL; "" sends over gRPC to `target`.
        self._http = http
        self._ssl = tls.ssl_context() if tls is not None and http else None
        self._channel = (
            grpc.secure_channel(target, channel_credentials(tls.cert, tls.key, tls.ca))
            if tls is not None
            else grpc.insecure_channel(target)
        )
        self._writer = writer
        self._workload = workload
        self._calls = {path: self._channel.unary_unary(path, None, None) for path in (DEPOSIT, TRANSFER)}
        self._count = 0
        self._lock = threading.Lock()

    @property
    def attempts(self) -> int:
        """Attempts sent so far."""
        return self._count

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def _grpc(self, key: str, method: str, body: bytes) -> Exchange:
        metadata: tuple[tuple[str, str | bytes], ...] = ((KEY_METADATA, key),)
        if self._workload.caller:
            metadata += ((CALLER_METADATA, self._workload.caller),)
        code, message, response = "OK", "", b""
        trailers: tuple[Any, ...] = ()
        try:
            response, call = self._calls[method].with_call(
                body, metadata=metadata, timeout=self._workload.attempt_timeout_s
            )
            trailers = tuple(call.trailing_metadata() or ())
        except grpc.RpcError as err:
            code, message = err.code().name, err.details() or ""
            trailers = tuple(err.trailing_metadata() or ())
        outcome = trailer(trailers, OUTCOME_TRAILER)
        return Exchange(
            sent=body,
            code=code,
            reason=error_details(trailers).reason or "",
            message=message,
            response=response or b"",
            replayed=was_replayed(trailers),
            wait_s=pushback_s(trailers) or error_details(trailers).retry_delay_s,
            outcome=outcome.decode() if isinstance(outcome, bytes) else (outcome or ""),
        )

    def once(self, key: str, method: str, body: bytes, role: str) -> tuple[Attempt, float | None]:
        """One send and its answer, recorded; with the wait the answer asks for before a resend."""
        started = time.time()
        if self._http:
            w = self._workload
            ex = post(self._http, method, body, key, w.caller, w.attempt_timeout_s, self._ssl)
        else:
            ex = self._grpc(key, method, body)
        attempt = Attempt(
            key=key,
            method=method,
            role=role,
            request_sha256=sha256_hex(ex.sent),
            code=ex.code,
            reason=ex.reason,
            message=ex.message,
            outcome=ex.outcome,
            response_b64=b64(ex.response),
            replayed=ex.replayed,
            started_at=started,
            ended_at=time.time(),
        )
        with self._lock:
            self._count += 1
        self._writer.attempt(attempt)
        return attempt, ex.wait_s

    def until_definite(self, key: str, method: str, body: bytes, role: str, deadline: float) -> Attempt:
        """Send, and resend the same bytes under the same key, until a definite answer or `deadline`
        (the last attempt either way)."""
        backoff = 0.05
        attempt, asked = self.once(key, method, body, role)
        while not attempt.definite and time.monotonic() < deadline:
            time.sleep(min(asked or backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 1.0)
            # A resend of a reused body is still one: the proofs tell the key's own request by role.
            attempt, asked = self.once(key, method, body, "reused_body" if role == "reused_body" else "retry")
        return attempt


def _at_once(calls: list[Callable[[], object]]) -> None:
    """Run `calls` on threads of their own released together (duplicates in flight)."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], object]) -> None:
        barrier.wait()
        call()

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_operation(
    sender: Sender, writer: HistoryWriter, workload: Workload, op: Operation, seed: int
) -> None:
    """One operation: its first send (and its in-flight twins), resent until definite; then perhaps
    a late duplicate, and perhaps its key with another body."""
    rng = random.Random(seed)
    method, body = request_bytes(op)
    writer.operation(op)
    deadline = time.monotonic() + workload.operation_timeout_s
    twins = rng.randint(1, 2) if rng.random() < workload.in_flight_duplicates else 0

    def send(role: str) -> Callable[[], object]:
        return lambda: sender.until_definite(op.key, method, body, role, deadline)

    _at_once([send("first")] + [send("in_flight_duplicate") for _ in range(twins)])
    if rng.random() < workload.later_duplicates:
        send("later_duplicate")()
    if rng.random() < workload.reused_bodies:
        _, other = request_bytes(op, op.amount_minor + 1)
        sender.until_definite(op.key, method, other, "reused_body", deadline)


def _new_key(label: str) -> str:
    if label == "expired_key":
        return str(new_key(int(time.time() * 1000) - EXPIRED_KEY_AGE_DAYS * _DAY_MS))
    return str(new_key())


def plan(workload: Workload, shards_of: dict[str, str], tag: str) -> list[Operation]:
    """The operations after the seed deposits, drawn from the workload's seed."""
    rng = random.Random(workload.seed)
    by_shard: dict[str, list[str]] = {}
    for account, shard in sorted(shards_of.items()):
        by_shard.setdefault(shard, []).append(account)
    accounts = sorted(shards_of)
    if not accounts:
        raise RuntimeError("no seed deposit was acknowledged, or no shard database holds its account")
    cross = len(by_shard) > 1
    mix = (
        ["deposit"] * 25 + ["same_shard"] * 35 + ["cross_shard"] * (35 if cross else 0) + ["to_unopened"] * 5
    )
    ops: list[Operation] = []
    for i in range(workload.operations):
        label = rng.choice(mix)
        account = rng.choice(accounts)
        amount = rng.randint(1, 100)
        if label == "deposit":
            ops.append(Operation(_new_key(label), "deposit", label, account, "", amount, workload.currency))
            continue
        peers = by_shard[shards_of[account]]
        if label == "same_shard":
            destination = rng.choice([a for a in peers if a != account] or peers)
        elif label == "cross_shard":
            destination = rng.choice([a for a in accounts if shards_of[a] != shards_of[account]])
        else:
            destination = f"{ACCOUNT_PREFIX}{tag}-unopened-{i}"
        ops.append(
            Operation(_new_key(label), "transfer", label, account, destination, amount, workload.currency)
        )
    for j in range(workload.expired_keys):
        op = Operation(
            _new_key("expired_key"),
            "deposit",
            "expired_key",
            accounts[j % len(accounts)],
            "",
            7,
            workload.currency,
        )
        ops.insert(rng.randint(0, len(ops)), op)
    return ops


def _run_all(
    sender: Sender, writer: HistoryWriter, workload: Workload, ops: list[Operation], stop_at: float
) -> int:
    """Run `ops` on `workload.concurrency` threads, starting none after `stop_at`; how many started."""
    started = 0
    lock = threading.Lock()

    def one(index: int, op: Operation) -> None:
        nonlocal started
        if time.monotonic() >= stop_at:
            return
        with lock:
            started += 1
        run_operation(sender, writer, workload, op, workload.seed * 1_000_003 + index)

    with ThreadPoolExecutor(max_workers=workload.concurrency) as pool:
        for future in [pool.submit(one, i, op) for i, op in enumerate(ops)]:
            future.result()
    return started


def drive(
    target: str,
    dsns: dict[str, str],
    workload: Workload,
    history: Path,
    http: str = "",
    tls: CallerTls | None = None,
) -> DriveSummary:
    """Send the workload through the router at `target` (or its HTTP front at the URL `http`),
    recording it in `history`; over TLS with `tls` (the router's CA, and a client certificate for
    a router that verifies its callers)."""
    began = time.monotonic()
    stop_at = began + workload.duration_s
    tag = datetime.now(UTC).strftime("%Y%m%d%H%M%S") + f"-{random.getrandbits(24):06x}"
    writer = HistoryWriter(history)
    sender = Sender(target, writer, workload, http, tls)
    try:
        writer.header(
            target=target, seed=workload.seed, tag=tag, started_at=time.time(), workload=vars(workload)
        )
        seeds = [
            Operation(
                str(new_key()),
                "deposit",
                "seed",
                f"{ACCOUNT_PREFIX}{tag}-{i}",
                "",
                workload.seed_amount,
                workload.currency,
            )
            for i in range(workload.accounts)
        ]
        seeded = _run_all(
            sender, writer, replace(workload, in_flight_duplicates=0, reused_bodies=0), seeds, stop_at
        )
        ops = plan(workload, owners(dsns, [s.account for s in seeds]), tag)
        started = _run_all(sender, writer, workload, ops, stop_at)
    finally:
        sender.close()
        writer.close()
    return DriveSummary(seeded + started, sender.attempts, time.monotonic() - began, len(ops) - started)


__all__ = [
    "ACCOUNT_PREFIX",
    "DEPOSIT",
    "TRANSFER",
    "DriveSummary",
    "Sender",
    "Workload",
    "drive",
    "plan",
    "request_bytes",
    "run_operation",
]
