"""The shard daemon's metrics, as OpenTelemetry instruments: call outcomes from the idempotency
interceptor, and the state of the key table, the retention job and the outbox read from the database.

Each daemon has its own `MeterProvider` and Prometheus registry (`shardrouter.core.metrics`), served at
/metrics. Exposed names (deploy manifests and alerts use them; docs/tracing.md has the PromQL):

- `shardd_requests_total{method,outcome}` and `shardd_handler_duration_seconds{method,outcome}`:
  every guarded call; `outcome` is new | replay | in_flight | key_reused | expired |
  invalid | shed | error; `method` the short name ("Transfer"). Replay and conflict rates derive from these.
- `shardd_key_reuse_total`: calls that reused a key for a different request (a caller bug).
- `shardd_idempotency_records{partition}`, `shardd_idempotency_partition_bytes{partition}`: planner
  row estimate and on-disk size of each monthly partition (`idempotency_record_YYYY_MM`).
- `shardd_idempotency_oldest_partition_age_seconds`: now minus the start of the oldest partition.
- `shardd_retention_lag_seconds`: how long the oldest partition has been wholly past retention
  (droppable but not dropped); 0 while retention keeps up.
- `shardd_retention_last_success_timestamp_seconds`: end of the last recorded retention run
  (absent until the first run).
- `shardd_outbox_backlog`, `shardd_outbox_oldest_age_seconds`: undelivered cross-shard credits.
- `shardd_metrics_collector_errors_total`: failed refreshes of the database gauges.
- `shardd_authz_decisions_total{method,outcome}`: calls decided by the authorization policy
  (`shardd/authorization.py`); `outcome` is allowed | denied.
- `shardd_authz_policy_reloads_total{result}`: loads of the policy file; `result` is loaded | refused
  (a bad new file: the last good policy stays).
- `shardd_authz_policy_info{name,hash}`: 1 for the policy in force (its name and the first 16 hex
  digits of its file's SHA-256).

Moves of slot ranges (`shard-router reshard`), from the `slot_moves` journal, which only the
old owner's database holds; each series is of a move that is not done or aborted, or of the one that
finished last (the label sets stay few however many moves a shard has seen):

- `shardd_slot_move_active{move_id,first_slot,last_slot,target,phase}`: 1 per active move; `phase`
  is the last one it reached (the step after it is under way), so a series lasts as long as a phase.
- `shardd_slot_move_phase_rank{move_id}`: that phase's place in `MOVE_PHASES` (0 planned .. 7 done,
  8 aborted).
- `shardd_slot_move_rows_copied{move_id}`: rows on the new owner after the initial copy (so far).
- `shardd_slot_move_lag_bytes{move_id}`: WAL between now and what the new owner confirmed, read
  live from the move's replication slot here (absent while there is no slot).
- `shardd_slot_move_write_pause_seconds{move_id}`: how long the range took no writes (fence to map),
  once the move has committed.
- `shardd_slot_fences{kind}`: fences in this database; `kind` is `incoming` (a move into this shard:
  lowered when it commits), `outgoing` (a move out of it, cutting over), `moved_out` (the lasting
  marker of a range that left) or `stale` (its move was aborted, yet the fence stayed).

The database gauges are observable gauges whose callbacks read the snapshot a background thread
refreshes (every 15 s by default) with short read-only queries on the daemon's own pool; a scrape
never touches the database. The refresh is never traced (`tracing.untraced()`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.export import MetricReader
from prometheus_client import CollectorRegistry

from shardrouter.core import tracing
from shardrouter.core.metrics import new_metrics_pipeline
from shardrouter.core.moves import FINISHED_PHASES, Phase
from shardrouter.shardd import partitions
from shardrouter.shardd.authorization_policy import AuthzPolicy
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency.outcomes import CallOutcome, OutcomeKind
from shardrouter.shardd.idempotency.waiting import KeyWaits, WaitEnd
from shardrouter.shardd.ledger import store as ledger_store

log = logging.getLogger(__name__)

#: Latency buckets (seconds) for guarded calls: a replay takes a millisecond, a contended transfer more.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COLLECT_INTERVAL_S = 15.0
#: No metrics query may run longer than this (it shares the pool with the traffic).
QUERY_TIMEOUT_MS = 2000
#: A move's phases in order, as its journal names them (`core.moves.Phase`). The rank gauge is the index.
MOVE_PHASES = tuple(phase.value for phase in Phase)
#: A move in one of these phases holds nothing any more.
FINISHED_MOVE_PHASES = frozenset(phase.value for phase in FINISHED_PHASES)
#: What a fence in this database is, by the journal of the move that raised it.
FENCE_KINDS = ("incoming", "outgoing", "moved_out", "stale")


if TYPE_CHECKING:
    from shardrouter.shardd.ownership import ShardLocator


class ShardMetrics:
    """The daemon's instruments and registry; `observe` is the idempotency interceptor's outcome listener."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, readers: Sequence[MetricReader] = ()
    ) -> None:
        self.pipeline = new_metrics_pipeline(registry, readers=readers)
        self.registry = self.pipeline.registry
        self.meter: Meter = self.pipeline.meter(__name__)
        self.requests = self.meter.create_counter(
            "shardd_requests",
            unit="{call}",
            description="Guarded (mutating) calls by method and idempotency outcome.",
        )
        self.duration = self.meter.create_histogram(
            "shardd_handler_duration_seconds",
            unit="s",
            description="Time to answer a guarded call (claim, handler, stored outcome, commit).",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.key_reuse = self.meter.create_counter(
            "shardd_key_reuse",
            unit="{call}",
            description="Calls that reused an idempotency key for a different request.",
        )
        self.collector_errors = self.meter.create_counter(
            "shardd_metrics_collector_errors",
            unit="{refresh}",
            description="Failed refreshes of the database gauges (the gauges keep their last values).",
        )
        self.authz_decisions = self.meter.create_counter(
            "shardd_authz_decisions",
            unit="{call}",
            description="Calls decided by the authorization policy, by method and outcome (allowed, denied).",
        )
        self.authz_reloads = self.meter.create_counter(
            "shardd_authz_policy_reloads",
            unit="{load}",
            description="Loads of the authorization policy file by result (loaded, refused: the last good stays).",
        )
        self._policy_labels: dict[str, str] | None = None
        self.meter.create_observable_gauge(
            "shardd_authz_policy_info",
            callbacks=[self._policy_info],
            description="1 for the authorization policy in force, labelled with its name and file hash.",
        )
        # An OpenTelemetry counter has no series until its first add; these unlabelled ones are
        # alerted on with increase(), which needs the 0 sample from the start.
        self.key_reuse.add(0)
        self.collector_errors.add(0)

    def observe(self, outcome: CallOutcome) -> None:
        """Count one guarded call (an `OutcomeListener` for `start_shard(listeners=...)`)."""
        labels = {"method": outcome.method.rsplit("/", 1)[-1], "outcome": outcome.outcome.value}
        self.requests.add(1, labels)
        self.duration.record(outcome.duration_s, labels)
        if outcome.outcome is OutcomeKind.KEY_REUSED:
            self.key_reuse.add(1)

    __call__ = observe

    def observe_authz(self, method: str, allowed: bool) -> None:
        """Count one call the authorization policy decided (`method`: the short name)."""
        self.authz_decisions.add(1, {"method": method, "outcome": "allowed" if allowed else "denied"})

    def observe_policy(self, result: str, policy: AuthzPolicy) -> None:
        """Count one load of the policy file; `policy` is the one in force after it."""
        self.authz_reloads.add(1, {"result": result})
        self._policy_labels = {"name": policy.name, "hash": policy.digest}

    def _policy_info(self, _options: CallbackOptions) -> Iterable[Observation]:
        labels = self._policy_labels
        return () if labels is None else (Observation(1, labels),)

    def follow_ownership(self, locator: ShardLocator) -> None:
        """Export which map this process follows, and whether its database says more than that map."""

        def version(_options: CallbackOptions) -> Iterable[Observation]:
            shard_map = locator.shard_map
            return () if shard_map is None else (Observation(shard_map.version),)

        def refused(_options: CallbackOptions) -> Iterable[Observation]:
            return (Observation(locator.maps_refused),)

        def overrides(_options: CallbackOptions) -> Iterable[Observation]:
            return (Observation(locator.overrides()),)

        self.meter.create_observable_gauge(
            "shardd_shard_map_version",
            callbacks=[version],
            description="Version of the shard map this process follows (processes should agree).",
        )
        self.meter.create_observable_counter(
            "shardd_shard_map_refused",
            callbacks=[refused],
            description="Shard maps refused for a version older than the one in force (a stale copy was offered).",
        )
        self.meter.create_observable_gauge(
            "shardd_ownership_overrides",
            callbacks=[overrides],
            description=(
                "Slot ranges this shard's database gives another owner than the process's map does: "
                "the map is behind the databases (publish the newest map)."
            ),
        )

    def follow_key_waits(self, waits: KeyWaits) -> None:
        """Export how many duplicates waited for their original, and how their waits ended."""

        def started(_options: CallbackOptions) -> Iterable[Observation]:
            return (Observation(waits.waits),)

        def ended(_options: CallbackOptions) -> Iterable[Observation]:
            return tuple(Observation(waits.ends[end], {"end": end.value}) for end in WaitEnd)

        self.meter.create_observable_counter(
            "shardd_duplicate_waits",
            callbacks=[started],
            description="Duplicates of a key in flight that asked to wait for its original, and waited.",
        )
        self.meter.create_observable_counter(
            "shardd_duplicate_wait_ends",
            callbacks=[ended],
            description=(
                "How those waits ended: replayed (the original committed), ran_itself (it ended without "
                "an outcome), bound_reached (answered in flight), refused (any other answer)."
            ),
        )

    def shutdown(self) -> None:
        """Stop the provider; the registry stops exposing the instruments (idempotent)."""
        self.pipeline.shutdown()


@dataclass(frozen=True)
class MoveState:
    """A journaled move out of this shard, as its gauges show it."""

    move_id: str
    first_slot: int
    last_slot: int
    target: str
    phase: str
    rows_copied: int | None
    write_pause_s: float | None
    #: None while the move has no replication slot here (not made yet, or dropped).
    lag_bytes: int | None

    @property
    def active(self) -> bool:
        """Neither done nor aborted."""
        return self.phase not in FINISHED_MOVE_PHASES


@dataclass(frozen=True)
class ShardState:
    """What the database said at one moment."""

    taken_at: datetime
    partitions: tuple[partitions.PartitionInfo, ...]
    last_retention: datetime | None
    outbox_backlog: int
    outbox_oldest_age_s: float
    #: Credits dead-lettered here (refused for good by their destination), all time.
    dead_letters: int = 0
    #: Of those, the ones whose refund has not completed yet, and the age of the oldest (s).
    dead_letters_unrefunded: int = 0
    dead_letter_oldest_unrefunded_age_s: float = 0.0
    #: The active moves out of this shard, then the one that finished last, oldest first.
    moves: tuple[MoveState, ...] = ()
    #: Fences in this database by kind (`FENCE_KINDS`).
    fences: dict[str, int] = field(default_factory=dict)


# The active moves and the last finished one; a handful of rows of a table with one row per move
# ever made. The lag is the slot's, whose name the journal lists before the slot is made.
_MOVES_SQL = """
    WITH shown AS (
        SELECT * FROM slot_moves WHERE phase NOT IN ('done', 'aborted')
        UNION ALL
        (SELECT * FROM slot_moves WHERE phase IN ('done', 'aborted') ORDER BY updated_at DESC LIMIT 1)
    )
    SELECT m.move_id, m.first_slot, m.last_slot, m.target_shard_id, m.phase,
           m.figures -> 'rows_copied', m.figures -> 'write_pause_s',
           (SELECT max(greatest(0, pg_current_wal_lsn() - s.confirmed_flush_lsn))::bigint
              FROM pg_replication_slots s
             WHERE s.database = current_database()
               AND s.slot_name IN (SELECT o ->> 'name' FROM jsonb_array_elements(m.objects) o
                                    WHERE o ->> 'kind' = 'slot'))
      FROM shown m
     ORDER BY m.created_at
"""

# A fence whose move is not journaled here was raised by a move into this shard (the journal is
# in the old owner's database); one journaled here, by a move out of it.
_FENCES_SQL = """
    SELECT CASE WHEN m.move_id IS NULL THEN 'incoming'
                WHEN m.phase = 'done' THEN 'moved_out'
                WHEN m.phase = 'aborted' THEN 'stale'
                ELSE 'outgoing' END,
           count(*)
      FROM slot_fences f LEFT JOIN slot_moves m ON m.move_id = f.move_id
     GROUP BY 1
"""


def _figure_int(value: object) -> int | None:
    """A journal figure that should be a count (None when absent or not a number)."""
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _figure_float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_moves(conn: psycopg.Connection[Any]) -> tuple[MoveState, ...]:
    """The moves out of this shard the gauges show: the active ones and the last finished one."""
    return tuple(
        MoveState(
            move_id=str(move_id),
            first_slot=int(first),
            last_slot=int(last),
            target=str(target),
            phase=str(phase),
            rows_copied=_figure_int(rows),
            write_pause_s=_figure_float(pause),
            lag_bytes=None if lag is None else int(lag),
        )
        for move_id, first, last, target, phase, rows, pause, lag in conn.execute(_MOVES_SQL).fetchall()
    )


def read_fences(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """How many fences this database holds, by kind (every kind, 0 included)."""
    counts = dict.fromkeys(FENCE_KINDS, 0)
    for kind, n in conn.execute(_FENCES_SQL).fetchall():
        counts[str(kind)] = int(n)
    return counts


def read_state(database: Database, *, now: datetime | None = None) -> ShardState:
    """Read partition sizes, the last retention run, the outbox backlog, moves and fences (one
    read-only transaction)."""
    with database.read() as conn:
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{QUERY_TIMEOUT_MS}ms",))
        sizes = partitions.partition_sizes(conn)
        row = conn.execute("SELECT max(finished_at) FROM retention_runs").fetchone()
        backlog, oldest = ledger_store.outbox_backlog(conn)
        dead_letters, unrefunded, unrefunded_age = ledger_store.dead_letter_counts(conn)
        moves = read_moves(conn)
        fence_counts = read_fences(conn)
    last = row[0] if row is not None else None
    return ShardState(
        taken_at=now or datetime.now(UTC),
        partitions=tuple(sizes),
        last_retention=last,
        outbox_backlog=backlog,
        outbox_oldest_age_s=oldest,
        dead_letters=dead_letters,
        dead_letters_unrefunded=unrefunded,
        dead_letter_oldest_unrefunded_age_s=unrefunded_age,
        moves=moves,
        fences=fence_counts,
    )


def retention_lag_s(state: ShardState, retention: timedelta) -> float:
    """How long the oldest partition has been wholly older than the retention window (0: on time)."""
    if not state.partitions:
        return 0.0
    oldest = state.partitions[0].month
    droppable_since = oldest.end() + retention
    return max(0.0, (state.taken_at - droppable_since).total_seconds())


#: Reads the gauge values out of a snapshot.
StateReader = Callable[[ShardState], Iterable[Observation]]


def _partition_rows(state: ShardState) -> Iterable[Observation]:
    return [Observation(p.rows, {"partition": p.month.table}) for p in state.partitions]


def _partition_bytes(state: ShardState) -> Iterable[Observation]:
    return [Observation(p.bytes, {"partition": p.month.table}) for p in state.partitions]


def _oldest_partition_age(state: ShardState) -> Iterable[Observation]:
    if not state.partitions:
        return []
    return [Observation((state.taken_at - state.partitions[0].month.start()).total_seconds())]


def _last_retention(state: ShardState) -> Iterable[Observation]:
    # Absent (not 0) before the first run: `time() - metric` would otherwise page at once.
    return [] if state.last_retention is None else [Observation(state.last_retention.timestamp())]


def _outbox_backlog(state: ShardState) -> Iterable[Observation]:
    return [Observation(state.outbox_backlog)]


def _outbox_oldest_age(state: ShardState) -> Iterable[Observation]:
    return [Observation(state.outbox_oldest_age_s)]


def _dead_letters(state: ShardState) -> Iterable[Observation]:
    refunded = state.dead_letters - state.dead_letters_unrefunded
    return [
        Observation(refunded, {"refund": "done"}),
        Observation(state.dead_letters_unrefunded, {"refund": "pending"}),
    ]


def _dead_letter_oldest_unrefunded_age(state: ShardState) -> Iterable[Observation]:
    return [Observation(state.dead_letter_oldest_unrefunded_age_s)]


def _moves_active(state: ShardState) -> Iterable[Observation]:
    return [
        Observation(
            1,
            {
                "move_id": m.move_id,
                "first_slot": str(m.first_slot),
                "last_slot": str(m.last_slot),
                "target": m.target,
                "phase": m.phase,
            },
        )
        for m in state.moves
        if m.active
    ]


def _moves_phase_rank(state: ShardState) -> Iterable[Observation]:
    # A phase this version does not know (a newer reshard tool) has no rank to show.
    return [
        Observation(MOVE_PHASES.index(m.phase), {"move_id": m.move_id})
        for m in state.moves
        if m.phase in MOVE_PHASES
    ]


def _moves_rows_copied(state: ShardState) -> Iterable[Observation]:
    return [
        Observation(m.rows_copied, {"move_id": m.move_id}) for m in state.moves if m.rows_copied is not None
    ]


def _moves_lag(state: ShardState) -> Iterable[Observation]:
    return [Observation(m.lag_bytes, {"move_id": m.move_id}) for m in state.moves if m.lag_bytes is not None]


def _moves_write_pause(state: ShardState) -> Iterable[Observation]:
    return [
        Observation(m.write_pause_s, {"move_id": m.move_id})
        for m in state.moves
        if m.write_pause_s is not None
    ]


def _fences(state: ShardState) -> Iterable[Observation]:
    return [Observation(n, {"kind": kind}) for kind, n in state.fences.items()]


class _Gauge(NamedTuple):
    """One gauge read out of the shard's state snapshot."""

    name: str
    unit: str
    description: str
    read: StateReader


#: The gauges whose value is the snapshot alone (the retention lag also needs the retention window).
_STATE_GAUGES: tuple[_Gauge, ...] = (
    _Gauge(
        "shardd_idempotency_records",
        "{row}",
        "Estimated rows (planner statistics) of each idempotency_record partition.",
        _partition_rows,
    ),
    _Gauge(
        "shardd_idempotency_partition_bytes",
        "By",
        "On-disk size of each idempotency_record partition, indexes and TOAST included.",
        _partition_bytes,
    ),
    _Gauge(
        "shardd_idempotency_oldest_partition_age_seconds",
        "s",
        "Age of the start of the oldest idempotency_record partition.",
        _oldest_partition_age,
    ),
    _Gauge(
        "shardd_retention_last_success_timestamp_seconds",
        "s",
        "Unix time the last retention run finished.",
        _last_retention,
    ),
    _Gauge("shardd_outbox_backlog", "{credit}", "Cross-shard credits not yet delivered.", _outbox_backlog),
    _Gauge(
        "shardd_outbox_oldest_age_seconds",
        "s",
        "Age of the oldest undelivered cross-shard credit (0: none).",
        _outbox_oldest_age,
    ),
    _Gauge(
        "shardd_dead_letters",
        "{credit}",
        "Cross-shard credits dead-lettered here (refused for good by their destination), by whether"
        " their refund to the source account is done or pending.",
        _dead_letters,
    ),
    _Gauge(
        "shardd_dead_letter_oldest_unrefunded_age_seconds",
        "s",
        "Age of the oldest dead letter whose refund has not completed (0: none).",
        _dead_letter_oldest_unrefunded_age,
    ),
    _Gauge(
        "shardd_slot_move_active",
        "{move}",
        "1 for each move out of this shard that is neither done nor aborted, by the phase it reached.",
        _moves_active,
    ),
    _Gauge(
        "shardd_slot_move_phase_rank",
        "",
        "Place of a move's phase in the order planned(0) .. done(7), aborted(8).",
        _moves_phase_rank,
    ),
    _Gauge(
        "shardd_slot_move_rows_copied",
        "{row}",
        "Rows of the moving range on the new owner after the initial copy (so far).",
        _moves_rows_copied,
    ),
    _Gauge(
        "shardd_slot_move_lag_bytes",
        "By",
        "WAL the new owner has not yet confirmed from this move's replication slot.",
        _moves_lag,
    ),
    _Gauge(
        "shardd_slot_move_write_pause_seconds",
        "s",
        "How long a committed move kept its range from taking writes (fence to shard map).",
        _moves_write_pause,
    ),
    _Gauge(
        "shardd_slot_fences",
        "{fence}",
        "Slot fences in this database by kind: incoming, outgoing, moved_out, stale.",
        _fences,
    ),
)


class ShardStateCollector:
    """Keeps the latest `ShardState` and exposes it as gauges; `start()` refreshes it periodically.

    With `metrics`, the gauges are observable gauges on its meter, and `stop()` also shuts the
    metrics down: the daemon stops its collector when it stops, and nothing reads its metrics after.
    """

    def __init__(
        self,
        database: Database,
        *,
        retention: timedelta,
        metrics: ShardMetrics | None = None,
        interval_s: float = COLLECT_INTERVAL_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._db = database
        self._retention = retention
        self._metrics = metrics
        self._interval_s = interval_s
        self._state: ShardState | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if metrics is not None:
            self._register_gauges(metrics.meter)

    @property
    def state(self) -> ShardState | None:
        """The latest snapshot (None before the first successful refresh)."""
        return self._state

    def refresh(self) -> bool:
        """Read the database now; False (and the old snapshot kept) if that failed."""
        try:
            # A metrics refresh is bookkeeping, not work: traced, it would make a root span per
            # statement every interval, in every daemon.
            with tracing.untraced():
                self._state = read_state(self._db)
        except Exception as exc:
            log.warning("metrics: reading the shard's state failed: %s", exc)
            if self._metrics is not None:
                self._metrics.collector_errors.add(1)
            return False
        return True

    def start(self) -> None:
        """Refresh now, then every `interval_s` in a daemon thread."""
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="shardd-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the refresh thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.refresh()

    def _retention_lag(self, state: ShardState) -> Iterable[Observation]:
        return [Observation(retention_lag_s(state, self._retention))]

    def _observer(self, read: StateReader) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A gauge callback: `read` applied to the latest snapshot, nothing before the first one."""

        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            state = self._state  # one read: the refresh thread may swap it meanwhile
            return () if state is None else read(state)

        return callback

    def _register_gauges(self, meter: Meter) -> None:
        gauges = [
            *_STATE_GAUGES,
            _Gauge(
                "shardd_retention_lag_seconds",
                "s",
                "How long the oldest partition has been wholly past retention without being dropped (0: on time).",
                self._retention_lag,
            ),
        ]
        for gauge in gauges:
            meter.create_observable_gauge(
                gauge.name,
                callbacks=[self._observer(gauge.read)],
                unit=gauge.unit,
                description=gauge.description,
            )


__all__ = [
    "FENCE_KINDS",
    "FINISHED_MOVE_PHASES",
    "MOVE_PHASES",
    "MoveState",
    "ShardMetrics",
    "ShardState",
    "ShardStateCollector",
    "read_fences",
    "read_moves",
    "read_state",
    "retention_lag_s",
]
