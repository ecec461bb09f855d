"""Where operations live between attempts: the `OperationStore` protocol and its SQLite default.

The rule this module exists for: an operation (with its idempotency key) is durable BEFORE the first
network call, so a caller that crashes at any point can resume with the same key. `create` therefore
commits with an fsync before it returns (`SqliteOperationStore` runs WAL with `synchronous=FULL`).

Plugging in your own store (for example the caller's PostgreSQL, in the same transaction as the
business intent that caused the operation) means implementing five methods::

    class PostgresOperationStore:
        def __init__(self, pool: psycopg_pool.ConnectionPool) -> None:
            self._pool = pool

        def create(self, operation: Operation) -> None:
            with self._pool.connection() as conn:      # commits (durably) on exit
                conn.execute(
                    "INSERT INTO client_operation (id, body, state) VALUES (%s, %s, %s)",
                    (operation.id, Jsonb(operation.to_dict()), operation.state.value),
                )

        def get(self, operation_id: str) -> Operation | None:
            with self._pool.connection() as conn:
                row = conn.execute("SELECT body FROM client_operation WHERE id = %s",
                                   (operation_id,)).fetchone()
            return Operation.from_dict(row[0]) if row else None

        def record_attempt(self, operation_id, attempt, *, state, outcome) -> Operation:
            with self._pool.connection() as conn:
                row = conn.execute("SELECT body FROM client_operation WHERE id = %s FOR UPDATE",
                                   (operation_id,)).fetchone()
                updated = Operation.from_dict(row[0]).with_attempt(attempt, state, outcome)
                conn.execute("UPDATE client_operation SET body = %s, state = %s WHERE id = %s",
                             (Jsonb(updated.to_dict()), updated.state.value, operation_id))
            return updated

        def list_operations(self, states=None) -> list[Operation]: ...   # WHERE state = ANY(%s)
        def list_pending(self) -> list[Operation]:
            return self.list_operations({OperationState.PENDING})

Requirements for any store: `create` is durable when it returns and refuses a duplicate id or key;
`record_attempt` appends (never loses an attempt recorded concurrently) and never turns a final
state back into PENDING (`Operation.with_attempt` implements that rule); all methods are thread-safe.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shardrouter.client.operation import Attempt, Operation, OperationState, Outcome

__all__ = ["DuplicateOperation", "OperationStore", "SqliteOperationStore", "UnknownOperation"]


class DuplicateOperation(ValueError):
    """An operation with this id or idempotency key is already stored."""


class UnknownOperation(KeyError):
    """No operation with this id is stored."""


@runtime_checkable
class OperationStore(Protocol):
    """Durable storage of operations; see the module docstring for the contract."""

    def create(self, operation: Operation) -> None:
        """Store a new operation durably (fsync'd) before returning."""

    def get(self, operation_id: str) -> Operation | None:
        """The operation with this id, or None."""

    def record_attempt(
        self, operation_id: str, attempt: Attempt, *, state: OperationState, outcome: Outcome
    ) -> Operation:
        """Append an attempt and set the state and last outcome; the updated operation."""

    def list_operations(self, states: Collection[OperationState] | None = None) -> list[Operation]:
        """Operations in any of `states` (all if None), oldest first."""

    def list_pending(self) -> list[Operation]:
        """Operations still PENDING (to resume after a crash), oldest first."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    id              TEXT PRIMARY KEY,
    kind            TEXT NOT NULL,
    arguments       TEXT NOT NULL,
    idempotency_key TEXT NOT NULL UNIQUE,
    caller_id       TEXT,
    state           TEXT NOT NULL,
    outcome         TEXT,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS operations_state ON operations (state, created_at);
CREATE TABLE IF NOT EXISTS attempts (
    operation_id    TEXT NOT NULL REFERENCES operations (id),
    seq             INTEGER NOT NULL,
    body            TEXT NOT NULL,
    PRIMARY KEY (operation_id, seq)
);
"""
_COLUMNS = "id, kind, arguments, idempotency_key, caller_id, state, outcome, created_at, updated_at"


class SqliteOperationStore:
    """The default store: one SQLite file (stdlib `sqlite3`), WAL, `synchronous=FULL`.

    Safe to share between threads (one connection behind a lock) and between processes on one
    machine (SQLite file locks; writers take `BEGIN IMMEDIATE`, readers see committed data only).
    """

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
        self._conn.execute("PRAGMA foreign_keys=ON")
        with self._write() as conn:
            for statement in _statements(_SCHEMA):  # executescript would COMMIT on its own
                conn.execute(statement)
        if created:
            _fsync_directory(self.path.parent)  # the new file's directory entry must survive a crash

    def close(self) -> None:
        """Close the connection (the file stays)."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> SqliteOperationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, operation: Operation) -> None:
        """Insert the operation; committed and fsync'd when this returns."""
        try:
            with self._write() as conn:
                conn.execute(
                    f"INSERT INTO operations ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        operation.id,
                        operation.kind,
                        json.dumps(dict(operation.arguments), sort_keys=True),
                        operation.idempotency_key,
                        operation.caller_id,
                        operation.state.value,
                        json.dumps(operation.outcome.to_dict()) if operation.outcome else None,
                        operation.created_at.isoformat(),
                        operation.updated_at.isoformat(),
                    ),
                )
                for seq, attempt in enumerate(operation.attempts, start=1):
                    conn.execute(
                        "INSERT INTO attempts (operation_id, seq, body) VALUES (?, ?, ?)",
                        (operation.id, seq, json.dumps(attempt.to_dict())),
                    )
        except sqlite3.IntegrityError as exc:
            raise DuplicateOperation(
                f"operation {operation.id} (key {operation.idempotency_key}) is already stored"
            ) from exc

    def get(self, operation_id: str) -> Operation | None:
        """The stored operation, or None."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT {_COLUMNS} FROM operations WHERE id = ?", (operation_id,)
            ).fetchone()
            return None if row is None else self._load(row)

    def record_attempt(
        self, operation_id: str, attempt: Attempt, *, state: OperationState, outcome: Outcome
    ) -> Operation:
        """Append `attempt`; set state and outcome unless that would reopen a final operation."""
        with self._write() as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM operations WHERE id = ?", (operation_id,)).fetchone()
            if row is None:
                raise UnknownOperation(operation_id)
            updated = self._load(row).with_attempt(attempt, state, outcome)
            conn.execute(
                "INSERT INTO attempts (operation_id, seq, body) VALUES (?, ?, ?)",
                (operation_id, len(updated.attempts), json.dumps(attempt.to_dict())),
            )
            conn.execute(
                "UPDATE operations SET state = ?, outcome = ?, updated_at = ? WHERE id = ?",
                (
                    updated.state.value,
                    json.dumps(updated.outcome.to_dict()) if updated.outcome else None,
                    updated.updated_at.isoformat(),
                    operation_id,
                ),
            )
        return updated

    def list_operations(self, states: Collection[OperationState] | None = None) -> list[Operation]:
        """Operations in `states` (all if None), oldest first."""
        sql = f"SELECT {_COLUMNS} FROM operations"
        params: list[str] = []
        if states is not None:
            if not states:
                return []
            params = [OperationState(s).value for s in states]
            sql += f" WHERE state IN ({', '.join('?' * len(params))})"
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY created_at, id", params).fetchall()
            return [self._load(row) for row in rows]

    def list_pending(self) -> list[Operation]:
        """PENDING operations, oldest first."""
        return self.list_operations({OperationState.PENDING})

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _load(self, row: tuple[Any, ...]) -> Operation:
        op_id, kind, arguments, key, caller_id, state, outcome, created_at, updated_at = row
        attempts = [
            json.loads(body)
            for (body,) in self._conn.execute(
                "SELECT body FROM attempts WHERE operation_id = ? ORDER BY seq", (op_id,)
            )
        ]
        return Operation.from_dict(
            {
                "id": op_id,
                "kind": kind,
                "arguments": json.loads(arguments),
                "idempotency_key": key,
                "caller_id": caller_id,
                "state": state,
                "outcome": json.loads(outcome) if outcome else None,
                "attempts": attempts,
                "created_at": created_at,
                "updated_at": updated_at,
            }
        )


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
