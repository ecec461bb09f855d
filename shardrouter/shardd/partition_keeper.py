"""The partition keeper: a daemon thread that keeps `idempotency_record` partitions ahead of the clock.

Why it exists: partitions used to be created only at start-up (`prepare_database`, MONTHS_AHEAD months
past the current one) and by the retention CronJob. A daemon that runs for months without that
CronJob (not deployed, suspended, failing) walks into a month with no partition; since there is
deliberately no DEFAULT partition, every claim then fails with "no partition of relation found for
row" and callers get INTERNAL. The keeper removes that dependency: each daemon ensures, at start and
then every `interval_s`, that the months a live key may need exist.

It reuses `partitions.ensure_partitions`, so the DDL, its short lock waits and the advisory lock that
serializes concurrent creators (other replicas, the retention job) are the same as everywhere else,
and so is the replica identity: each month gets REPLICA IDENTITY FULL before it is attached (as
migration 15 gave the months that existed), so a slot range move never has to alter a partition.
It uses its own short-lived autocommit connection rather than the request pool: DDL needs autocommit,
and an hourly connect is cheaper than holding a pooled connection away from calls.

Tracing (when on): the hourly check of which months exist runs untraced; only a tick that has a
month to create makes a span, `partitions.ensure`, with its DDL statements beneath it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import psycopg
from opentelemetry.trace import TracerProvider

from shardrouter.core import tracing
from shardrouter.shardd import partitions
from shardrouter.shardd.db import trace_connection

log = logging.getLogger(__name__)

#: Default seconds between two checks. Partitions exist months ahead, so hourly is ample.
DEFAULT_INTERVAL_S = 3600.0
#: libpq connect timeout (s): an unreachable database fails the tick instead of hanging it.
CONNECT_TIMEOUT_S = 5
#: How long `stop()` waits for a tick in progress; the thread is a daemon thread either way.
STOP_JOIN_TIMEOUT_S = 5.0

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The real clock."""
    return datetime.now(UTC)


class PartitionKeeper:
    """Ensures the partitions of the current month (and of the retention window) and `months_ahead`."""

    def __init__(
        self,
        dsn: str,
        *,
        retention: timedelta,
        months_ahead: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Clock = utc_now,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """`tracer_provider`: where a creating tick's span goes (default: the global provider)."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        if months_ahead < 0:
            raise ValueError("months_ahead must not be negative")
        self._dsn = dsn
        self._retention = retention
        self._months_ahead = months_ahead
        self._interval_s = interval_s
        self._clock = clock
        self._tracer_provider = tracer_provider
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Ticks that succeeded / failed so far (for tests and debugging; written by one thread only).
        self.ticks_ok = 0
        self.ticks_failed = 0

    @property
    def running(self) -> bool:
        """Whether the keeper thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def tick(self) -> list[partitions.Month] | None:
        """Ensure the partitions now: the months created, or None if it failed (logged, not raised).

        Never raises: a failed tick must not end the thread, and the next tick retries it all.
        """
        try:
            created = self._ensure()
        except Exception as exc:
            self.ticks_failed += 1
            log.warning(
                "partition keeper: ensuring partitions failed; retrying in %.0f s: %s",
                self._interval_s,
                exc,
                # A database error explains itself; anything else is a bug and needs its traceback.
                exc_info=not isinstance(exc, psycopg.Error),
            )
            return None
        self.ticks_ok += 1
        if created:
            log.info("partition keeper: created %s", ", ".join(m.table for m in created))
        return created

    def start(self) -> None:
        """Tick now (in the thread, so start-up does not wait on the database), then every interval."""
        if self._thread is not None:
            raise RuntimeError("partition keeper already started")
        self._thread = threading.Thread(target=self._run, name="shardd-partition-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread: the wait between ticks ends at once; a tick in progress is waited for briefly."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning(
                    "partition keeper: a tick still runs after %.0f s; leaving it", STOP_JOIN_TIMEOUT_S
                )

    def _run(self) -> None:
        self.tick()
        while not self._stop.wait(self._interval_s):
            self.tick()

    def _ensure(self) -> list[partitions.Month]:
        now = self._clock()
        needed = partitions.months_to_keep(now, self._retention, self._months_ahead)
        with psycopg.connect(
            self._dsn,
            autocommit=True,
            application_name="shardd-partition-keeper",
            connect_timeout=CONNECT_TIMEOUT_S,
        ) as conn:
            trace_connection(conn, tracer_provider=self._tracer_provider)
            with tracing.untraced():  # the usual tick finds every month there: no span for that
                missing = partitions.first_missing_month(conn, needed)
            if missing is None:
                return []
            with tracing.background_job_span(
                "partitions.ensure",
                tracer_provider=self._tracer_provider,
                attributes={"partitions.first_missing": missing.table},
            ) as span:
                created = partitions.ensure_partitions(
                    conn, now=now, retention=self._retention, months_ahead=self._months_ahead
                )
                span.set_attribute("partitions.created", [m.table for m in created])
            return created


__all__ = [
    "CONNECT_TIMEOUT_S",
    "DEFAULT_INTERVAL_S",
    "STOP_JOIN_TIMEOUT_S",
    "Clock",
    "PartitionKeeper",
    "utc_now",
]
