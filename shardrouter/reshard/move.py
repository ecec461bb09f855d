"""One move, phase by phase: prepare, copy, catch up, fence, verify, commit, clean up.

Each phase is safe to repeat, and the journal (`journal.py`, in the old owner's database) says
which phase was reached and which objects exist, so `run` resumes a move after a crash at any
step and `abort` removes everything an unfinished move made.

Ownership changes at one moment, in the old owner's database: one transaction records the fact
(the range belongs to the new owner as of map version V), the journal's phase `committed` and the
map the move committed. Before it the old owner's fence keeps every write off the range there and
the new owner is fenced too (it takes only the replicated rows); the hand-over then records the same
fact in the new owner's database and lowers its fence, and the map is published (a file, or a
ConfigMap: `map_store.py`) so every process learns it fast. Shard daemons decide from their
database's facts before their map, so neither a map published late nor a stale one re-applied can
give the range two owners; a crash between the commit and the hand-over leaves the range fenced on
both sides (unavailable, retryable) until the move is resumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from shardrouter.core import failpoints
from shardrouter.core.ownership import RangeOwner, with_facts, with_owner
from shardrouter.core.shardmap import ShardMap, ShardMapError, shard_map_document
from shardrouter.reshard import journal, replication
from shardrouter.reshard.journal import MoveObject, MoveRecord
from shardrouter.reshard.map_store import MapStore, map_store_from
from shardrouter.reshard.plan import (
    ACTIVE_PHASES,
    MoveError,
    MovePlan,
    Phase,
    owns_range,
    plan_move,
)
from shardrouter.reshard.verify import digests_now, rows_in_range, snapshot, verify
from shardrouter.shardd import fences, partitions
from shardrouter.shardd.fences import SlotFence
from shardrouter.shardd.migrations import FENCED_TABLES, schema_version
from shardrouter.shardd.ownership import record_owner, recorded_owners

#: A move's failpoints (core/failpoints.py), where the crash tests stop its orchestrator: the start
#: checked, not yet journaled (the start lock held); each phase once journaled (`phase_failpoint`);
#: the commit point recorded in the old owner's database, not yet handed over; handed over and the
#: map replaced, not yet cleaned up.
START_CHECKED = "reshard.start_checked"
COMMITTED = "reshard.committed"
PUBLISHED = "reshard.published"


def phase_failpoint(phase: Phase) -> str:
    """The failpoint a move reaches once `phase` is journaled (`planned` by the command that plans it)."""
    return f"reshard.{phase.value}"


Progress = Callable[[str], None]

#: The order rows are deleted in, children before the rows they reference.
_DELETE_ORDER = (
    "voided_credits",
    "dead_letters",
    "delivery_attempts",
    "outbox",
    "ledger_entries",
    "transfers",
    "idempotency_record",
    "accounts",
)
#: The serial ids of moved tables: copied as they are, so they must not meet the new owner's.
_SEQUENCES = (("outbox", "id"), ("delivery_attempts", "id"))
#: Each database's block of ids is 2^40 wide (migration 9 starts its sequences in a random one).
_ID_BLOCK_BITS = 40
_MIN_SCHEMA = 16  # the ownership facts (14), and voided_credits among the moved tables (16)


@dataclass(frozen=True)
class MoveSettings:
    """How a move waits and when it cuts over."""

    #: Cut over once the subscriber is within this many bytes of the old owner's WAL.
    cutover_lag_bytes: int = 256 * 1024
    copy_timeout_s: float = 600.0
    #: How many times one run of the copy starts it again from nothing when PostgreSQL can no
    #: longer finish it (a table copied, its sync slot gone: see `_stranded`).
    copy_restarts: int = 3
    catch_up_timeout_s: float = 300.0
    #: How long the fence waits for older transactions before ending them.
    drain_timeout_s: float = 5.0
    final_sync_timeout_s: float = 60.0
    poll_s: float = 0.05


@dataclass(frozen=True)
class ShardDatabases:
    """Where each shard's database is: shard id -> DSN, and optionally the connection string the
    new owner's server uses to reach the old owner (default: the same DSN)."""

    dsns: dict[str, str]
    replication_dsns: dict[str, str] | None = None

    def dsn(self, shard_id: str) -> str:
        """The DSN of one shard's database."""
        try:
            return self.dsns[shard_id]
        except KeyError:
            raise MoveError(
                f"no database is known for shard {shard_id!r} (known: {', '.join(sorted(self.dsns))})"
            ) from None

    def replication_dsn(self, shard_id: str) -> str:
        """How another shard's server reaches this one's database."""
        return (self.replication_dsns or {}).get(shard_id) or self.dsn(shard_id)


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, connect_timeout=10)


#: The session advisory lock a move's start holds on both shards' databases ("RSTART").
_START_LOCK = 0x5253_5441_5254


def _try_start_lock(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_START_LOCK,)).fetchone()
    return bool(row and row[0])


def _store(where: MapStore | Path | str) -> MapStore:
    return map_store_from(where) if isinstance(where, (Path, str)) else where


def recorded_facts(databases: ShardDatabases, *, shards: list[str] | None = None) -> list[RangeOwner]:
    """Every ownership fact recorded in the shards' databases (all known ones, or `shards`)."""
    facts: list[RangeOwner] = []
    for shard in shards if shards is not None else sorted(databases.dsns):
        with _connect(databases.dsn(shard)) as conn:
            facts.extend(recorded_owners(conn))
    return facts


def current_map(map_store: MapStore | Path | str, databases: ShardDatabases) -> ShardMap:
    """The map every process should follow: the published one, with every newer ownership fact the
    databases recorded applied (a move committed, its map not yet published, or a stale map
    re-applied over it)."""
    published = _store(map_store).load()
    return with_facts(published, recorded_facts(databases))


def start_move(
    map_store: MapStore | Path | str, databases: ShardDatabases, first_slot: int, last_slot: int, target: str
) -> MoveRecord:
    """Check and journal a new move (nothing is created yet)."""
    shard_map = current_map(map_store, databases)
    plan = plan_move(shard_map, first_slot, last_slot, target)
    with _connect(databases.dsn(plan.source)) as source, _connect(databases.dsn(plan.target)) as dest:
        # Two starts at once would both pass the checks below before either journals its move; the
        # start lock on both shards' databases (in shard order, until the journal entry is made)
        # makes the second see the first's journal, or be told to try again.
        locked: list[psycopg.Connection[Any]] = []
        try:
            for shard, conn in sorted(((plan.source, source), (plan.target, dest)), key=lambda sc: sc[0]):
                if not _try_start_lock(conn):
                    raise MoveError(
                        f"another move is being started on {shard} right now; start this one again"
                    )
                locked.append(conn)
            return _checked_and_journaled(plan, source, dest)
        finally:
            # Let go here, not by closing: a closed session's backend drops its locks only once it
            # has exited, and a start right after this one would be refused meanwhile.
            for conn in locked:
                _release_start_lock(conn)


def _release_start_lock(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.execute("SELECT pg_advisory_unlock(%s)", (_START_LOCK,))
    except psycopg.Error:
        conn.close()  # the lock goes with the session


def _checked_and_journaled(
    plan: MovePlan, source: psycopg.Connection[Any], dest: psycopg.Connection[Any]
) -> MoveRecord:
    """Refuse a move that cannot be done (MoveError, with the reason), else journal it; the start
    lock is held on both databases."""
    for shard, conn in ((plan.source, source), (plan.target, dest)):
        version = schema_version(conn)
        if version < _MIN_SCHEMA:
            raise MoveError(f"{shard}'s database is at schema {version}; start its shardd once to migrate it")
    for conn in (source, dest):
        for other in journal.active_moves(conn):
            o = other.plan
            if o.first_slot <= plan.last_slot and o.last_slot >= plan.first_slot:
                raise MoveError(
                    f"move {o.move_id} of slots {o.first_slot}-{o.last_slot} is still {other.phase}: "
                    f"finish it (reshard resume {o.move_id}) or abort it first"
                )
    held = {t: n for t, n in rows_in_range(dest, plan).items() if n}
    if held:
        raise MoveError(
            f"{plan.target} already holds rows of slots {plan.first_slot}-{plan.last_slot} ({held}); "
            "a move may only copy into an empty range"
        )
    for fence in fences.fences(dest):
        inside = fence.first_slot >= plan.first_slot and fence.last_slot <= plan.last_slot
        overlaps = fence.first_slot <= plan.last_slot and fence.last_slot >= plan.first_slot
        if overlaps and not inside:
            raise MoveError(
                f"{plan.target} has a fence of slots {fence.first_slot}-{fence.last_slot} (move "
                f"{fence.move_id}) that crosses this range; move that range back whole"
            )
    failpoints.reached(START_CHECKED)  # checked, not yet journaled; start lock held
    return journal.create_move(source, plan)


class Move:
    """Drives one journaled move; `run` takes it to the end, `abort` undoes it."""

    def __init__(
        self,
        record: MoveRecord,
        *,
        map_store: MapStore | Path | str,
        databases: ShardDatabases,
        settings: MoveSettings | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.record = record
        self.plan: MovePlan = record.plan
        self._store = _store(map_store)
        self._databases = databases
        self._settings = settings or MoveSettings()
        self._progress = progress or (lambda _: None)
        self._source = _connect(databases.dsn(self.plan.source))
        self._target = _connect(databases.dsn(self.plan.target))

    def close(self) -> None:
        """Close the connections."""
        self._source.close()
        self._target.close()

    def __enter__(self) -> Move:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _fence(self) -> SlotFence:
        p = self.plan
        return SlotFence(p.move_id, p.slots, p.first_slot, p.last_slot)

    def run(self, *, until: Phase = Phase.DONE) -> MoveRecord:
        """Take the move from its journaled phase to `until` (default: the end)."""
        steps: dict[Phase, Callable[[], None]] = {
            Phase.PLANNED: self._prepare,
            Phase.PREPARED: self._copy,
            Phase.COPIED: self._catch_up,
            Phase.CAUGHT_UP: self._cut_over,
            Phase.FENCED: self._verify,
            Phase.VERIFIED: self._commit,
            Phase.COMMITTED: self._clean_up,
        }
        if self.record.phase is Phase.ABORTED:
            raise MoveError(f"move {self.plan.move_id} was aborted; start a new one")
        # A resumed move may find the old owner's server somewhere else (a restarted local cluster
        # takes new ports; a failed-over primary another host): its subscription follows the DSN.
        replication.point_subscription(
            self._target,
            self.plan.object_name,
            source_conninfo=self._databases.replication_dsn(self.plan.source),
        )
        while self.record.phase.rank < until.rank:
            steps[self.record.phase]()
        return self.record

    # The phases. Each ends by journaling the next phase; each may run again after a crash.

    def _prepare(self) -> None:
        started = time.monotonic()
        p, name = self.plan, self.plan.object_name
        self._record("fence", p.move_id, p.target)
        fences.raise_fence(self._target, self._fence)
        with self._target.transaction():  # moved-out markers of earlier moves of this range
            self._target.execute(
                "DELETE FROM slot_fences WHERE move_id <> %s AND slots = %s"
                " AND first_slot >= %s AND last_slot <= %s",
                (p.move_id, p.slots, p.first_slot, p.last_slot),
            )
        have = set(partitions.existing_partitions(self._target))
        for month in partitions.existing_partitions(self._source):
            if month not in have:
                self._record("partition", month.table, p.target)
                partitions.create_partition(self._target, month)
        id_spans = self._check_id_spaces()
        # The row filter needs REPLICA IDENTITY FULL, permanent since migration 15 (partitions get
        # it before they are attached): normally a catalog read and no lock. Only a table that
        # lacks it (a database not migrated yet) is altered; a move leaves it as it is.
        replication.ensure_replica_identity(self._source)
        self._record("publication", name, p.source)
        replication.create_publication(self._source, name, p)
        self._record("slot", name, p.source)
        replication.create_slot(self._source, name)
        self._phase(Phase.PREPARED, prepare_s=round(time.monotonic() - started, 3), id_spans=id_spans)

    def _copy(self) -> None:
        started = time.monotonic()
        name = self.plan.object_name
        self._record("subscription", name, self.plan.target)
        self._subscribe()
        deadline = started + self._settings.copy_timeout_s
        shown = 0.0
        suspects: list[str] = []
        restarts = 0
        while True:
            state = replication.copy_state(self._target, name)
            if state.copied:
                break
            if time.monotonic() - shown >= 1.0:
                shown = time.monotonic()
                copied = sum(rows_in_range(self._target, self.plan).values())
                journal.add_figures(self._source, self.record, rows_copied=copied)
                self._progress(f"copying: {state.ready}/{state.tables} tables done, {copied} rows so far")
                suspects, stranded = self._stranded(suspects)
                if stranded:
                    restarts += 1
                    self._restart_copy(stranded, restarts)
                    deadline = time.monotonic() + self._settings.copy_timeout_s
                    suspects = []
            self._check_stream(deadline, "the initial copy")
            time.sleep(self._settings.poll_s)
        copied = sum(rows_in_range(self._target, self.plan).values())
        self._phase(Phase.COPIED, copy_s=round(time.monotonic() - started, 3), rows_copied=copied)

    def _subscribe(self) -> None:
        """The new owner's subscription to the move's publication, streaming from the move's slot."""
        replication.create_subscription(
            self._target,
            self.plan.object_name,
            source_conninfo=self._databases.replication_dsn(self.plan.source),
            publication=self.plan.object_name,
            slot=self.plan.object_name,
        )

    def _stranded(self, suspects: list[str]) -> tuple[list[str], list[str]]:
        """The tables PostgreSQL can no longer copy (`replication.stranded_tables`): those seen so
        now, and those seen so at the last look too (a second ago at least), which are stranded
        for good (a worker between its slot's drop and its commit looks the same for a moment)."""
        now = replication.stranded_tables(self._source, self._target, self.plan.object_name)
        return now, [t for t in now if t in suspects]

    def _restart_copy(self, stranded: list[str], restarts: int) -> None:
        """Copy the range again from nothing: drop the subscription (and the table sync slots it
        left on the old owner), delete what it copied, subscribe anew. The move's own slot stays
        where the subscriber confirmed: the new subscription's tables are copied under snapshots
        taken now, each followed from there, and the stream before them is skipped for every table
        not yet copied, as at the first copy. Refused once `copy_restarts` ran out."""
        name = self.plan.object_name
        if restarts > self._settings.copy_restarts:
            raise MoveError(
                f"the copy of {', '.join(stranded)} cannot finish (copied, then its table sync slot was "
                f"lost on {self.plan.source}), still after {restarts - 1} restart(s); abort the move, "
                "or resume it to copy again"
            )
        replication.drop_subscription_and_sync_slots(self._target, self._source, name)
        removed = self._delete_range(self._target)
        replication.release_slot(self._source, name)  # the old subscription's walsender, if still there
        total = int(self.record.figures.get("copy_restarts") or 0) + 1
        journal.add_figures(self._source, self.record, copy_restarts=total, copy_restarted_for=stranded)
        self._progress(
            f"copying again: {', '.join(stranded)} copied, then lost its table sync slot on "
            f"{self.plan.source} (PostgreSQL never copies such a table again); {removed} copied rows removed"
        )
        self._subscribe()

    def _catch_up(self) -> None:
        started = time.monotonic()
        deadline = started + self._settings.catch_up_timeout_s
        shown = 0.0
        while True:
            replication.wake_stream(self._source)
            lag = replication.slot_lag_bytes(self._source, self.plan.object_name)
            if lag is None:
                raise MoveError(f"the replication slot {self.plan.object_name} is gone; abort the move")
            # Only a connected subscriber keeps up after the fence: a small lag of one that is
            # away (reconnecting after a restart) would turn into seconds of write pause.
            streaming = replication.slot_streaming(self._source, self.plan.object_name)
            if lag <= self._settings.cutover_lag_bytes and streaming:
                break
            if time.monotonic() - shown >= 1.0:
                shown = time.monotonic()
                journal.add_figures(self._source, self.record, lag_bytes=lag)
                self._progress(
                    f"catching up: {lag} bytes behind" + ("" if streaming else ", subscriber away")
                )
            self._check_stream(deadline, "catching up")
            time.sleep(self._settings.poll_s)
        self._phase(
            Phase.CAUGHT_UP, catch_up_s=round(time.monotonic() - started, 3), lag_bytes_at_cutover=lag
        )

    def _cut_over(self) -> None:
        self._record("fence", self.plan.move_id, self.plan.source)
        raised = fences.raise_fence(self._source, self._fence)
        fenced_unix = time.time()
        started = time.monotonic()
        # Waits for the transactions running when the fence committed (by their own ids), and
        # refuses while a prepared transaction could still commit into the range.
        fences.drain(self._source, raised, timeout_s=self._settings.drain_timeout_s, end_stragglers=True)
        drained = time.monotonic()
        final = replication.current_lsn(self._source)
        if replication.probe_published(self._source, self.plan.object_name):
            # Applied after every change before `final`: the subscriber's origin then stands past it.
            replication.commit_probe(self._source, self.plan)
        deadline = drained + self._settings.final_sync_timeout_s
        while True:
            replication.wake_stream(self._source)
            lag = replication.slot_lag_bytes(self._source, self.plan.object_name, upto=final)
            if lag == 0:
                break
            if lag is None:
                raise MoveError(f"the replication slot {self.plan.object_name} is gone; abort the move")
            self._check_stream(deadline, "the final catch-up")
            time.sleep(self._settings.poll_s)
        self._phase(
            Phase.FENCED,
            fenced_at_unix=self.record.figures.get("fenced_at_unix", fenced_unix),
            drain_s=round(drained - started, 3),
            final_sync_s=round(time.monotonic() - drained, 3),
            final_lsn=final,
        )

    def _verify(self) -> None:
        started = time.monotonic()
        final = str(self.record.figures.get("final_lsn") or replication.current_lsn(self._source))
        state, still = self._still_subscriber(final)
        result = verify(self._source, self._target, self.plan, subscriber=state, subscriber_problems=still)
        if result.problems:
            failure = (
                "verification failed, the move stops here with both databases as they are (abort it to "
                "roll back): " + "; ".join(result.problems) + "; " + self._stream_report(state, final)
            )
            # In the journal too: the orchestrator's output may be gone by the time someone looks.
            journal.add_figures(self._source, self.record, verify_failed=failure)
            raise MoveError(failure)
        # What clean-up compares the old owner's rows with before it deletes them.
        journal.add_figures(
            self._source,
            self.record,
            verified_digests={t: [d.rows, str(d.checksum)] for t, d in result.source.items()},
            subscription_counters=state.counters,
            **({"verify_failed": None} if self.record.figures.get("verify_failed") else {}),
        )
        self._phase(
            Phase.VERIFIED,
            verify_s=round(time.monotonic() - started, 3),
            rows_moved={t: d.rows for t, d in result.target.items()},
        )

    def _still_subscriber(self, final: str) -> tuple[replication.SubscriberState, tuple[str, ...]]:
        """Stop the subscription once its origin has applied past `final` (bounded wait), and what
        it then says of itself: the problems that forbid the commit."""
        name = self.plan.object_name
        probe = replication.probe_published(self._source, name)
        if probe:
            replication.set_enabled(self._target, name, True)  # a resumed verification: let it finish
            deadline = time.monotonic() + self._settings.final_sync_timeout_s
            while time.monotonic() < deadline and not replication.lsn_at_least(
                self._target, replication.origin_lsn(self._target, name), final
            ):
                replication.wake_stream(self._source)
                time.sleep(self._settings.poll_s)
        running = replication.stop_subscription(self._target, name)
        state = replication.subscriber_state(self._target, name)
        problems: list[str] = []
        if not state.exists:
            return state, (f"the subscription {name} is gone: abort the move",)
        if state.enabled or running or state.workers:
            problems.append(f"the subscription is not still (workers {list(state.workers) or running})")
        expected = len(FENCED_TABLES) + probe
        if len(state.tables) != expected or any(s != "r" for s in state.tables.values()):
            problems.append(
                f"the subscription's tables are not all ready ({expected} expected): {state.tables}"
            )
        if probe and not replication.lsn_at_least(self._target, state.origin_lsn, final):
            problems.append(
                f"the subscription applied up to {state.origin_lsn}, not past the final position {final}"
            )
        # A conflict is a change PostgreSQL skipped for good (an UPDATE or DELETE whose row is
        # missing) or refused: never a verified move. An error alone (`*_error_count`: a lost
        # connection to the old owner counts as one) rolled back what it was applying, and the
        # worker started again from the origin's position: the checks above and the comparison say
        # whether anything is missing; the counts are journaled and shown with any failure.
        conflicts = {k: v for k, v in state.incidents.items() if k.startswith("confl_")}
        if conflicts:
            problems.append(f"the subscription met conflicts since it was made: {conflicts}")
        return state, tuple(problems)

    def _stream_report(self, state: replication.SubscriberState, final: str) -> str:
        """The stream's positions and counters, for a failed verification's message."""
        confirmed = self._source.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self.plan.object_name,),
        ).fetchone()
        return (
            f"stream: final position {final}, slot confirmed {confirmed[0] if confirmed else None}, "
            f"origin applied up to {state.origin_lsn}; counters {state.counters}; {state.describe()}"
        )

    def _commit(self) -> None:
        started = time.monotonic()
        p = self.plan
        replication.drop_subscription(self._target, p.object_name)
        facts = self._facts()
        try:
            current = with_facts(self._store.load(), facts)
        except ShardMapError as exc:
            raise MoveError(
                f"cannot read the shard map to commit the move (resume to try again): {exc}"
            ) from exc
        if not owns_range(current, p.source, p.first_slot, p.last_slot):
            raise MoveError(
                f"the shard map ({self._store.where}, with the databases' facts) no longer gives slots "
                f"{p.first_slot}-{p.last_slot} to {p.source}; someone changed it during the move"
            )
        # Above every version any process may hold, so every daemon's database fact overrules its map.
        version = max([current.version, *(f.map_version for f in facts)]) + 1
        fact = p.ownership(version)
        committed = with_owner(current, fact, version=version)
        journal.commit_move(
            self._source, self.record, fact, shard_map_document(committed)
        )  # the commit point
        self._progress(
            f"committed: shard map version {version} gives slots {p.first_slot}-{p.last_slot} to {p.target} "
            f"(recorded in {p.source}'s database)"
        )
        failpoints.reached(COMMITTED)  # committed, not yet handed over
        self._hand_over(fact)
        pause = time.time() - float(self.record.figures.get("fenced_at_unix", time.time()))
        journal.add_figures(self._source, self.record, write_pause_s=round(pause, 3))
        self._publish(fact)
        journal.add_figures(self._source, self.record, commit_s=round(time.monotonic() - started, 3))
        self._progress(f"handed over to {p.target} and published to {self._store.where}")
        failpoints.reached(PUBLISHED)

    def _hand_over(self, fact: RangeOwner) -> None:
        """Record the commit's fact in the new owner's database and lower its fence, in one
        transaction: from its commit the new owner's daemons serve the range, whatever map they have."""
        with self._target.transaction():
            record_owner(self._target, self.plan.move_id, fact)
            self._target.execute("DELETE FROM slot_fences WHERE move_id = %s", (self.plan.move_id,))

    def _publish(self, fact: RangeOwner) -> ShardMap:
        """Publish the committed change to the map store (compare-and-swap), unless the published map
        says it already or a later move has the range since."""
        p = self.plan

        def give_range(published: ShardMap) -> ShardMap | None:
            if published.version >= fact.map_version and owns_range(
                published, p.target, p.first_slot, p.last_slot
            ):
                return None
            if any(f.overlaps(fact) and f.map_version > fact.map_version for f in self._facts()):
                return None  # moved again since: that move publishes its own change
            return with_owner(published, fact, version=max(published.version + 1, fact.map_version))

        try:
            return self._store.publish(give_range)
        except (ShardMapError, OSError, ValueError) as exc:
            raise MoveError(
                f"the move committed (every shard daemon follows its database), but publishing the map to "
                f"{self._store.where} failed: {exc}; resume the move to publish it"
            ) from exc

    def _clean_up(self) -> None:
        started = time.monotonic()
        name = self.plan.object_name
        fact = self.record.committed_fact
        if fact is None:
            raise MoveError(
                f"move {self.plan.move_id}'s journal has no committed map version; resume cannot go on"
            )
        # Again, for a move resumed after a crash between its commit and these steps.
        self._hand_over(fact)
        self._publish(fact)
        # The old rows can go: the old owner's database says the range moved, so its daemons refuse
        # it whatever map they hold, and the new owner has every row.
        replication.drop_slot(self._source, name)
        replication.drop_publication(self._source, name)
        deleted = self._delete_range(self._source, verified=self.record.figures.get("verified_digests"))
        # The source's fence stays: it marks the range as moved out, refusing any stray write.
        self._phase(
            Phase.DONE, clean_up_s=round(time.monotonic() - started, 3), rows_deleted_at_source=deleted
        )

    def _facts(self) -> list[RangeOwner]:
        """Every ownership fact of the known shards' databases."""
        return recorded_facts(self._databases)

    # Abort.

    def abort(self) -> MoveRecord:
        """Undo a move that has not committed: every object it made, and the rows it copied."""
        if self.record.phase in (Phase.COMMITTED, Phase.DONE):
            raise MoveError(
                f"move {self.plan.move_id} has committed (the databases give the range to "
                f"{self.plan.target}); resume it instead to finish the hand-over and the clean-up"
            )
        if self.record.phase is Phase.ABORTED:
            return self.record
        name = self.plan.object_name
        replication.drop_subscription_and_sync_slots(self._target, self._source, name)
        replication.drop_slot(self._source, name)
        replication.drop_publication(self._source, name)
        # The replica identity stays FULL (migration 15), also where an older version's journal
        # lists a "replica_identity" object: nothing to undo, and no lock to take.
        removed = self._delete_range(self._target)
        for obj in self.record.has("partition", self.plan.target):
            month = next(
                (m for m in partitions.existing_partitions(self._target) if m.table == obj.name), None
            )
            if month is not None and self._is_empty(self._target, obj.name):
                partitions.drop_partition(self._target, month)
        fences.lower_fence(self._target, self.plan.move_id)
        fences.lower_fence(self._source, self.plan.move_id)
        self._phase(Phase.ABORTED, aborted_from=self.record.phase.value, rows_removed_at_target=removed)
        return self.record

    # Helpers.

    def _phase(self, phase: Phase, **figures: Any) -> None:
        journal.set_phase(self._source, self.record, phase, **figures)
        self._progress(f"{phase.value}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
        failpoints.reached(phase_failpoint(phase))  # crash tests stop here (core/failpoints.py)

    def _record(self, kind: str, name: str, shard: str) -> None:
        journal.record_object(self._source, self.record, MoveObject(kind, name, shard))

    def _check_stream(self, deadline: float, what: str) -> None:
        if time.monotonic() < deadline:
            return
        errors = replication.apply_errors(self._target, self.plan.object_name)
        hint = (
            f"; the subscription has met {errors} error(s): see {self.plan.target}'s PostgreSQL log "
            "(a row of the range the new owner already had?)"
            if errors
            else ""
        )
        states = replication.copy_state(self._target, self.plan.object_name).states
        waiting = {t: s for t, s in states.items() if s != "r"}
        tables = f" (tables not yet copied, by state: {waiting})" if waiting else ""
        raise MoveError(
            f"{what} did not finish in time{tables}{hint}; resume the move to wait longer, or abort it"
        )

    def _check_id_spaces(self) -> dict[str, list[int]]:
        """Refuse a move whose copied ids could meet ids the new owner has or will hand out.

        Since schema 9 each database draws these ids from a block of its own (`_ID_BLOCK_BITS`), and
        a row lives on one shard at a time, so an id is unique everywhere as long as: the two
        shards draw from different blocks; a moving id from the new owner's block is one it has
        handed out already (the row left it in an earlier move), never one it will hand out; and
        ids from before schema 9 (below the first block), which every shard used, are not on both.
        """
        spans: dict[str, list[int]] = {}
        for table, column in _SEQUENCES:
            s_seq = _sequence_value(self._source, table, column)
            t_seq = _sequence_value(self._target, table, column)
            block = t_seq >> _ID_BLOCK_BITS
            if s_seq >> _ID_BLOCK_BITS == block:
                raise MoveError(
                    f"{table}.{column}: {self.plan.source} and {self.plan.target} draw ids from the same "
                    f"block ({block}); move {self.plan.target}'s sequence to a free block first"
                )
            moved = _moved_ids(self._source, table, column, self.plan, block)
            if moved is None:
                continue
            if moved.from_target_block is not None and moved.from_target_block > t_seq:
                raise MoveError(
                    f"{table}.{column}: moving id {moved.from_target_block} is in {self.plan.target}'s block "
                    f"but beyond what it has handed out ({t_seq}); it could hand it out again"
                )
            if moved.legacy and _has_legacy_ids(self._target, table, column):
                raise MoveError(
                    f"{table}.{column}: rows made before schema 9 are in the range and on {self.plan.target} "
                    "too; their ids are not unique across shards, so they cannot move"
                )
            spans[table] = [moved.low, moved.high]
        return spans

    def _delete_range(self, conn: psycopg.Connection[Any], *, verified: dict[str, Any] | None = None) -> int:
        """Delete the range's rows here, as the fencing move (the one writer its fence lets in).

        With `verified` (the old owner's digests the verification compared, table -> [rows,
        checksum]), the rows are digested again in the deleting transaction's snapshot first, and
        nothing is deleted unless they are exactly what was verified: a row committed into the range
        after the verification (a writer the drain missed) was never replicated, and deleting it
        would lose it. A move verified by an older version has none: its rows go as they are.
        """
        deleted = 0
        with snapshot(conn):
            now = digests_now(conn, self.plan) if verified is not None else {}
            # Nothing left (a clean-up that crashed after its delete committed): nothing to compare.
            if verified is not None and any(d.rows for d in now.values()):
                changed = {t: (verified.get(t), [d.rows, str(d.checksum)]) for t, d in now.items()}
                changed = {t: v for t, v in changed.items() if v[0] != v[1]}
                if changed:
                    raise MoveError(
                        f"{self.plan.source}'s rows of slots {self.plan.first_slot}-{self.plan.last_slot} are not "
                        "the rows verified (table: [rows, checksum] verified, now): "
                        + "; ".join(f"{t}: {v[0]}, {v[1]}" for t, v in sorted(changed.items()))
                        + "; nothing is deleted: the new owner lacks what changed since, find it before "
                        "deleting these rows by hand"
                    )
            conn.execute("SELECT set_config('shardrouter.moving_out', %s, true)", (self.plan.move_id,))
            for table in _DELETE_ORDER:
                cur = conn.execute(
                    sql.SQL("DELETE FROM {} t WHERE {}").format(
                        sql.Identifier(table), sql.SQL(self.plan.row_filter("t.account_hash"))
                    )
                )
                deleted += cur.rowcount
        return deleted

    @staticmethod
    def _is_empty(conn: psycopg.Connection[Any], table: str) -> bool:
        row = conn.execute(
            sql.SQL("SELECT NOT EXISTS (SELECT 1 FROM {})").format(sql.Identifier(table))
        ).fetchone()
        return bool(row and row[0])


@dataclass(frozen=True)
class _MovedIds:
    """The ids of a table's moving rows: their span, the largest from a given block, and whether
    any is from before schema 9."""

    low: int
    high: int
    from_target_block: int | None
    legacy: bool


def _moved_ids(
    conn: psycopg.Connection[Any], table: str, column: str, plan: MovePlan, block: int
) -> _MovedIds | None:
    row = conn.execute(
        sql.SQL(
            "SELECT min({c}), max({c}), max({c}) FILTER (WHERE {c} >> {bits} = {block}),"
            " coalesce(bool_or({c} < {first}), false) FROM {t} t WHERE {w}"
        ).format(
            c=sql.Identifier(column),
            bits=sql.Literal(_ID_BLOCK_BITS),
            block=sql.Literal(block),
            first=sql.Literal(1 << _ID_BLOCK_BITS),
            t=sql.Identifier(table),
            w=sql.SQL(plan.row_filter("t.account_hash")),
        )
    ).fetchone()
    if row is None or row[0] is None:
        return None
    return _MovedIds(int(row[0]), int(row[1]), None if row[2] is None else int(row[2]), bool(row[3]))


def _has_legacy_ids(conn: psycopg.Connection[Any], table: str, column: str) -> bool:
    row = conn.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {t} WHERE {c} < {first})").format(
            t=sql.Identifier(table), c=sql.Identifier(column), first=sql.Literal(1 << _ID_BLOCK_BITS)
        )
    ).fetchone()
    return bool(row and row[0])


def _sequence_value(conn: psycopg.Connection[Any], table: str, column: str) -> int:
    row = conn.execute(
        "SELECT coalesce(s.last_value, 0) FROM pg_sequences s"
        " WHERE format('%%I.%%I', s.schemaname, s.sequencename)::regclass = pg_get_serial_sequence(%s, %s)::regclass",
        (table, column),
    ).fetchone()
    if row is None:
        raise MoveError(f"{table}.{column} has no sequence")
    return int(row[0])


def find_move(databases: ShardDatabases, move_id: str) -> MoveRecord:
    """A journaled move, looked up in every shard's database."""
    for dsn in databases.dsns.values():
        with _connect(dsn) as conn:
            record = journal.load_move(conn, move_id)
            if record is not None:
                return record
    raise MoveError(f"no move {move_id!r} is journaled in any shard's database")


def list_moves(databases: ShardDatabases, *, active_only: bool = False) -> list[MoveRecord]:
    """Every journaled move of every shard."""
    found: list[MoveRecord] = []
    for dsn in databases.dsns.values():
        with _connect(dsn) as conn:
            moves = journal.all_moves(conn)
        found.extend(m for m in moves if not active_only or m.phase in ACTIVE_PHASES)
    return found


__all__ = [
    "COMMITTED",
    "PUBLISHED",
    "START_CHECKED",
    "Move",
    "MoveSettings",
    "ShardDatabases",
    "current_map",
    "find_move",
    "list_moves",
    "phase_failpoint",
    "recorded_facts",
    "start_move",
]
