"""Numbered schema migrations, applied at start-up and tracked in `schema_version`.

Each migration runs once, in its own transaction, under an advisory lock so two daemons starting
against one database do not race. Never edit a released migration: add the next number.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

log = logging.getLogger(__name__)

_MIGRATION_LOCK = 0x5348_4152_4431  # "SHARD1": one advisory lock id for all schema changes

MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (
        1,
        "accounts, ledger entries, transfers",
        """
        CREATE TABLE accounts (
            id          text        PRIMARY KEY,
            currency    char(3)     NOT NULL,
            balance     bigint      NOT NULL DEFAULT 0,
            state       text        NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'closed')),
            created_at  timestamptz NOT NULL DEFAULT now(),
            -- The balance can never go negative, whatever a handler does.
            CONSTRAINT balance_not_negative CHECK (balance >= 0),
            CONSTRAINT balance_below_limit CHECK (balance <= 100000000000000000)
        );

        CREATE TABLE transfers (
            id                      uuid        PRIMARY KEY,
            source_account_id       text        NOT NULL,
            destination_account_id  text        NOT NULL,
            destination_shard_id    text        NOT NULL,
            amount_minor            bigint      NOT NULL CHECK (amount_minor > 0),
            currency                char(3)     NOT NULL,
            reference               text        NOT NULL DEFAULT '',
            state                   text        NOT NULL
                                    CHECK (state IN ('pending', 'completed', 'refunded')),
            created_at              timestamptz NOT NULL DEFAULT now(),
            updated_at              timestamptz NOT NULL DEFAULT now()
        );

        -- One row per balance movement. Append-only; the account balance is their sum.
        CREATE TABLE ledger_entries (
            id              uuid        PRIMARY KEY,
            account_id      text        NOT NULL REFERENCES accounts (id),
            amount_minor    bigint      NOT NULL CHECK (amount_minor <> 0),
            kind            text        NOT NULL
                            CHECK (kind IN ('deposit', 'transfer_out', 'transfer_in', 'refund')),
            transfer_id     uuid,
            idempotency_key uuid        NOT NULL,
            reference       text        NOT NULL DEFAULT '',
            created_at      timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX ledger_entries_account ON ledger_entries (account_id, created_at);
        -- A transfer moves each leg at most once on a shard, whatever retries do.
        CREATE UNIQUE INDEX ledger_entries_one_leg ON ledger_entries (transfer_id, kind)
            WHERE transfer_id IS NOT NULL;
        """,
    ),
    (
        2,
        "idempotency records, partitioned by the time in the UUIDv7 key",
        """
        -- The seed's PRIMARY KEY (scope, key) with PARTITION BY RANGE (created_at) is rejected by
        -- PostgreSQL. key_time is a pure function of the key, so (scope, key, key_time) is exactly as
        -- unique as (scope, key). Partitions are created by shardd.partitions.
        CREATE TABLE idempotency_record (
            scope           text        NOT NULL,
            key             uuid        NOT NULL,
            key_time        timestamptz NOT NULL,
            method          text        NOT NULL,
            request_hash    bytea       NOT NULL,
            state           text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
            status_code     integer,
            status_message  text,
            status_details  bytea,
            response        bytea,
            trailers        jsonb,
            created_at      timestamptz NOT NULL DEFAULT now(),
            completed_at    timestamptz,
            PRIMARY KEY (scope, key, key_time)
        ) PARTITION BY RANGE (key_time);
        """,
    ),
    (
        3,
        "outbox, delivery attempts and dead letters for credits to other shards",
        """
        CREATE TABLE outbox (
            id                  bigserial   PRIMARY KEY,
            transfer_id         uuid        NOT NULL UNIQUE REFERENCES transfers (id),
            destination_shard_id text       NOT NULL,
            idempotency_key     uuid        NOT NULL,
            payload             bytea       NOT NULL,
            attempts            integer     NOT NULL DEFAULT 0,
            next_attempt_at     timestamptz NOT NULL DEFAULT now(),
            created_at          timestamptz NOT NULL DEFAULT now(),
            delivered_at        timestamptz,
            dead_lettered_at    timestamptz,
            last_error          text
        );
        CREATE INDEX outbox_due ON outbox (next_attempt_at, id)
            WHERE delivered_at IS NULL AND dead_lettered_at IS NULL;

        CREATE TABLE delivery_attempts (
            id              bigserial   PRIMARY KEY,
            transfer_id     uuid        NOT NULL REFERENCES transfers (id),
            attempted_at    timestamptz NOT NULL DEFAULT now(),
            status_code     text        NOT NULL,
            message         text        NOT NULL DEFAULT ''
        );
        CREATE INDEX delivery_attempts_transfer ON delivery_attempts (transfer_id, id);

        CREATE TABLE dead_letters (
            transfer_id     uuid        PRIMARY KEY REFERENCES transfers (id),
            outbox_id       bigint      NOT NULL REFERENCES outbox (id),
            reason          text        NOT NULL,
            refund_key      uuid        NOT NULL,
            created_at      timestamptz NOT NULL DEFAULT now(),
            refunded_at     timestamptz,
            replay_count    integer     NOT NULL DEFAULT 0,
            last_replayed_at timestamptz
        );
        """,
    ),
    (
        4,
        "retention job bookkeeping",
        """
        CREATE TABLE retention_runs (
            id              bigserial   PRIMARY KEY,
            started_at      timestamptz NOT NULL,
            finished_at     timestamptz NOT NULL DEFAULT now(),
            dropped         text[]      NOT NULL,
            created         text[]      NOT NULL
        );
        """,
    ),
    (
        5,
        "trace context of the attempt that claimed a key",
        """
        -- W3C traceparent of the claiming attempt's idempotency span (NULL with tracing off), so
        -- a replay's span can link to the first attempt's trace. Partitions inherit the column.
        ALTER TABLE idempotency_record ADD COLUMN first_traceparent text;
        """,
    ),
)


def apply_migrations(conn: psycopg.Connection[Any]) -> list[int]:
    """Apply every migration newer than the database's version; returns the numbers applied."""
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version ("
            " version integer PRIMARY KEY, description text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        row = conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()
        current = int(row[0]) if row else 0
        for version, description, sql in MIGRATIONS:
            if version <= current:
                continue
            with conn.transaction():
                conn.execute(sql.encode())
                conn.execute(
                    "INSERT INTO schema_version (version, description) VALUES (%s, %s)",
                    (version, description),
                )
            log.info("applied migration %d: %s", version, description)
            applied.append(version)
    return applied


def schema_version(conn: psycopg.Connection[Any]) -> int:
    """The newest migration applied to this database (0 if none)."""
    row = conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()
    return int(row[0]) if row else 0


LATEST_VERSION = MIGRATIONS[-1][0]


__all__ = [
    "LATEST_VERSION",
    "MIGRATIONS",
    "apply_migrations",
    "schema_version",
]
