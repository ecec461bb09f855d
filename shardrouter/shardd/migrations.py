"""Numbered schema migrations, applied at start-up and tracked in `schema_version`, and which
releases can serve which schema.

Each migration runs once, in a transaction of its own, under an advisory lock so two daemons starting
against one database do not race. Never edit a released migration: add the next number.

Every lock the migrations wait for (the advisory lock, and the table locks of their DDL) is bounded:
each attempt waits at most `ATTEMPT_LOCK_TIMEOUT_S` (`lock_timeout`), since a queued ACCESS EXCLUSIVE
request makes every later query of its table wait behind it, and is retried until the caller's
`lock_timeout_s` is spent (`MigrationLockTimeout`, nothing of that migration applied; the next start
retries).

Rolling upgrades run two releases on one database, the new one's migrations applied while the old one
still serves, so each migration declares its compatibility (`COMPATIBILITY`): an *expand* step leaves
everything an older release reads and writes working; a *contract* step does not, and names the oldest
release that serves the schema after it. `schema_version` records that per version
(`serves_code_from`), so a release meeting a newer schema than its own knows whether it can serve it
(only expand steps since its own) or must refuse (`SchemaNewerThanCode`, naming both versions). The
rule: docs/migrations.md.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql as pgsql

log = logging.getLogger(__name__)

_MIGRATION_LOCK = 0x5348_4152_4431  # "SHARD1": one advisory lock id for all schema changes

#: The tables whose rows belonged to an account's slot before migration 16: what migrations 6 and 15
#: (fence triggers, replica identity) were written for, and must keep meaning on a new database.
_FENCED_BEFORE_16 = (
    "accounts",
    "ledger_entries",
    "transfers",
    "outbox",
    "delivery_attempts",
    "dead_letters",
    "idempotency_record",
)
#: Every table whose rows belong to an account's slot (column `account_hash`): what a move copies,
#: and what a slot fence guards.
FENCED_TABLES = (*_FENCED_BEFORE_16, "voided_credits")


def _crc32_table() -> str:
    """The 256 entries of the CRC-32 (IEEE, reflected) byte table as a PostgreSQL array literal."""
    entries = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
        entries.append(str(crc))
    return "{" + ",".join(entries) + "}"


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
    (
        6,
        "the routing hash of every row that moves with an account, and slot fences",
        """
        -- An account's slot is crc32(UTF-8 id) % slots (shardrouter.core.shardmap). Moving a slot
        -- range selects rows by it in a publication's row filter, which may not call functions of
        -- ours, so every row that belongs to an account stores that CRC-32 (slot-count free):
        -- WHERE account_hash % 16384 BETWEEN lo AND hi. Computed in the database (generated columns
        -- and triggers), so no writer can leave it out. Adding a stored generated column rewrites
        -- the table once, under an exclusive lock.
        CREATE FUNCTION account_hash(account_id text) RETURNS bigint
            LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
        DECLARE
            crc_table constant bigint[] := '@CRC_TABLE@';
            bytes constant bytea := convert_to(account_id, 'UTF8');
            crc bigint := 4294967295;
        BEGIN
            FOR i IN 0 .. length(bytes) - 1 LOOP
                crc := (crc >> 8) # crc_table[((crc # get_byte(bytes, i)) & 255) + 1];
            END LOOP;
            RETURN crc # 4294967295;
        END $$;

        ALTER TABLE accounts ADD COLUMN account_hash bigint NOT NULL
            GENERATED ALWAYS AS (account_hash(id)) STORED;
        ALTER TABLE ledger_entries ADD COLUMN account_hash bigint NOT NULL
            GENERATED ALWAYS AS (account_hash(account_id)) STORED;
        -- A transfer lives with its source account (its debit, outbox row and delivery history).
        ALTER TABLE transfers ADD COLUMN account_hash bigint NOT NULL
            GENERATED ALWAYS AS (account_hash(source_account_id)) STORED;

        -- The transfer's rows elsewhere take its hash when they are written.
        CREATE FUNCTION take_transfer_account_hash() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            SELECT t.account_hash INTO NEW.account_hash FROM transfers t WHERE t.id = NEW.transfer_id;
            RETURN NEW;
        END $$;
        ALTER TABLE outbox ADD COLUMN account_hash bigint;
        ALTER TABLE delivery_attempts ADD COLUMN account_hash bigint;
        ALTER TABLE dead_letters ADD COLUMN account_hash bigint;
        UPDATE outbox o SET account_hash = t.account_hash FROM transfers t WHERE t.id = o.transfer_id;
        UPDATE delivery_attempts d SET account_hash = t.account_hash
            FROM transfers t WHERE t.id = d.transfer_id;
        UPDATE dead_letters d SET account_hash = t.account_hash FROM transfers t WHERE t.id = d.transfer_id;
        ALTER TABLE outbox ALTER COLUMN account_hash SET NOT NULL;
        ALTER TABLE delivery_attempts ALTER COLUMN account_hash SET NOT NULL;
        ALTER TABLE dead_letters ALTER COLUMN account_hash SET NOT NULL;
        CREATE TRIGGER outbox_account_hash BEFORE INSERT OR UPDATE OF transfer_id ON outbox
            FOR EACH ROW EXECUTE FUNCTION take_transfer_account_hash();
        CREATE TRIGGER delivery_attempts_account_hash BEFORE INSERT OR UPDATE OF transfer_id
            ON delivery_attempts FOR EACH ROW EXECUTE FUNCTION take_transfer_account_hash();
        CREATE TRIGGER dead_letters_account_hash BEFORE INSERT OR UPDATE OF transfer_id ON dead_letters
            FOR EACH ROW EXECUTE FUNCTION take_transfer_account_hash();

        -- The routing account's hash of the call that made a record (NULL: a method routed by a
        -- transfer id alone, or a record from before this migration).
        ALTER TABLE idempotency_record ADD COLUMN account_hash bigint;

        -- A fenced slot range takes no writes on this shard, whoever sends them: the cut-over of a
        -- move fences the range on its old owner before its last catch-up.
        CREATE TABLE slot_fences (
            move_id     text        PRIMARY KEY,
            slots       integer     NOT NULL CHECK (slots > 0),
            first_slot  integer     NOT NULL CHECK (first_slot >= 0),
            last_slot   integer     NOT NULL CHECK (last_slot >= first_slot AND last_slot < slots),
            created_at  timestamptz NOT NULL DEFAULT now()
        );
        CREATE FUNCTION refuse_fenced_write() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            fence slot_fences;
        BEGIN
            SELECT * INTO fence FROM slot_fences f
                WHERE (TG_OP <> 'DELETE' AND NEW.account_hash % f.slots BETWEEN f.first_slot AND f.last_slot)
                   OR (TG_OP <> 'INSERT' AND OLD.account_hash % f.slots BETWEEN f.first_slot AND f.last_slot)
                LIMIT 1;
            -- The move that fenced the range deletes the rows it moved out (and nothing else).
            IF FOUND AND NOT (TG_OP = 'DELETE'
                              AND coalesce(current_setting('shardrouter.moving_out', true), '') = fence.move_id) THEN
                RAISE EXCEPTION 'the row of % is in a slot range that is moving to another shard (move %)',
                    TG_TABLE_NAME, fence.move_id
                    USING ERRCODE = 'object_not_in_prerequisite_state', HINT = 'shardrouter:slot-fenced';
            END IF;
            RETURN NULL;
        END $$;
        -- AFTER, not BEFORE: a BEFORE trigger sees generated columns not yet computed.
        @FENCE_TRIGGERS@
        """.replace("@CRC_TABLE@", _crc32_table()).replace(
            "@FENCE_TRIGGERS@",
            "\n        ".join(
                f"CREATE TRIGGER {table}_fence AFTER INSERT OR UPDATE OR DELETE ON {table}"
                " FOR EACH ROW EXECUTE FUNCTION refuse_fenced_write();"
                for table in _FENCED_BEFORE_16
            ),
        ),
    ),
    (
        7,
        "the journal of slot range moves",
        """
        -- One row per move out of this shard, written by `shard-router reshard` (shardrouter.reshard)
        -- on the old owner. Every object the move creates is recorded here before it is created,
        -- so a resumed or aborted move knows what to finish or remove.
        CREATE TABLE slot_moves (
            move_id          text        PRIMARY KEY,
            slots            integer     NOT NULL CHECK (slots > 0),
            first_slot       integer     NOT NULL CHECK (first_slot >= 0),
            last_slot        integer     NOT NULL CHECK (last_slot >= first_slot AND last_slot < slots),
            source_shard_id  text        NOT NULL,
            target_shard_id  text        NOT NULL CHECK (target_shard_id <> source_shard_id),
            phase            text        NOT NULL,
            objects          jsonb       NOT NULL DEFAULT '[]',
            figures          jsonb       NOT NULL DEFAULT '{}',
            created_at       timestamptz NOT NULL DEFAULT now(),
            updated_at       timestamptz NOT NULL DEFAULT now()
        );
        """,
    ),
    (
        8,
        "routing hashes set by triggers, so logical replication copies them",
        """
        -- A move replicates rows with a row filter on account_hash, so UPDATEs and DELETEs need a
        -- replica identity holding it (REPLICA IDENTITY FULL while the move runs), and PostgreSQL
        -- refuses a replica identity with unpublished generated columns, while publishing them
        -- fails against the subscriber's own generated column. Plain columns, set by BEFORE
        -- triggers, replicate like any other; the trigger fires only when the account id is
        -- written, so a balance update no longer recomputes the hash either. Triggers do not fire
        -- in a subscription's apply worker: the target keeps the copied value.
        ALTER TABLE accounts ALTER COLUMN account_hash DROP EXPRESSION;
        ALTER TABLE ledger_entries ALTER COLUMN account_hash DROP EXPRESSION;
        ALTER TABLE transfers ALTER COLUMN account_hash DROP EXPRESSION;
        CREATE FUNCTION set_account_hash_of_id() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN NEW.account_hash := account_hash(NEW.id); RETURN NEW; END $$;
        CREATE FUNCTION set_account_hash_of_account() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN NEW.account_hash := account_hash(NEW.account_id); RETURN NEW; END $$;
        CREATE FUNCTION set_account_hash_of_source() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN NEW.account_hash := account_hash(NEW.source_account_id); RETURN NEW; END $$;
        CREATE TRIGGER accounts_account_hash BEFORE INSERT OR UPDATE OF id, account_hash ON accounts
            FOR EACH ROW EXECUTE FUNCTION set_account_hash_of_id();
        CREATE TRIGGER ledger_entries_account_hash
            BEFORE INSERT OR UPDATE OF account_id, account_hash ON ledger_entries
            FOR EACH ROW EXECUTE FUNCTION set_account_hash_of_account();
        CREATE TRIGGER transfers_account_hash
            BEFORE INSERT OR UPDATE OF source_account_id, account_hash ON transfers
            FOR EACH ROW EXECUTE FUNCTION set_account_hash_of_source();
        """,
    ),
    (
        9,
        "outbox and delivery attempt ids drawn from a block of their own per database",
        """
        -- A move copies rows with their ids, so two shards must not hand out the same ones: each
        -- database's sequences jump to a random block of 2^40 ids (one of about four million), so
        -- rows made after this migration collide across shards with a chance of about one in four
        -- million per pair; a move checks the ranges before it copies (shardrouter.reshard).
        SELECT setval(pg_get_serial_sequence('outbox', 'id'),
                      greatest((SELECT last_value FROM outbox_id_seq),
                               (1 + floor(random() * 4194303))::bigint << 40));
        SELECT setval(pg_get_serial_sequence('delivery_attempts', 'id'),
                      greatest((SELECT last_value FROM delivery_attempts_id_seq),
                               (1 + floor(random() * 4194303))::bigint << 40));
        """,
    ),
    (
        10,
        "idempotency keys stored as text: any UUID or an opaque key",
        """
        -- A key is any UUID (canonical lower-case text) or an opaque key of 1-255 visible ASCII
        -- characters (shardrouter.core.keys). A UUIDv7 still dates its record by its own time; any
        -- other key by its first receipt, so its record is found by (scope, key) in any partition
        -- (shardrouter.shardd.idempotency.store). uuid::text is the canonical lower-case form, so
        -- the existing keys keep their identity. Each ALTER rewrites its table and its indexes once,
        -- under an exclusive lock; the primary key (scope, key, key_time) stays as it is.
        ALTER TABLE idempotency_record ALTER COLUMN key TYPE text USING key::text;
        ALTER TABLE ledger_entries ALTER COLUMN idempotency_key TYPE text USING idempotency_key::text;
        ALTER TABLE outbox ALTER COLUMN idempotency_key TYPE text USING idempotency_key::text;
        ALTER TABLE dead_letters ALTER COLUMN refund_key TYPE text USING refund_key::text;
        """,
    ),
    (
        11,
        "a commit that queues a cross-shard credit wakes the outbox relay",
        """
        -- NOTIFY is transactional: the relay hears it once the credit's transaction committed, so it
        -- never looks for a row it cannot see yet, and several rows of one transaction (or several
        -- transactions at once) fold into few wake-ups. A statement trigger: one notification per
        -- INSERT statement, whatever its row count. The relay keeps polling as a fallback.
        CREATE FUNCTION notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('shardrouter_outbox', '');
            RETURN NULL;
        END $$;
        CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
            FOR EACH STATEMENT EXECUTE FUNCTION notify_outbox();
        """,
    ),
    (
        12,
        "a key's claim in one statement: its committed record, or its lock and a fresh look",
        """
        -- The claim of a guarded call (shardrouter.shardd.idempotency.store). It runs alone, outside
        -- the call's transaction: a replay is this one statement and nothing else. Its lock is a
        -- session lock, so it outlives this statement and holds the key while the handler's
        -- transaction runs; the caller releases it after that transaction's COMMIT (or ROLLBACK).
        -- VOLATILE, so each query below reads a snapshot taken when it starts: the read after the
        -- lock was granted sees every twin that committed (and so let the lock go) before it.
        CREATE FUNCTION idempotency_completed(p_scope text, p_key text, p_key_time timestamptz)
            RETURNS idempotency_record LANGUAGE plpgsql VOLATILE AS $$
        DECLARE
            found_record idempotency_record;
        BEGIN
            IF p_key_time IS NULL THEN  -- a key dated by its first receipt: any partition
                SELECT * INTO found_record FROM idempotency_record r
                    WHERE r.scope = p_scope AND r.key = p_key AND r.state = 'completed'
                    ORDER BY r.key_time LIMIT 1;
            ELSE  -- a UUIDv7: its own partition, by the full primary key
                SELECT * INTO found_record FROM idempotency_record r
                    WHERE r.scope = p_scope AND r.key = p_key AND r.key_time = p_key_time
                      AND r.state = 'completed';
            END IF;
            RETURN found_record;
        END $$;

        -- Its reads use generic plans: a custom plan of a query on the partitioned key table is made
        -- again on every call (the planner prices the generic plan with every partition in it), which
        -- cost about 0.1 ms of the database's time per call; the generic plan prunes partitions when
        -- it starts (bench: the claim's database time per new key 0.62 -> 0.40 ms, per replay 0.33 ->
        -- 0.07 ms).
        -- p_lock_timeout and p_statement_timeout: the bounds of the handler's transaction if the key
        -- is claimed (a NULL statement timeout keeps the session's). Set for the session, so they
        -- hold in the transaction the caller opens next without a statement of their own; the
        -- session's own values are kept aside and put back by idempotency_release.
        CREATE FUNCTION idempotency_claim(
            p_scope text, p_key text, p_key_time timestamptz, p_lock_timeout text, p_statement_timeout text,
            OUT claim text, OUT claimed_at timestamptz, OUT record idempotency_record
        ) LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
        DECLARE
            key_lock constant bigint := hashtextextended(p_scope || ' ' || p_key, 0);
        BEGIN
            claimed_at := now();
            -- A replay reads the committed record and takes no lock, so replays never wait.
            record := idempotency_completed(p_scope, p_key, p_key_time);
            IF record.key IS NOT NULL THEN
                claim := 'existing';
            ELSIF pg_try_advisory_lock(key_lock) THEN
                record := idempotency_completed(p_scope, p_key, p_key_time);
                IF record.key IS NULL THEN
                    claim := 'claimed';
                    PERFORM set_config('shardrouter.saved_lock_timeout', current_setting('lock_timeout'), false),
                            set_config('shardrouter.saved_statement_timeout',
                                       current_setting('statement_timeout'), false),
                            set_config('lock_timeout', p_lock_timeout, false),
                            set_config('statement_timeout',
                                       coalesce(p_statement_timeout, current_setting('statement_timeout')), false);
                ELSE  -- a twin committed between the first read and the lock
                    PERFORM pg_advisory_unlock(key_lock);
                    claim := 'existing';
                END IF;
            ELSE  -- a twin holds the key; it may have committed just now
                record := idempotency_completed(p_scope, p_key, p_key_time);
                claim := CASE WHEN record.key IS NULL THEN 'in_flight' ELSE 'existing' END;
            END IF;
        END $$;

        -- Let the key go and give the session its own bounds back: after the handler's transaction
        -- ended (ROLLBACK), or, p_at_commit, from inside it: the key is then held by a transaction
        -- lock (granted at once, this session holding the key) until the COMMIT, so the store of its
        -- record and its release are one statement and no twin can take the key before the record
        -- is visible.
        CREATE FUNCTION idempotency_release(p_scope text, p_key text, p_at_commit boolean DEFAULT false)
            RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
        DECLARE
            key_lock constant bigint := hashtextextended(p_scope || ' ' || p_key, 0);
        BEGIN
            IF p_at_commit THEN
                PERFORM pg_advisory_xact_lock(key_lock);
            END IF;
            PERFORM set_config('lock_timeout', coalesce(current_setting('shardrouter.saved_lock_timeout', true),
                                                        current_setting('lock_timeout')), false),
                    set_config('statement_timeout',
                               coalesce(current_setting('shardrouter.saved_statement_timeout', true),
                                        current_setting('statement_timeout')), false);
            RETURN pg_advisory_unlock(key_lock);
        END $$;
        """,
    ),
    (
        13,
        "the routing hash from PostgreSQL's own crc32 where the server has it",
        """
        -- PostgreSQL 18 computes CRC-32 natively (the same CRC as zlib's, which the router uses); the
        -- PL/pgSQL loop of migration 6 costs tens of microseconds per row, three times per Deposit
        -- (the account's row, its ledger entry, its idempotency record). A SQL function is inlined
        -- where it is called. Older servers keep the loop: same values, so shards on different
        -- versions still agree on every slot.
        DO $migration$
        BEGIN
            IF current_setting('server_version_num')::integer >= 180000 THEN
                CREATE OR REPLACE FUNCTION account_hash(account_id text) RETURNS bigint
                    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
                    AS $fn$ SELECT crc32(convert_to(account_id, 'UTF8')) $fn$;
            END IF;
        END $migration$;
        """,
    ),
    (
        14,
        "slot ownership recorded by the moves that changed it",
        """
        -- Who owns a slot range, as each move's commit recorded it: the old owner's row is written in
        -- the commit's own transaction (with the journal's phase and the committed map), the new
        -- owner's in the transaction that lowers its fence. A shard daemon reads these before its
        -- shard map: for a range, a row whose map_version is at least the map's overrules the map, so
        -- the new owner serves the range the moment it is handed over and a stale map file cannot
        -- hand it back. The same row (one per move) is written on both shards.
        CREATE TABLE slot_ownership (
            move_id         text        PRIMARY KEY,
            slots           integer     NOT NULL CHECK (slots > 0),
            first_slot      integer     NOT NULL CHECK (first_slot >= 0),
            last_slot       integer     NOT NULL CHECK (last_slot >= first_slot AND last_slot < slots),
            owner_shard_id  text        NOT NULL,
            map_version     bigint      NOT NULL CHECK (map_version > 0),
            recorded_at     timestamptz NOT NULL DEFAULT now()
        );
        -- The map a move committed, so it can always be rebuilt (`shard-router reshard show-map`).
        ALTER TABLE slot_moves ADD COLUMN committed_map jsonb;
        """,
    ),
    (
        15,
        "the replica identity a move's row filter needs, set once on every moved table",
        """
        -- A move publishes rows with a filter on account_hash, which no primary key holds, and an
        -- UPDATE or DELETE of a published table is refused unless its replica identity covers the
        -- filter's columns. Moves used to set REPLICA IDENTITY FULL when they prepared and DEFAULT
        -- again when they cleaned up: two ACCESS EXCLUSIVE locks on the busiest tables per move, each
        -- queued behind every open transaction (under load a prepare waited 40 s and retried 44
        -- times). Set here once, a move takes no such lock (shardrouter.reshard).
        -- FULL rather than USING INDEX: idempotency_record's account_hash is NULL for calls routed by
        -- a transfer id, and an index identity needs NOT NULL columns; elsewhere it would need a new
        -- unique (key, account_hash) index, whose WAL on every INSERT outweighs what it saves on an
        -- UPDATE. FULL costs WAL only on UPDATE and DELETE (the old row, under wal_level = logical).
        -- Measured (bench.replica_identity_wal, 2026-12-05, medians of 5 rounds of 500 calls): WAL per
        -- Deposit 1,163 bytes with the primary key, 1,214 (+4.5 %) under FULL, 1,240 (+9.7 %) under
        -- USING INDEX; per same-shard Transfer 2,066, 2,161 (+4.3 %) and 2,320 (+12.3 %).
        -- Each ALTER changes the catalog only (no rewrite), but takes its table's ACCESS EXCLUSIVE
        -- lock, once, at deploy time, in this migration's transaction (which, like every migration,
        -- waits for its locks: deploy it when no long transaction is open). A partition is either
        -- listed here or made later by shardrouter.shardd.partitions, which gives it FULL before
        -- attaching it.
        DO $migration$
        DECLARE
            moved regclass;
        BEGIN
            FOR moved IN
                SELECT unnest(ARRAY['@FENCED_TABLES@']::regclass[])
                UNION ALL
                SELECT i.inhrelid::regclass FROM pg_inherits i
                    WHERE i.inhparent = 'idempotency_record'::regclass
            LOOP
                EXECUTE format('ALTER TABLE %s REPLICA IDENTITY FULL', moved);
            END LOOP;
        END $migration$;
        """.replace("@FENCED_TABLES@", "', '".join(_FENCED_BEFORE_16)),
    ),
    (
        16,
        "voided credits, a fact of the transfer on the destination's account",
        """
        -- The relay gives up on a credit only after VoidCredit fenced it. The void's record fences a
        -- late CreditTransfer under the same (scope, key); but a key is unique per caller, and after the
        -- source's slot moves the new owner's relay calls under another caller than the old one, whose
        -- call may still be running. A row here is the void as a fact of the transfer: CreditTransfer
        -- refuses a voided transfer whoever sends it, and VoidCredit refuses a transfer already
        -- credited; both lock the destination account's row first, so one of them sees the other.
        -- The row belongs to the destination account's slot and moves with it. Written to be applied
        -- again over itself (IF NOT EXISTS, OR REPLACE), like migration 15.
        CREATE TABLE IF NOT EXISTS voided_credits (
            transfer_id   uuid        PRIMARY KEY,
            account_id    text        NOT NULL,
            account_hash  bigint      NOT NULL,
            reason        text        NOT NULL DEFAULT '',
            voided_at     timestamptz NOT NULL DEFAULT now()
        );
        CREATE OR REPLACE TRIGGER voided_credits_account_hash
            BEFORE INSERT OR UPDATE OF account_id, account_hash ON voided_credits
            FOR EACH ROW EXECUTE FUNCTION set_account_hash_of_account();
        CREATE OR REPLACE TRIGGER voided_credits_fence AFTER INSERT OR UPDATE OR DELETE ON voided_credits
            FOR EACH ROW EXECUTE FUNCTION refuse_fenced_write();
        ALTER TABLE voided_credits REPLICA IDENTITY FULL;
        """,
    ),
    (
        17,
        "less database work per new key: one record read per UUIDv7 claim, the routing hash inline",
        """
        -- Functions replaced in place (CREATE OR REPLACE: no table touched, no lock beyond the
        -- catalog's), with the same signatures and answers, so a daemon of the previous release keeps
        -- working against them. Measured with bench.statement_cost (pg_stat_statements, track=all).
        --
        -- The claim of a UUIDv7 key reads its record once: when the first read finds nothing and the
        -- lock is granted, the read after the lock (migration 12) only catches a twin that committed
        -- in between, and for a key dated by itself the primary key (scope, key, key_time) already
        -- does: this call's record then cannot be inserted (UniqueViolation, its handler's writes
        -- rolled back, answered in flight), and the retry replays the twin's. A key dated by its
        -- receipt has no such backstop (each receipt dates its record anew) and is read again.
        -- Replays are unchanged: one read, no lock.
        CREATE OR REPLACE FUNCTION idempotency_claim(
            p_scope text, p_key text, p_key_time timestamptz, p_lock_timeout text, p_statement_timeout text,
            OUT claim text, OUT claimed_at timestamptz, OUT record idempotency_record
        ) LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
        DECLARE
            key_lock constant bigint := hashtextextended(p_scope || ' ' || p_key, 0);
            unlocked boolean;
        BEGIN
            claimed_at := now();
            record := idempotency_completed(p_scope, p_key, p_key_time);
            IF record.key IS NOT NULL THEN
                claim := 'existing';
            ELSIF pg_try_advisory_lock(key_lock) THEN
                IF p_key_time IS NULL THEN
                    record := idempotency_completed(p_scope, p_key, p_key_time);
                END IF;
                IF record.key IS NULL THEN
                    claim := 'claimed';
                    PERFORM set_config('shardrouter.saved_lock_timeout', current_setting('lock_timeout'), false),
                            set_config('shardrouter.saved_statement_timeout',
                                       current_setting('statement_timeout'), false),
                            set_config('lock_timeout', p_lock_timeout, false),
                            set_config('statement_timeout',
                                       coalesce(p_statement_timeout, current_setting('statement_timeout')), false);
                ELSE  -- a twin committed between the first read and the lock
                    -- An expression, not a statement: PL/pgSQL evaluates it without a plan.
                    unlocked := pg_advisory_unlock(key_lock);
                    claim := 'existing';
                END IF;
            ELSE  -- a twin holds the key; it may have committed just now
                record := idempotency_completed(p_scope, p_key, p_key_time);
                claim := CASE WHEN record.key IS NULL THEN 'in_flight' ELSE 'existing' END;
            END IF;
        END $$;

        -- The routing hash of a written row: PostgreSQL 18's crc32 written into the triggers
        -- themselves, not through account_hash(), which a PL/pgSQL expression runs as a SQL function
        -- of its own (a nested statement per row: two per Deposit). Same values as account_hash().
        DO $migration$
        BEGIN
            IF current_setting('server_version_num')::integer >= 180000 THEN
                CREATE OR REPLACE FUNCTION set_account_hash_of_id() RETURNS trigger LANGUAGE plpgsql AS $fn$
                BEGIN NEW.account_hash := crc32(convert_to(NEW.id, 'UTF8')); RETURN NEW; END $fn$;
                CREATE OR REPLACE FUNCTION set_account_hash_of_account() RETURNS trigger LANGUAGE plpgsql AS $fn$
                BEGIN NEW.account_hash := crc32(convert_to(NEW.account_id, 'UTF8')); RETURN NEW; END $fn$;
                CREATE OR REPLACE FUNCTION set_account_hash_of_source() RETURNS trigger LANGUAGE plpgsql AS $fn$
                BEGIN NEW.account_hash := crc32(convert_to(NEW.source_account_id, 'UTF8')); RETURN NEW; END $fn$;
            END IF;
        END $migration$;

        -- The release of migration 12 in one statement: the hand-over to a transaction lock and the
        -- session's own bounds put back together, then the session lock let go.
        CREATE OR REPLACE FUNCTION idempotency_release(p_scope text, p_key text, p_at_commit boolean DEFAULT false)
            RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
        DECLARE
            key_lock constant bigint := hashtextextended(p_scope || ' ' || p_key, 0);
        BEGIN
            PERFORM CASE WHEN p_at_commit THEN pg_advisory_xact_lock(key_lock) END,
                    set_config('lock_timeout', coalesce(current_setting('shardrouter.saved_lock_timeout', true),
                                                        current_setting('lock_timeout')), false),
                    set_config('statement_timeout',
                               coalesce(current_setting('shardrouter.saved_statement_timeout', true),
                                        current_setting('statement_timeout')), false);
            RETURN pg_advisory_unlock(key_lock);
        END $$;
        """,
    ),
)


LATEST_VERSION = MIGRATIONS[-1][0]


class Step(enum.Enum):
    """What a migration does to the releases before it."""

    #: Everything an older release reads and writes keeps working, with the same meaning: new tables,
    #: new nullable (or defaulted) columns, new functions beside the old ones, functions replaced with
    #: the same signature and answers, triggers that fill what older writers leave out.
    EXPAND = "expand"
    #: An older release would misread, fail, or break an invariant the new code relies on: a column
    #: dropped, renamed or retyped, a function's signature changed, a fact only the new code writes.
    CONTRACT = "contract"


@dataclass(frozen=True)
class Compatibility:
    """A migration's compatibility, declared beside it (metadata: the released SQL stays untouched)."""

    step: Step
    #: Why it is that step, in one line.
    why: str
    #: CONTRACT only: the oldest release (named by its newest migration) that serves the schema after
    #: this step. A contract that follows its expand step a release later names the release that
    #: stopped reading what it drops; one without (a released mistake) names itself.
    serves_code_from: int | None = None
    #: It rewrites a hot table under an ACCESS EXCLUSIVE lock, for as long as the table takes to copy:
    #: allowed only in the migrations released before the rule (docs/migrations.md), listed here so
    #: the test that applies each migration under load checks what it sees against it.
    rewrites_hot_tables: bool = False
    #: Its statements run one by one outside a transaction (`CREATE INDEX CONCURRENTLY`, which builds
    #: an index without blocking writers, cannot run inside one), under the migrations' session lock.
    #: Each must be safe to run again (IF NOT EXISTS); an index a failed build left INVALID is dropped
    #: before the next attempt. Statements are split at a `;` ending a line: no DO blocks.
    outside_transaction: bool = False
    #: The hot tables it locks, taken first in the writers' order (`WRITER_LOCK_ORDER`): a migration
    #: that locks one table and then waits for another, which a writer holding rows of the second
    #: wants next, deadlocks with the writers. Taken first and in order, the migration waits but
    #: holds nothing while it waits.
    locks_first: tuple[str, ...] = ()


_E, _C = Step.EXPAND, Step.CONTRACT

#: The order a call's transaction locks the hot tables in (a Deposit: the account, its entry, the key's
#: record; a Transfer: the accounts, the transfer, the entries, the outbox, the record).
WRITER_LOCK_ORDER = (
    "accounts",
    "transfers",
    "ledger_entries",
    "outbox",
    "delivery_attempts",
    "dead_letters",
    "voided_credits",
    "idempotency_record",
)

#: Every migration's compatibility, by number. A test applies each migration under load to a database
#: one version behind, measures the longest stall of the load, and checks the rewrites declared here.
COMPATIBILITY: dict[int, Compatibility] = {
    1: Compatibility(_E, "the first tables"),
    2: Compatibility(_E, "a new table"),
    3: Compatibility(_E, "new tables"),
    4: Compatibility(_E, "a new table"),
    5: Compatibility(_E, "a nullable column no older release writes or reads"),
    6: Compatibility(
        _E,
        "columns older writers leave out, computed by the database (generated, triggers); new triggers",
        rewrites_hot_tables=True,
        locks_first=(*_FENCED_BEFORE_16,),
    ),
    7: Compatibility(_E, "a new table"),
    8: Compatibility(
        _E,
        "generated columns turned into trigger-set ones: same values, same writers",
        locks_first=("accounts", "transfers", "ledger_entries"),
    ),
    9: Compatibility(_E, "sequences moved forward"),
    10: Compatibility(
        _C,
        "key columns retyped uuid -> text: an older release's uuid parameters fail (text = uuid)",
        serves_code_from=10,
        rewrites_hot_tables=True,
        locks_first=("ledger_entries", "outbox", "dead_letters", "idempotency_record"),
    ),
    11: Compatibility(_E, "a statement trigger on the outbox"),
    12: Compatibility(_E, "new functions; no older release calls them"),
    13: Compatibility(_E, "a function replaced with the same signature and values"),
    14: Compatibility(_E, "a new table and a nullable column"),
    15: Compatibility(
        _E,
        "replica identity: the catalog only",
        locks_first=(*_FENCED_BEFORE_16,),
    ),
    16: Compatibility(
        _C,
        "voided credits are a fact every daemon must write: an older VoidCredit leaves it out, and a "
        "credit of a voided transfer could then land",
        serves_code_from=16,
    ),
    17: Compatibility(_E, "functions replaced with the same signatures and answers"),
}

#: The oldest schema this release's code works on: it writes migration 16's voided credits, and
#: migration 17 only replaced functions with the same signatures and answers. A daemon migrates to its
#: own version before it serves, so it meets an older schema only in `shardd migrate`'s absence.
OLDEST_SCHEMA_SERVED = 16

#: The longest one attempt waits for a lock (s): a queued ACCESS EXCLUSIVE request stalls every later
#: query of its table this long at most; the attempt is retried until the caller's bound is spent.
ATTEMPT_LOCK_TIMEOUT_S = 0.5

#: Longest wait for a lock a migration needs (s), retries included, unless the caller says otherwise.
DEFAULT_LOCK_TIMEOUT_S = 5.0


def serves_code_from(version: int) -> int:
    """The oldest release (named by its newest migration) that serves the schema at `version`: the
    last contract step's declaration at or below it (1 when there is none)."""
    oldest = 1
    for number, _, _ in MIGRATIONS:
        if number > version:
            break
        declared = COMPATIBILITY[number]
        if declared.step is Step.CONTRACT:
            oldest = declared.serves_code_from if declared.serves_code_from is not None else number
    return oldest


class MigrationError(Exception):
    """The schema could not be brought up to date; nothing of the failed migration was applied."""


class SchemaNewerThanCode(MigrationError):
    """The database was migrated by a newer release, past a contract step this release cannot serve."""

    def __init__(self, database_version: int, served_from: int | None) -> None:
        latest = MIGRATIONS[-1][0]
        by = (
            f"only releases of schema {served_from} or newer serve it"
            if served_from is not None
            else "the release that migrated it recorded no compatibility"
        )
        super().__init__(
            f"the database's schema is at version {database_version}, newer than this release's "
            f"{latest}, and {by}; this release serves schema versions {OLDEST_SCHEMA_SERVED} to {latest}, "
            f"and newer ones whose every step past {latest} is an expand step or a contract naming "
            f"{latest} or older (docs/migrations.md). Run the release that migrated it (or a newer one); a contract step "
            "is never undone by a rollback"
        )
        self.database_version = database_version
        self.served_from = served_from


class MigrationLockTimeout(MigrationError):
    """A lock a migration needs stayed held by another session for longer than the lock timeout."""

    def __init__(self, lock_timeout_s: float, detail: str) -> None:
        super().__init__(
            f"a schema migration waited {lock_timeout_s:g} s for a lock and gave up ({detail}); nothing "
            "was applied. Another migration runs, or a long transaction holds the table: look at "
            "pg_stat_activity, then start again (a pod's init container retries on its own)"
        )


def apply_migrations(
    conn: psycopg.Connection[Any], *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
) -> list[int]:
    """Apply every migration newer than the database's version, each in a transaction of its own;
    returns the numbers applied.

    Each attempt waits at most `ATTEMPT_LOCK_TIMEOUT_S` for a lock and is retried until
    `lock_timeout_s` went by without progress (`MigrationLockTimeout`). A schema newer than this code
    is served when every step past this release's is an expand step, and refused otherwise
    (`SchemaNewerThanCode`).
    """
    applied: list[int] = []
    while True:
        version = _apply_next_retried(conn, lock_timeout_s)
        if version is None:
            return applied
        if version:
            applied.append(version)


def _apply_next_retried(conn: psycopg.Connection[Any], lock_timeout_s: float) -> int | None:
    deadline = time.monotonic() + lock_timeout_s
    pause = 0.02
    while True:
        remaining = deadline - time.monotonic()
        try:
            return _apply_next(conn, max(0.001, min(ATTEMPT_LOCK_TIMEOUT_S, remaining)))
        # A deadlock with the load (the migration locks tables in another order than the writers
        # do) rolled the attempt back like a lock timeout: nothing applied, try again.
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MigrationLockTimeout(lock_timeout_s, str(exc).strip()) from exc
            # Let the queries queued behind the abandoned lock request run before asking again.
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.25)


def _apply_next(conn: psycopg.Connection[Any], lock_timeout_s: float) -> int | None:
    """Apply the next migration: its number (0: another migrator applied it meanwhile), or None when
    there is none to apply."""
    latest = MIGRATIONS[-1][0]
    with conn.transaction():
        conn.execute(
            "SELECT set_config('lock_timeout', %s, true)", (f"{max(1, round(lock_timeout_s * 1000))}ms",)
        )
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        current, served_from = _recorded_version(conn)
        if current > latest:
            if served_from is None or served_from > latest:
                raise SchemaNewerThanCode(current, served_from)
            log.warning(
                "the database's schema is at version %d, newer than this release's %d; served, since no "
                "step past %d contracted what it reads (schema served by releases from %d on)",
                current,
                latest,
                latest,
                served_from,
            )
            return None
        pending = [m for m in MIGRATIONS if m[0] > current]
        if not pending:
            return None
        version, description, sql = pending[0]
        outside = COMPATIBILITY[version].outside_transaction
        if not outside:
            _lock_first(conn, COMPATIBILITY[version].locks_first)
            conn.execute(sql.encode())
            _record(conn, version, description)
    if outside and not _apply_outside_transaction(conn, lock_timeout_s, version, description, sql):
        return 0  # another migrator applied it meanwhile
    log.info("applied migration %d (%s): %s", version, COMPATIBILITY[version].step.value, description)
    return version


def _lock_first(conn: psycopg.Connection[Any], tables: tuple[str, ...]) -> None:
    """Lock `tables` in the writers' order, one statement each (a LOCK of several waits for each in turn)."""
    for table in sorted(tables, key=WRITER_LOCK_ORDER.index):
        conn.execute(pgsql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(pgsql.Identifier(table)))


def _record(conn: psycopg.Connection[Any], version: int, description: str) -> None:
    conn.execute(
        "INSERT INTO schema_version (version, description, serves_code_from) VALUES (%s, %s, %s)",
        (version, description, serves_code_from(version)),
    )


def _apply_outside_transaction(
    conn: psycopg.Connection[Any], lock_timeout_s: float, version: int, description: str, sql: str
) -> bool:
    """Run a migration's statements one by one in autocommit mode, under the migrations' lock taken for
    the session; False when another migrator applied it first."""
    conn.execute(
        "SELECT set_config('lock_timeout', %s, false)", (f"{max(1, round(lock_timeout_s * 1000))}ms",)
    )
    try:
        conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK,))
        try:
            if schema_version(conn) >= version:
                return False
            # What a build that failed (a lock timeout, a crash) left: an index PostgreSQL keeps
            # INVALID, which IF NOT EXISTS would then take for done. Only migrations build indexes,
            # and this session holds their lock.
            for (invalid,) in conn.execute(
                "SELECT i.indexrelid::regclass::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE NOT i.indisvalid AND c.relnamespace = current_schema()::regnamespace"
            ).fetchall():
                conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {invalid}".encode())
                log.info(
                    "dropped index %s, left INVALID by a failed build, before migration %d", invalid, version
                )
            for statement in _statements(sql):
                conn.execute(statement.encode())
            _record(conn, version, description)
            return True
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK,))
    finally:
        conn.execute("RESET lock_timeout")


def _statements(sql: str) -> list[str]:
    """`sql` split at each `;` that ends a line, leaving out what holds only comments."""
    chunks = [chunk.strip() for chunk in sql.split(";\n")]
    return [
        chunk.rstrip(";")
        for chunk in chunks
        if any(line.strip() and not line.strip().startswith("--") for line in chunk.splitlines())
    ]


def _recorded_version(conn: psycopg.Connection[Any]) -> tuple[int, int | None]:
    """The database's newest version and the oldest release that serves it (None: not recorded).

    Made or brought up to date under the migrations' lock: releases before the compatibility record
    wrote no `serves_code_from`; the versions this code knows get theirs filled in.
    """
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_version ("
        " version integer PRIMARY KEY, description text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now(), serves_code_from integer)"
    )
    missing = conn.execute(
        "SELECT NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'schema_version'::regclass"
        " AND attname = 'serves_code_from' AND NOT attisdropped)"
    ).fetchone()
    if missing and missing[0]:
        conn.execute("ALTER TABLE schema_version ADD COLUMN serves_code_from integer")
    known = [number for number, _, _ in MIGRATIONS]
    conn.execute(
        "UPDATE schema_version s SET serves_code_from = k.serves FROM unnest(%s::int[], %s::int[]) AS k(v, serves)"
        " WHERE s.version = k.v AND s.serves_code_from IS NULL",
        (known, [serves_code_from(v) for v in known]),
    )
    row = conn.execute(
        "SELECT version, serves_code_from FROM schema_version ORDER BY version DESC LIMIT 1"
    ).fetchone()
    if row is None:
        return 0, None
    return int(row[0]), None if row[1] is None else int(row[1])


def schema_version(conn: psycopg.Connection[Any]) -> int:
    """The newest migration applied to this database (0 if none)."""
    row = conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()
    return int(row[0]) if row else 0


def _check_declarations() -> None:
    """Every migration declares its compatibility, and a contract names the oldest release after it."""
    numbers = [number for number, _, _ in MIGRATIONS]
    if numbers != list(range(1, len(numbers) + 1)) or sorted(COMPATIBILITY) != numbers:
        raise MigrationError("every migration, numbered from 1 without a gap, needs its COMPATIBILITY entry")
    for number, declared in COMPATIBILITY.items():
        oldest = declared.serves_code_from
        if declared.step is Step.CONTRACT and (
            oldest is None or not serves_code_from(number - 1) <= oldest <= number
        ):
            raise MigrationError(
                f"contract migration {number} must name the oldest release serving the schema after it"
            )


_check_declarations()


__all__ = [
    "ATTEMPT_LOCK_TIMEOUT_S",
    "COMPATIBILITY",
    "DEFAULT_LOCK_TIMEOUT_S",
    "FENCED_TABLES",
    "LATEST_VERSION",
    "MIGRATIONS",
    "OLDEST_SCHEMA_SERVED",
    "WRITER_LOCK_ORDER",
    "Compatibility",
    "MigrationError",
    "MigrationLockTimeout",
    "SchemaNewerThanCode",
    "Step",
    "apply_migrations",
    "schema_version",
    "serves_code_from",
]
