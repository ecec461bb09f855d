"""The shard daemon's Prometheus metrics: call outcomes from the idempotency interceptor, and the
state of the key table, the retention job and the outbox read from the database.

Metric names (deploy manifests and alerts use them; docs/tracing.md has the PromQL):

- `shardd_requests_total{method,outcome}` and `shardd_handler_duration_seconds{method,outcome}`:
  every guarded call; `outcome` is new | replay | in_progress_conflict | key_reused | expired |
  invalid | error; `method` the short name ("Transfer"). Replay and conflict rates derive from these.
- `shardd_key_reuse_total`: calls that reused a key for a different request (a caller bug).
- `shardd_idempotency_records{partition}`, `shardd_idempotency_partition_bytes{partition}`: planner
  row estimate and on-disk size of each monthly partition (`idempotency_record_YYYY_MM`).
- `shardd_idempotency_oldest_partition_age_seconds`: now minus the start of the oldest partition.
- `shardd_retention_lag_seconds`: how long the oldest partition has been wholly past retention
  (droppable but not dropped); 0 while retention keeps up.
- `shardd_retention_last_success_timestamp_seconds`: end of the last recorded retention run
  (absent until the first run).
- `shardd_outbox_backlog`, `shardd_outbox_oldest_age_seconds`: undelivered cross-shard credits.

The database gauges come from a snapshot a background thread refreshes (every 15 s by default)
with short read-only queries on the daemon's own pool; a scrape never touches the database.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shardd import partitions
from shardd.db import Database
from shardd.idempotency.interceptor import CallOutcome
from shardd.ledger import store as ledger_store

log = logging.getLogger(__name__)

#: Latency buckets (seconds) for guarded calls: a replay takes a millisecond, a contended transfer more.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COLLECT_INTERVAL_S = 15.0
#: No metrics query may run longer than this (it shares the pool with the traffic).
QUERY_TIMEOUT_MS = 2000


class ShardMetrics:
    """The daemon's metric registry; `observe` is the idempotency interceptor's outcome listener."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "shardd_requests",
            "Guarded (mutating) calls by method and idempotency outcome.",
            ["method", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "shardd_handler_duration_seconds",
            "Time to answer a guarded call (claim, handler, stored outcome, commit).",
            ["method", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.key_reuse = Counter(
            "shardd_key_reuse",
            "Calls that reused an idempotency key for a different request.",
            registry=self.registry,
        )
        self.collector_errors = Counter(
            "shardd_metrics_collector_errors",
            "Failed refreshes of the database gauges (the gauges keep their last values).",
            registry=self.registry,
        )

    def observe(self, outcome: CallOutcome) -> None:
        """Count one guarded call (an `OutcomeListener` for `start_shard(listeners=...)`)."""
        method = outcome.method.rsplit("/", 1)[-1]
        self.requests.labels(method, outcome.outcome).inc()
        self.duration.labels(method, outcome.outcome).observe(outcome.duration_s)
        if outcome.outcome == "key_reused":
            self.key_reuse.inc()

    __call__ = observe


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


class ShardStateCollector(Collector):
    """Keeps the latest `ShardState` and exposes it as gauges; `start()` refreshes it periodically."""

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
            metrics.registry.register(self)

    @property
    def state(self) -> ShardState | None:
        """The latest snapshot (None before the first successful refresh)."""
        return self._state

    def refresh(self) -> bool:
        """Read the database now; False (and the old snapshot kept) if that failed."""
        try:
            self._state = read_state(self._db)
        except Exception as exc:
            log.warning("metrics: reading the shard's state failed: %s", exc)
            if self._metrics is not None:
                self._metrics.collector_errors.inc()
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

    def describe(self) -> Iterable[GaugeMetricFamily]:
        """No fixed description (the series depend on the partitions); avoids a collect at register."""
        return ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges of the latest snapshot."""
        state = self._state
        if state is None:
            return
        records = GaugeMetricFamily(
            "shardd_idempotency_records",
            "Estimated rows (planner statistics) of each idempotency_record partition.",
            labels=["partition"],
        )
        size = GaugeMetricFamily(
            "shardd_idempotency_partition_bytes",
            "On-disk size of each idempotency_record partition, indexes and TOAST included.",
            labels=["partition"],
        )
        for part in state.partitions:
            records.add_metric([part.month.table], part.rows)
            size.add_metric([part.month.table], part.bytes)
        yield records
        yield size
        if state.partitions:
            age = (state.taken_at - state.partitions[0].month.start()).total_seconds()
            yield GaugeMetricFamily(
                "shardd_idempotency_oldest_partition_age_seconds",
                "Age of the start of the oldest idempotency_record partition.",
                value=age,
            )
        yield GaugeMetricFamily(
            "shardd_retention_lag_seconds",
            "How long the oldest partition has been wholly past retention without being dropped (0: on time).",
            value=retention_lag_s(state, self._retention),
        )
        if state.last_retention is not None:
            yield GaugeMetricFamily(
                "shardd_retention_last_success_timestamp_seconds",
                "Unix time the last retention run finished.",
                value=state.last_retention.timestamp(),
            )
        yield GaugeMetricFamily(
            "shardd_outbox_backlog", "Cross-shard credits not yet delivered.", value=state.outbox_backlog
        )
        yield GaugeMetricFamily(
            "shardd_outbox_oldest_age_seconds",
            "Age of the oldest undelivered cross-shard credit (0: none).",
            value=state.outbox_oldest_age_s,
        )


__all__ = ["ShardMetrics", "ShardState", "ShardStateCollector", "read_state", "retention_lag_s"]
