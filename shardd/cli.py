"""The `shardd` command: serve, migrate, retention, dead letters and key look-ups for operators."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Sequence

import psycopg

from shardd import retention as retention_job
from shardd.server import MONTHS_AHEAD, prepare_database, start_shard
from shardd.settings import ShardSettings, parse_settings
from shardrouter import grpcserver, telemetry
from shardrouter.keys import key_time
from shardrouter.logs import configure_logging
from shardrouter.settings_source import command_words

log = logging.getLogger("shardd")

USAGE = """shardd COMMAND [--flag value ...]

commands:
  serve                      run the shard daemon (migrates first)
  migrate                    apply schema migrations and create partitions, then exit
  retention run              drop expired key partitions, create future ones
  dead-letters list          list dead-lettered credits and their refunds
  dead-letters show ID       show one dead letter
  dead-letters replay ID     send the dead letter's refund again (safe to repeat)
  keys lookup KEY            show a key's records (state, status, expiry; never the response body)

Every setting is a flag (--shard-id, --dsn, --listen, ...) or a SHARDD_* environment variable;
see README.md."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardd` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    words = command_words(args)
    try:
        settings = parse_settings(args)
    except ValueError as exc:
        print(f"shardd: {exc}", file=sys.stderr)
        return 2
    configure_logging(f"shardd/{settings.shard_id}", level=settings.log_level, fmt=settings.log_format)
    command = words[:2]
    if command[:1] == ["serve"]:
        return _serve(settings)
    if command[:1] == ["migrate"]:
        prepare_database(settings.dsn, settings.retention)
        print("schema up to date")
        return 0
    if command == ["retention", "run"]:
        result = retention_job.run_retention(
            settings.dsn, retention=settings.retention, months_ahead=MONTHS_AHEAD
        )
        print(json.dumps(result.__dict__, default=list))
        return 0
    if command[:1] == ["dead-letters"]:
        return _dead_letters(settings, words[1:])
    if command == ["keys", "lookup"] and len(words) == 3:
        return _lookup_key(settings, words[2])
    print(USAGE, file=sys.stderr)
    return 2


def _serve(settings: ShardSettings) -> int:
    # Off unless the OTEL_* environment asks for it (docs/tracing.md); before the server is built,
    # so the daemon sees the provider and adds its tracing interceptor.
    telemetry.configure_tracing(f"shardd/{settings.shard_id}")
    daemon = start_shard(settings)
    grpcserver.wait_for_termination_signal()
    daemon.stop()
    telemetry.shutdown_tracing()  # flush the spans still queued
    log.info("stopped")
    return 0


def _dead_letters(settings: ShardSettings, words: list[str]) -> int:
    from shardd.db import Database
    from shardd.ledger import store
    from shardd.relay import OutboxRelay
    from shardrouter.shardmap import load_shard_map

    with psycopg.connect(settings.dsn) as conn:
        if words == ["list"]:
            for letter in store.list_dead_letters(conn):
                print(json.dumps(_letter_json(letter)))
            return 0
        if len(words) == 2 and words[0] in ("show", "replay"):
            transfer_id = _uuid_or_exit(words[1])
            found = store.read_dead_letter(conn, transfer_id)
            if found is None:
                print(f"no dead letter for transfer {transfer_id}", file=sys.stderr)
                return 1
            if words[0] == "show":
                print(json.dumps(_letter_json(found), indent=2))
                return 0
            store.note_replay(conn, transfer_id)
            conn.commit()
    if not settings.shard_map:
        print("replay needs --shard-map to reach this shard's RefundTransfer", file=sys.stderr)
        return 2
    database = Database(settings.dsn, min_size=1, max_size=2)
    database.open()
    try:
        relay = OutboxRelay(settings, database, load_shard_map(settings.shard_map))
        confirmed = relay.refund_owed(transfer_id)
    finally:
        database.close()
    print("refund confirmed" if confirmed else "refund NOT confirmed; see the log and try again")
    return 0 if confirmed else 1


def _lookup_key(settings: ShardSettings, text: str) -> int:
    from shardd.idempotency import store as key_store

    key = _uuid_or_exit(text)
    with psycopg.connect(settings.dsn) as conn:
        records = key_store.find_key(conn, key=key, key_time=key_time(key))
    if not records:
        print(f"no record of key {key} (never seen, rolled back, or expired)")
        return 1
    for r in records:
        print(
            json.dumps(
                {
                    "scope": r.scope,
                    "method": r.method,
                    "state": r.state.value,
                    "status_code": r.outcome.code if r.outcome else None,
                    "status_message": r.outcome.message if r.outcome else None,
                    "created_at": r.created_at.isoformat(),
                    "completed_at": r.completed_at.isoformat() if r.completed_at else None,
                    "expires_at": (r.key_time + settings.retention).isoformat(),
                }
            )
        )
    return 0


def _letter_json(letter: object) -> dict[str, object]:
    return {
        k: (str(v) if not isinstance(v, int | str | type(None)) else v) for k, v in letter.__dict__.items()
    }


def _uuid_or_exit(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise SystemExit(f"shardd: {text!r} is not a UUID") from None


if __name__ == "__main__":
    sys.exit(main())
