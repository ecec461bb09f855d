"""The `shardd` command: serve, migrate, retention, dead letters and key look-ups for operators."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Sequence

import psycopg

from shardrouter.core import tracing
from shardrouter.core.errors import InvalidArgument
from shardrouter.core.grpcserver import ListenError
from shardrouter.core.keys import parse_key
from shardrouter.core.logs import configure_logging
from shardrouter.core.settings_source import read_command_line, unknown_environment
from shardrouter.core.shardmap import ShardMapError
from shardrouter.core.termination import StopDuringStartUp, TerminationSignals
from shardrouter.shardd import retention as retention_job
from shardrouter.shardd.authorization_policy import AuthzPolicyError, load_policy_file
from shardrouter.shardd.migrations import MigrationLockTimeout, SchemaNewerThanCode
from shardrouter.shardd.processes import ServingProcesses, port_is_free, stop_with_parent
from shardrouter.shardd.server import MONTHS_AHEAD, prepare_database, start_shard
from shardrouter.shardd.settings import ENV_PREFIX, ShardSettings, parse_settings

log = logging.getLogger("shardd")

USAGE = """usage: shardd COMMAND [--flag value ...]

commands:
  serve                      run the shard daemon (migrates first)
  migrate                    apply schema migrations and create partitions, then exit
  retention run              drop expired key partitions, create future ones
  dead-letters list          list dead-lettered credits and their refunds
  dead-letters show ID       show one dead letter
  dead-letters replay ID     send the dead letter's refund again (safe to repeat)
  keys lookup KEY            show a key's records (state, status, expiry; never the response body)

Flags go before or after the command; each one is also a SHARDD_* environment variable.
"""

#: Each command's words and how many arguments follow them.
COMMANDS: dict[tuple[str, ...], int] = {
    ("serve",): 0,
    ("migrate",): 0,
    ("retention", "run"): 0,
    ("dead-letters", "list"): 0,
    ("dead-letters", "show"): 1,
    ("dead-letters", "replay"): 1,
    ("keys", "lookup"): 1,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardd` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    read = read_command_line(
        args,
        ShardSettings,
        prog="shardd",
        prefix=ENV_PREFIX,
        usage=USAGE,
        commands=COMMANDS,
        parse=parse_settings,
    )
    if isinstance(read, int):
        return read
    settings, command, operands = read
    configure_logging(f"shardd/{settings.shard_id}", level=settings.log_level, fmt=settings.log_format)
    if not settings.log_calls:
        logging.getLogger("shardd.calls").setLevel(logging.WARNING)
    for problem in unknown_environment(ShardSettings, ENV_PREFIX):
        log.warning(problem)
    try:
        if command == ("serve",) and settings.processes > 1 and settings.process_index == 0:
            return _serve_processes(settings, args)
        return _run(settings, command, operands)
    # Before OperationalError, of which LockNotAvailable is a kind.
    except (MigrationLockTimeout, psycopg.errors.LockNotAvailable) as exc:
        print(f"shardd: cannot migrate: {exc}".strip(), file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        print(f"shardd: {database_unreachable(settings.dsn, exc)}", file=sys.stderr)
        return 1
    # Start-up configuration: one clear line, no traceback.
    except (ShardMapError, ListenError, AuthzPolicyError, SchemaNewerThanCode) as exc:
        print(f"shardd: cannot start: {exc}", file=sys.stderr)
        return 2


def _run(settings: ShardSettings, command: tuple[str, ...], operands: list[str]) -> int:
    if command == ("serve",):
        return _serve(settings)
    if command == ("migrate",):
        prepare_database(settings.dsn, settings.retention, lock_timeout_s=settings.migration_lock_timeout_s)
        print("schema up to date")
        return 0
    if command == ("retention", "run"):
        result = retention_job.run_retention(
            settings.dsn, retention=settings.retention, months_ahead=MONTHS_AHEAD
        )
        print(json.dumps(result.__dict__, default=list))
        return 0
    if command[0] == "dead-letters":
        return _dead_letters(settings, command[1], operands)
    return _lookup_key(settings, operands[0])


def _serve_processes(settings: ShardSettings, args: list[str]) -> int:
    """The parent of `processes` serving processes on one port (shardd/processes.py)."""
    signals = TerminationSignals()
    if settings.listen.rsplit(":", 1)[-1] == "0":
        print("shardd: --processes above 1 needs a fixed --listen port (they share it)", file=sys.stderr)
        return 2
    if not port_is_free(settings.listen):
        print(f"shardd: cannot listen on {settings.listen}: the address is in use", file=sys.stderr)
        return 2
    # A missing or bad policy stops the parent, before any process starts (each one follows the file).
    problems = settings.serving_problems()
    if problems:
        raise AuthzPolicyError("invalid shardd settings: " + "; ".join(problems))
    if settings.authz_policy_file:
        load_policy_file(settings.authz_policy_file)
    try:
        # once, before the processes start
        prepare_database(settings.dsn, settings.retention, lock_timeout_s=settings.migration_lock_timeout_s)
    except StopDuringStartUp:
        log.info("stopped during start-up; nothing was left half done (each migration is one transaction)")
        return 0
    signals.starting = False
    group = ServingProcesses(settings, args)
    group.start()
    group.supervise(signals.stop)
    code = group.stop(settings.shutdown_grace_s)
    log.info("stopped %d serving processes", settings.processes)
    return code


def _serve(settings: ShardSettings) -> int:
    # Signals are caught before anything starts: one during migrations is a clean stop too.
    signals = TerminationSignals()
    if settings.process_index:
        stop_with_parent(signals.stop)
    # Off unless the OTEL_* environment asks for it (docs/tracing.md); before the server is built,
    # so the daemon sees the provider and adds its tracing interceptor.
    tracing.configure_tracing(f"shardd/{settings.shard_id}")
    try:
        daemon = start_shard(settings)
        signals.starting = False
    except StopDuringStartUp:
        log.info("stopped during start-up; nothing was left half done (each migration is one transaction)")
        tracing.shutdown_tracing()
        return 0
    signals.wait()
    daemon.stop()
    tracing.shutdown_tracing()  # flush the spans still queued
    log.info("stopped")
    return 0


def _dead_letters(settings: ShardSettings, action: str, operands: list[str]) -> int:
    from shardrouter.core.shardmap import load_shard_map
    from shardrouter.shardd.db import Database
    from shardrouter.shardd.ledger import store
    from shardrouter.shardd.relay import OutboxRelay

    with psycopg.connect(settings.dsn) as conn:
        if action == "list":
            for letter in store.list_dead_letters(conn):
                print(json.dumps(_letter_json(letter)))
            return 0
        transfer_id = _uuid_or_exit(operands[0])
        found = store.read_dead_letter(conn, transfer_id)
        if found is None:
            print(f"no dead letter for transfer {transfer_id}", file=sys.stderr)
            return 1
        if action == "show":
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
        shard_map = load_shard_map(settings.shard_map)
        relay = OutboxRelay(settings, database, lambda: shard_map)
        confirmed = relay.refund_owed(transfer_id)
    finally:
        database.close()
    print("refund confirmed" if confirmed else "refund NOT confirmed; see the log and try again")
    return 0 if confirmed else 1


def _lookup_key(settings: ShardSettings, text: str) -> int:
    from shardrouter.shardd.idempotency import store as key_store

    try:
        key = parse_key(text)
    except InvalidArgument as exc:
        raise SystemExit(f"shardd: {text!r} is not an idempotency key: {exc.message}") from None
    with psycopg.connect(settings.dsn) as conn:
        records = key_store.find_key(conn, key=key.text, key_time=key.dated_at)
    if not records:
        print(f"no record of key {key.text} (never seen, rolled back, or expired)")
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


def database_unreachable(dsn: str, error: psycopg.OperationalError) -> str:
    """One line for a database that cannot be reached: where (never the password) and the server's words."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        parts = {}
    host = parts.get("host") or "the local socket"
    where = f"{host}:{parts.get('port') or 5432}"
    if parts.get("dbname"):
        where += f" (database {parts['dbname']})"
    reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return f"cannot reach the database at {where}: {reason}"


def _uuid_or_exit(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise SystemExit(f"shardd: {text!r} is not a UUID") from None


__all__ = [
    "COMMANDS",
    "USAGE",
    "database_unreachable",
    "main",
]


if __name__ == "__main__":
    sys.exit(main())
