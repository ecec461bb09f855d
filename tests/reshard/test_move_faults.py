"""A move under keyed load while a shard daemon or the old owner's PostgreSQL is SIGKILLed in the
middle of it: every key applied once, every retry after the move a verbatim replay, money
conserved once every cross-shard credit landed, balances = ledger sums, nothing left behind.

Two shards, each its own `shardd` process following one shard map file (re-read every 0.1 s).
Callers send each operation to the owner of its routing account by the map file at each attempt,
and retry with the same key on UNAVAILABLE, ABORTED or DEADLINE_EXCEEDED; 30 % of them send the
operation again at once with the same key. The move is stopped at a phase with `run(until=...)`,
the kill lands, and the move goes on (or a new orchestrator resumes or aborts it from the journal).

Cases: the old owner's daemon killed after the copy (restarted before the cut-over); the new
owner's killed once the old owner is fenced (the map committed to it while it is down); the old
owner's PostgreSQL, on a server of its own, killed during the copy, after the copy and after the
fence, then the move resumed or aborted by a new orchestrator. What a crash does to the move's
logical slot and subscription is observed and printed: the slot survives (it was saved when made)
at the position it last saved, and the subscription reconnects by itself some seconds later.

And no operation is refused for good: a wrong refusal turned up here (a Transfer to a just-moved
account answered NOT_FOUND by the old owner on its stale map, stored under the key); the last case
makes that window certain.

`pytest -s` prints one line per case: operations, duplicates, lost, applied twice, the move's
phase figures.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2, status_pb2

from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, load_shard_map, write_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.reshard.journal import MoveRecord
from shardrouter.reshard.move import Move, MoveSettings, find_move, start_move
from shardrouter.reshard.plan import Phase
from shardrouter.reshard.replication import copy_state
from shardrouter.reshard.verify import rows_in_range
from shardrouter.v1 import transfer_pb2
from tests.helpers import key_metadata, money, own_postgres
from tests.processes import ServiceProcess, shardd_process
from tests.reshard.cluster import (
    FIRST,
    LAST,
    SEEDED,
    TRANSIENT,
    Answer,
    Load,
    Pair,
    accounts,
    answer_of,
    assert_no_leftovers,
    assert_replays_match,
    check_ledger,
    seed,
    send,
)

# A copy that resumes after the old owner's PostgreSQL was killed waits for the subscription's
# workers to reconnect (wal_retrieve_retry_interval, 5 s a try): 60 s leaves room for a busy machine.
QUICK = MoveSettings(copy_timeout_s=60, catch_up_timeout_s=30, final_sync_timeout_s=30)
DAEMON_ENV = {
    "SHARDD_SHARD_MAP_RELOAD_S": "0.1",
    "SHARDD_RELAY_WORKERS": "1",
    "SHARDD_LOG_LEVEL": "WARNING",
    "SHARDD_POOL_TIMEOUT_S": "1",
}
SOURCE, TARGET = "shard-0", "shard-1"


# The cluster: two shardd processes over two databases, on one server or on two.


@dataclass
class Shards:
    """The pair as `tests/reshard/cluster.py` knows it, with the daemons as processes."""

    pair: Pair
    daemons: dict[str, ServiceProcess]

    def kill(self, shard_id: str) -> None:
        self.daemons[shard_id].kill()

    def start(self, shard_id: str) -> None:
        self.daemons[shard_id].start()

    def move(self, record: MoveRecord) -> Move:
        return Move(record, map_store=self.pair.map_path, databases=self.pair.databases, settings=QUICK)


def _start_shards(
    tmp_path: Path, servers: dict[str, LocalPostgres], env: dict[str, dict[str, str]] | None = None
) -> Shards:
    ports = {sid: free_port() for sid in servers}
    map_path = tmp_path / "shard-map.yaml"
    write_shard_map(map_path, even_shard_map({s: f"127.0.0.1:{p}" for s, p in ports.items()}, version=1))
    dsns = {}
    for sid, server in servers.items():
        name = f"mf{uuid.uuid4().hex[:10]}"
        server.create_database(name)
        dsns[sid] = server.dsn_for(name)
    daemons = {
        sid: shardd_process(
            tmp_path,
            shard_id=sid,
            dsn=dsns[sid],
            shard_map=map_path,
            port=ports[sid],
            extra_env={**DAEMON_ENV, **(env or {}).get(sid, {})},
        )
        for sid in servers
    }
    try:
        with ThreadPoolExecutor(len(daemons)) as pool:  # both migrate and start at once
            for started in [pool.submit(d.start) for d in daemons.values()]:
                started.result()
    except BaseException:
        for daemon in daemons.values():
            daemon.kill()
        raise
    return Shards(Pair(map_path, dsns, ports), daemons)


def _stop_shards(shards: Shards) -> None:
    shards.pair.close()
    for daemon in shards.daemons.values():
        daemon.kill()


@pytest.fixture
def shards(postgres: LocalPostgres, tmp_path: Path) -> Iterator[Shards]:
    """Both databases on the session's server."""
    cluster = _start_shards(tmp_path, {SOURCE: postgres, TARGET: postgres})
    yield cluster
    _stop_shards(cluster)


@pytest.fixture(scope="module")
def old_owner_server() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of the old owner's own (wal_level=logical, as every LocalPostgres)."""
    yield from own_postgres()


@pytest.fixture
def split_shards(
    postgres: LocalPostgres, old_owner_server: LocalPostgres, tmp_path: Path
) -> Iterator[Shards]:
    """The old owner's database on its own server, the new owner's on the session's server."""
    if not _accepting(old_owner_server):  # a failed case before may have left it down
        old_owner_server.start()
    cluster = _start_shards(tmp_path, {SOURCE: old_owner_server, TARGET: postgres})
    yield cluster
    _stop_shards(cluster)
    if not _accepting(old_owner_server):
        old_owner_server.start()


def _accepting(server: LocalPostgres) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=0.5):
            return True
    except OSError:
        return False


def kill_postgres(server: LocalPostgres) -> None:
    """SIGKILL the postmaster and every process of it at once, like a machine lost: no shutdown
    checkpoint, crash recovery at the next start."""
    assert server.kill() is not None, "the old owner's server was not running"


def _request_text(request: object) -> str:
    if isinstance(request, transfer_pb2.TransferRequest):
        return f"{request.source_account_id} -> {request.destination_account_id}"
    return str(getattr(request, "account_id", request))


def _reason(answer: Answer) -> str:
    """The ErrorInfo reason of an error answer (its google.rpc.Status bytes)."""
    for detail in status_pb2.Status.FromString(cast(bytes, answer[3])).details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return "-"


@dataclass(frozen=True)
class Tally:
    """What the ledgers of both shards hold of the load's keys."""

    lost: list[str]  # answered OK, but a leg is missing
    applied_twice: list[str]  # a leg written more than once
    applied_refused: list[str]  # answered with an error, yet something was written


def tally(pair: Pair, load: Load) -> Tally:
    """Each key's legs, over both shards (call after every credit landed): a Deposit's one
    `deposit` leg under its key, a Transfer's `transfer_out` under its key and one `transfer_in`
    of its transfer id (under the key, or the credit's own key when it crossed shards)."""
    by_key: Counter[tuple[str, str]] = Counter()
    by_transfer: Counter[tuple[str, str]] = Counter()
    for sid in pair.dsns:
        for key, kind, transfer_id in pair.sql(
            sid, "SELECT idempotency_key::text, kind, transfer_id::text FROM ledger_entries"
        ):
            by_key[(str(key), str(kind))] += 1
            if transfer_id is not None:
                by_transfer[(str(transfer_id), str(kind))] += 1
    lost, refused = [], []
    for key, (method, _, _, first) in load.answers.items():
        if first[0] != "ok":
            written = {kind: by_key[(str(key), kind)] for kind in ("deposit", "transfer_out", "transfer_in")}
            if any(written.values()):
                refused.append(f"{method} {key}: {first[1]} but written {written}")
            continue
        if method == "Deposit":
            if by_key[(str(key), "deposit")] != 1:
                lost.append(f"Deposit {key}")
            continue
        transfer_id = transfer_pb2.TransferResponse.FromString(first[1]).transfer.transfer_id  # type: ignore[arg-type]
        if by_key[(str(key), "transfer_out")] != 1 or by_transfer[(transfer_id, "transfer_in")] != 1:
            lost.append(f"Transfer {key} ({transfer_id})")
    twice = [f"{k} {kind} x{n}" for (k, kind), n in by_key.items() if n > 1]
    twice += [f"transfer {t} {kind} x{n}" for (t, kind), n in by_transfer.items() if n > 1]
    return Tally(lost, twice, refused)


# One case: seed, load, the kill and the move (the test's), then every invariant and the figures.


@dataclass
class Case:
    """One case's cluster, accounts (`moving`: in the range, on the old owner at first), load,
    the map's version before the move, and figures noted on the way."""

    shards: Shards
    moving: list[str]
    everyone: list[str]
    load: Load
    version: int
    started: float
    notes: dict[str, object] = field(default_factory=dict)


@contextlib.contextmanager
def under_load(shards: Shards, n: int = 6) -> Iterator[Case]:
    """Seed `n` accounts in the range and `n` elsewhere, run the load around the block."""
    pair = shards.pair
    moving, staying = accounts(pair, n)
    everyone = moving + staying
    seed(pair, everyone)
    load = Load(pair.call, everyone, threads=3, retry_on=TRANSIENT)
    case = Case(shards, moving, everyone, load, load_shard_map(pair.map_path).version, 0.0)
    case.load.start()
    case.started = time.monotonic()
    try:
        time.sleep(0.5)
        yield case
        time.sleep(0.5)  # load after the move too, through the map in force
    finally:
        case.load.stop()
        assert not case.load.stuck, "a load thread is stuck"


def check_and_report(name: str, case: Case, record: MoveRecord) -> None:
    """Every invariant, once the move is done or aborted and the load stopped; then the figures."""
    pair, load = case.shards.pair, case.load
    elapsed = time.monotonic() - case.started
    done = record.phase is Phase.DONE
    assert record.phase in (Phase.DONE, Phase.ABORTED)
    assert find_move(pair.databases, record.plan.move_id).phase is record.phase
    owner, other = (TARGET, SOURCE) if done else (SOURCE, TARGET)
    assert load_shard_map(pair.map_path).version == case.version + done
    assert all(pair.owner(a) == owner for a in case.moving)
    assert load.mismatches == []
    assert load.ok_count() > 20, f"the load barely ran: {load.ok_count()} successful calls"
    assert_replays_match(load, pair)
    check_ledger(pair, len(case.everyone), load.deposited())  # waits until every credit landed
    counted = tally(pair, load)
    assert counted.lost == []
    assert counted.applied_twice == []
    assert counted.applied_refused == []
    # The range's rows are on one side only; the moved-out marker only at the old owner after a move.
    with psycopg.connect(pair.dsns[other], autocommit=True) as conn:
        assert {t: n for t, n in rows_in_range(conn, record.plan).items() if n} == {}
    fences = {sid: [m for (m,) in pair.sql(sid, "SELECT move_id FROM slot_fences")] for sid in pair.dsns}
    assert fences == ({SOURCE: [record.plan.move_id], TARGET: []} if done else {SOURCE: [], TARGET: []})
    assert_no_leftovers(pair)
    f = record.figures
    rows = f.get("rows_moved") or {}
    figures = (
        f"rows_moved={sum(rows.values()) if isinstance(rows, dict) else rows}"
        if done
        else f"aborted_from={f.get('aborted_from')} rows_removed_at_target={f.get('rows_removed_at_target')}"
    )
    for k in ("copy_restarts", "copy_s", "catch_up_s", "drain_s", "final_sync_s", "verify_s", "write_pause_s", "clean_up_s"):
        if k in f:
            figures += f" {k}={f[k]}"
    # Every account exists and holds far more than the load moves: nothing may be refused for good.
    # (Before shardd re-checked a missing destination, an old owner acting on its map from before
    # the commit answered a Transfer to a moved account NOT_FOUND, stored, after the clean-up
    # deleted the account there: see the stale-map case at the end.)
    refused = [f"{m} {_request_text(r)}: {a[1]} {_reason(a)} {a[2]!r}" for m, r, a in load.refusals()]
    assert refused == []
    parts = [
        f"{len(load.answers)} operations ({load.ok_count()} ok, {len(refused)} refused)",
        f"{load.duplicates} duplicates",
        f"attempts retried {dict(load.retried) or 0}",
        f"lost {len(counted.lost)}",
        f"applied twice {len(counted.applied_twice)}",
        f"replays verbatim {len(load.answers)}/{len(load.answers)}",
        f"money conserved ({SEEDED * len(case.everyone) + load.deposited()})",
        f"move {record.phase.value}: {figures}",
        *(f"{k}={v}" for k, v in case.notes.items()),
        f"{elapsed:.1f} s",
    ]
    print(f"\n{name}: " + ", ".join(parts))


# 1a/1b: a shard daemon SIGKILLed mid-move and started again.


def test_old_owners_daemon_killed_after_the_copy_then_restarted(shards: Shards) -> None:
    with under_load(shards) as case:
        record = start_move(shards.pair.map_path, shards.pair.databases, FIRST, LAST, TARGET)
        with shards.move(record) as move:
            move.run(until=Phase.COPIED)
            shards.kill(SOURCE)  # in-flight calls die with it: their callers retry with the same key
            move.run(until=Phase.CAUGHT_UP)  # the catch-up while the old owner's daemon is dead
            time.sleep(0.3)
            shards.start(SOURCE)
            move.run()
    check_and_report("old owner's shardd killed after the copy", case, record)


def test_new_owners_daemon_killed_at_the_cut_over_then_restarted(shards: Shards) -> None:
    with under_load(shards) as case:
        record = start_move(shards.pair.map_path, shards.pair.databases, FIRST, LAST, TARGET)
        with shards.move(record) as move:
            move.run(until=Phase.FENCED)  # the old owner refuses the range now
            shards.kill(TARGET)
            move.run(until=Phase.COMMITTED)  # the map names a dead owner: callers retry meanwhile
            time.sleep(0.3)
            shards.start(TARGET)
            move.run()
    check_and_report("new owner's shardd killed at the cut-over", case, record)


# 1c: the old owner's PostgreSQL SIGKILLed mid-move and started again; a new orchestrator goes on.


def _slot(pair: Pair, name: str) -> tuple[object, ...] | None:
    rows = pair.sql(
        SOURCE,
        "SELECT confirmed_flush_lsn::text, active FROM pg_replication_slots WHERE slot_name = %s",
        (name,),
    )
    return rows[0] if rows else None


@dataclass
class Reconnect:
    """Watches the move's slot from the restart on: when a walsender streams from it again (the
    subscription reconnected by itself), or that it was dropped first."""

    pair: Pair
    name: str
    seconds: float | None = None
    dropped_first: bool = False
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        started = time.monotonic()
        query = "SELECT active FROM pg_replication_slots WHERE slot_name = %s"
        with psycopg.connect(self.pair.dsns[SOURCE], autocommit=True) as conn:
            while time.monotonic() - started < 20:
                slot = conn.execute(query, (self.name,)).fetchone()
                if slot is None:
                    self.dropped_first = True
                    return
                if slot[0]:
                    self.seconds = round(time.monotonic() - started, 2)
                    return
                time.sleep(0.01)

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join(30)

    @property
    def figure(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds} s"
        return "no, the move dropped it first" if self.dropped_first else "not within 20 s"


def _crash_old_owners_postgres(case: Case, server: LocalPostgres, name: str) -> Reconnect:
    """SIGKILL the old owner's server, keep it down a moment under load, start it again: what the
    crash did to the move's logical slot, and a watch for the subscription's return."""
    pair = case.shards.pair
    before = _slot(pair, name)
    assert before is not None
    kill_postgres(server)
    time.sleep(0.5)
    server.start()
    after = _slot(pair, name)
    # The slot was made (and saved to disk) when the move was prepared: it survives the crash, at
    # the position it last saved (a checkpoint, or a move of its restart_lsn), which may be behind
    # what the subscriber had confirmed; the subscriber's own origin says where to go on from.
    assert after is not None, "the move's logical slot did not survive the crash"
    case.notes["slot_confirmed_lsn_before/after_crash"] = f"{before[0]}/{after[0]}"
    watch = Reconnect(pair, name)
    watch.start()
    return watch


def _new_orchestrator(case: Case, record: MoveRecord, at: Phase, then: str, watch: Reconnect) -> MoveRecord:
    """The move from the journal (stopped at `at`) resumed or aborted (`then`) by a new orchestrator;
    then how soon the subscription reconnected, as a figure of the case."""
    resumed = find_move(case.shards.pair.databases, record.plan.move_id)
    assert resumed.phase is at
    with case.shards.move(resumed) as move:
        if then == "resume":
            move.run()
        else:
            move.abort()
    watch.join()
    case.notes["subscription_reconnected_after"] = watch.figure
    return resumed


# Both phases resumed in the default suite (a resumed subscription is what broke before); the aborts
# after the same kills with --run-slow, since an abort after the old owner's PostgreSQL died is run
# by the copy's kill below in every suite.
@pytest.mark.parametrize(
    ("at", "then"),
    [
        (Phase.COPIED, "resume"),
        (Phase.FENCED, "resume"),
        pytest.param(Phase.COPIED, "abort", marks=pytest.mark.slow),
        pytest.param(Phase.FENCED, "abort", marks=pytest.mark.slow),
    ],
    ids=["catching-up-resume", "fenced-resume", "catching-up-abort", "fenced-abort"],
)
def test_old_owners_postgres_killed_mid_move_then_the_move_resumes_or_aborts(
    split_shards: Shards, old_owner_server: LocalPostgres, at: Phase, then: str
) -> None:
    shards = split_shards
    with under_load(shards) as case:
        record = start_move(shards.pair.map_path, shards.pair.databases, FIRST, LAST, TARGET)
        with shards.move(record) as move:
            move.run(until=at)
        watch = _crash_old_owners_postgres(case, old_owner_server, record.plan.object_name)
        # A new orchestrator, from the journal: the first one's connections died with the server.
        resumed = _new_orchestrator(case, record, at, then, watch)
    check_and_report(f"old owner's PostgreSQL killed at {at.value}, then {then}", case, resumed)


# A kill that lands as a table sync worker drops its slot can leave that table copied (state 'f')
# with its slot gone, which PostgreSQL never repairs; the move then copies again from nothing
# (`tests/reshard/test_move_copy_repair.py` makes that state every time; `copy_restarts` counts it).
@pytest.mark.parametrize("then", ["resume", "abort"])
def test_old_owners_postgres_killed_during_the_copy_then_the_move_resumes_or_aborts(
    split_shards: Shards, old_owner_server: LocalPostgres, then: str
) -> None:
    shards, pair = split_shards, split_shards.pair
    with under_load(shards) as case:
        record = start_move(pair.map_path, pair.databases, FIRST, LAST, TARGET)
        failed: list[BaseException] = []

        def first_orchestrator() -> None:
            try:
                with shards.move(record) as move:
                    move.run(until=Phase.COPIED)
            except psycopg.Error as exc:  # its server died under it
                failed.append(exc)

        orchestrator = threading.Thread(target=first_orchestrator, daemon=True)
        orchestrator.start()
        name, deadline = record.plan.object_name, time.monotonic() + 15
        with psycopg.connect(pair.dsns[TARGET], autocommit=True) as target:
            while "d" not in copy_state(target, name).states.values():  # a table's data is copying
                assert time.monotonic() < deadline and orchestrator.is_alive(), "the copy never started"
                time.sleep(0.01)
            case.notes["copy_states_at_kill"] = "".join(copy_state(target, name).states.values())
        watch = _crash_old_owners_postgres(case, old_owner_server, name)
        orchestrator.join(30)
        assert not orchestrator.is_alive() and failed, "the first orchestrator outlived its server"
        resumed = _new_orchestrator(case, record, Phase.PREPARED, then, watch)
    check_and_report(f"old owner's PostgreSQL killed during the copy, then {then}", case, resumed)


# What the load cases met now and then before shardd re-checked a missing destination, made certain.


@pytest.mark.parametrize("moved", ["destination", "source"])
def test_a_transfer_with_a_just_moved_account_is_not_refused_for_good(
    postgres: LocalPostgres, tmp_path: Path, moved: str
) -> None:
    """Right after a move, the old owner's daemon has not re-read the map yet (one reload interval,
    1 s by default, 0.1 s in the load cases; 60 s here so that the call lands in that window every
    time). A Transfer with a moved account must not be refused for good: the account exists, at
    the new owner. Applied (a credit sent to the new owner) or UNAVAILABLE (retried with the same
    key until the map in force names the owner) are both right; NOT_FOUND is not."""
    shards = _start_shards(
        tmp_path, {SOURCE: postgres, TARGET: postgres}, env={SOURCE: {"SHARDD_SHARD_MAP_RELOAD_S": "60"}}
    )
    try:
        pair = shards.pair
        moving, staying = accounts(pair, 4)
        seed(pair, moving + staying)
        payer = next(a for a in staying if pair.owner(a) == SOURCE)
        record = start_move(pair.map_path, pair.databases, FIRST, LAST, TARGET)
        with shards.move(record) as move:
            move.run()
        assert pair.owner(moving[0]) == TARGET
        # To a moved account; or from one, sent by a caller (a router) whose map is as old.
        src, dst = (payer, moving[0]) if moved == "destination" else (moving[0], payer)
        request = transfer_pb2.TransferRequest(
            source_account_id=src, destination_account_id=dst, amount=money(5)
        )
        key = new_key()
        try:
            first = answer_of(
                pair.stub(SOURCE).Transfer(request, metadata=tuple(key_metadata(key)), timeout=5)
            )
        except grpc.RpcError as err:
            first = answer_of(err)
        # The same key again, once the old owner's daemon has the new map (restarted: read at start).
        shards.kill(SOURCE)
        shards.start(SOURCE)
        again = answer_of(send(pair, "Transfer", request, key, src, retry_on=TRANSIENT))
        assert first[0] == "ok" or first[1] is grpc.StatusCode.UNAVAILABLE, (
            f"{src} -> {dst} ({moving[0]} moved to {TARGET}) answered by {SOURCE}: {first[1]} {first[2]!r};"
            f" the same key once it has the new map: {again[1]} {again[2]!r}"
        )
        assert again[0] == "ok", again[:3]
    finally:
        _stop_shards(shards)
