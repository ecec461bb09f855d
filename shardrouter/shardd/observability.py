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

The database gauges are observable gauges whose callbacks read the snapshot a background thread
refreshes (every 15 s by default) with short read-only queries on the daemon's own pool; a scrape
never touches the database. The refresh is never traced (`tracing.untraced()`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.export import MetricReader
from prometheus_client import CollectorRegistry

from shardrouter.core import tracing
from shardrouter.core.metrics import new_metrics_pipeline
from shardrouter.shardd import partitions
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency.outcomes import CallOutcome, OutcomeKind
from shardrouter.shardd.ledger import store as ledger_store

log = logging.getLogger(__name__)

#: Latency buckets (seconds) for guarded calls: a replay takes a millisecond, a contended transfer more.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COLLECT_INTERVAL_S = 15.0
#: No metrics query may run longer than this (it shares the pool with the traffic).
QUERY_TIMEOUT_MS = 2000


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

    def shutdown(self) -> None:
        """Stop the provider; the registry stops exposing the instruments (idempotent)."""
        self.pipeline.shutdown()


@dataclass(frozen=True)
class ShardState:
    """What the database said at one moment."""

    taken_at: datetime
    partitions: tuple[partitions.PartitionInfo, ...]
    last_retention: datetime | None
    outbox_backlog: int
    outbox_oldest_age_s: float


def read_state(database: Database, *, now: datetime | None = None) -> ShardState:
    """Read partition sizes, the last retention run and the outbox backlog (one read-only transaction)."""
    with database.read() as conn:
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{QUERY_TIMEOUT_MS}ms",))
        sizes = partitions.partition_sizes(conn)
        row = conn.execute("SELECT max(finished_at) FROM retention_runs").fetchone()
        backlog, oldest = ledger_store.outbox_backlog(conn)
    last = row[0] if row is not None else None
    return ShardState(
        taken_at=now or datetime.now(UTC),
        partitions=tuple(sizes),
        last_retention=last,
        outbox_backlog=backlog,
        outbox_oldest_age_s=oldest,
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
        gauges: list[tuple[str, str, str, StateReader]] = [
            (
                "shardd_idempotency_records",
                "{row}",
                "Estimated rows (planner statistics) of each idempotency_record partition.",
                _partition_rows,
            ),
            (
                "shardd_idempotency_partition_bytes",
                "By",
                "On-disk size of each idempotency_record partition, indexes and TOAST included.",
                _partition_bytes,
            ),
            (
                "shardd_idempotency_oldest_partition_age_seconds",
                "s",
                "Age of the start of the oldest idempotency_record partition.",
                _oldest_partition_age,
            ),
            (
                "shardd_retention_lag_seconds",
                "s",
                "How long the oldest partition has been wholly past retention without being dropped (0: on time).",
                self._retention_lag,
            ),
            (
                "shardd_retention_last_success_timestamp_seconds",
                "s",
                "Unix time the last retention run finished.",
                _last_retention,
            ),
            ("shardd_outbox_backlog", "{credit}", "Cross-shard credits not yet delivered.", _outbox_backlog),
            (
                "shardd_outbox_oldest_age_seconds",
                "s",
                "Age of the oldest undelivered cross-shard credit (0: none).",
                _outbox_oldest_age,
            ),
        ]
        for name, unit, description, read in gauges:
            meter.create_observable_gauge(
                name, callbacks=[self._observer(read)], unit=unit, description=description
            )


__all__ = ["ShardMetrics", "ShardState", "ShardStateCollector", "read_state", "retention_lag_s"]
