"""The retention job: drop whole expired months of idempotency records, create future ones.

Never a row-by-row DELETE. Two runs at once are safe: a session advisory lock lets one work and the
other return at once. Each run is recorded in `retention_runs`, which the metrics read for lag.

With tracing on, a run is one `retention.run` span with its statements beneath it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
from opentelemetry.trace import TracerProvider

from shardrouter.core import tracing
from shardrouter.shardd import partitions
from shardrouter.shardd.db import trace_connection

log = logging.getLogger(__name__)

_RETENTION_LOCK = 0x5245_5445_4E54  # "RETENT"


@dataclass(frozen=True)
class RetentionResult:
    """What one retention run did."""

    ran: bool  # False: another run held the lock
    dropped: tuple[str, ...]
    created: tuple[str, ...]
    kept: tuple[str, ...]
    seconds: float


def run_retention(
    dsn: str,
    *,
    retention: timedelta,
    months_ahead: int,
    now: datetime | None = None,
    tracer_provider: TracerProvider | None = None,
) -> RetentionResult:
    """Drop partitions wholly older than `retention`; create the next `months_ahead` months.

    `tracer_provider`: where the run's span goes (default: the global provider; none while off).
    """
    with tracing.background_job_span("retention.run", tracer_provider=tracer_provider) as span:
        result = _run(dsn, retention, months_ahead, now, tracer_provider)
        span.set_attributes(
            {
                "retention.ran": result.ran,
                "retention.dropped": list(result.dropped),
                "retention.created": list(result.created),
            }
        )
    return result


def _run(
    dsn: str,
    retention: timedelta,
    months_ahead: int,
    now: datetime | None,
    tracer_provider: TracerProvider | None,
) -> RetentionResult:
    started = datetime.now(UTC)
    moment = now or started
    with psycopg.connect(dsn, autocommit=True, application_name="shardd-retention") as conn:
        trace_connection(conn, tracer_provider=tracer_provider)
        got = conn.execute("SELECT pg_try_advisory_lock(%s)", (_RETENTION_LOCK,)).fetchone()
        if not got or not got[0]:
            log.info("another retention run holds the lock; nothing to do")
            return RetentionResult(False, (), (), (), 0.0)
        try:
            created = partitions.ensure_partitions(
                conn,
                now=moment,
                retention=retention,
                months_ahead=months_ahead,
            )
            expired = partitions.expired_months(
                partitions.existing_partitions(conn),
                moment,
                retention,
            )
            for month in expired:
                partitions.drop_partition(conn, month)
            kept = partitions.existing_partitions(conn)
            conn.execute(
                "INSERT INTO retention_runs (started_at, dropped, created) VALUES (%s, %s, %s)",
                (started, [m.table for m in expired], [m.table for m in created]),
            )
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_RETENTION_LOCK,))
    seconds = (datetime.now(UTC) - started).total_seconds()
    result = RetentionResult(
        True,
        tuple(m.table for m in expired),
        tuple(m.table for m in created),
        tuple(m.table for m in kept),
        seconds,
    )
    log.info("retention run: dropped %s, created %s in %.3f s", result.dropped, result.created, seconds)
    return result


__all__ = [
    "RetentionResult",
    "run_retention",
]
