"""SqliteOperationStore: durable, reopenable, append-only attempts, thread-safe."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shardrouter.client import (
    Attempt,
    DuplicateOperation,
    Operation,
    OperationState,
    OperationStore,
    Outcome,
    SqliteOperationStore,
    UnknownOperation,
)


def _transfer() -> Operation:
    return Operation.new(
        "transfer",
        {"source": "alice", "destination": "bob", "amount_minor": 2500, "currency": "EUR", "reference": ""},
        caller_id="billing",
    )


def _attempt(code: str = "UNAVAILABLE", replayed: bool = False) -> Attempt:
    return Attempt(started_at=datetime.now(UTC), code=code, message=f"{code} message", replayed=replayed)


def test_an_operation_survives_reopening_the_file_with_the_same_key(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ops.db"
    first = SqliteOperationStore(path)
    op = _transfer()
    first.create(op)
    first.close()

    reopened = SqliteOperationStore(path)
    loaded = reopened.get(op.id)
    assert loaded is not None
    assert loaded.idempotency_key == op.idempotency_key
    assert uuid.UUID(loaded.idempotency_key).version == 7
    assert loaded == op
    assert reopened.list_pending() == [op]
    reopened.close()


def test_the_file_is_wal_with_full_sync_and_committed_on_create(tmp_path: Path) -> None:
    path = tmp_path / "ops.db"
    store = SqliteOperationStore(path)
    op = _transfer()
    store.create(op)
    # Another connection (as another process would) sees the committed row without any close().
    with sqlite3.connect(path) as other:
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        rows = other.execute("SELECT idempotency_key FROM operations").fetchall()
    assert rows == [(op.idempotency_key,)]
    assert store._conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    store.close()


def test_duplicate_id_or_key_is_refused(tmp_path: Path) -> None:
    with SqliteOperationStore(tmp_path / "ops.db") as store:
        op = _transfer()
        store.create(op)
        with pytest.raises(DuplicateOperation):
            store.create(op)
        other = Operation.new("deposit", {"account": "a", "amount_minor": 1, "currency": "EUR"})
        same_key = Operation(
            id=other.id, kind=other.kind, arguments=other.arguments, idempotency_key=op.idempotency_key
        )
        with pytest.raises(DuplicateOperation):
            store.create(same_key)
        assert len(store.list_operations()) == 1


def test_record_attempt_appends_and_never_reopens_a_final_operation(tmp_path: Path) -> None:
    with SqliteOperationStore(tmp_path / "ops.db") as store:
        op = _transfer()
        store.create(op)
        store.record_attempt(op.id, _attempt(), state=OperationState.PENDING, outcome=Outcome("UNAVAILABLE"))
        done = store.record_attempt(
            op.id, _attempt("OK"), state=OperationState.SUCCEEDED, outcome=Outcome("OK", response_b64="AA==")
        )
        assert done.state is OperationState.SUCCEEDED
        later = store.record_attempt(
            op.id, _attempt(), state=OperationState.PENDING, outcome=Outcome("UNAVAILABLE")
        )
        assert later.state is OperationState.SUCCEEDED
        assert later.outcome == Outcome("OK", response_b64="AA==")
        assert [a.code for a in later.attempts] == ["UNAVAILABLE", "OK", "UNAVAILABLE"]
        assert store.get(op.id) == later
        assert store.list_pending() == []
        assert store.list_operations({OperationState.SUCCEEDED}) == [later]
        with pytest.raises(UnknownOperation):
            store.record_attempt("nope", _attempt(), state=OperationState.PENDING, outcome=Outcome("X"))


def test_concurrent_attempts_from_threads_and_two_store_objects_are_all_kept(tmp_path: Path) -> None:
    path = tmp_path / "ops.db"
    a, b = SqliteOperationStore(path), SqliteOperationStore(path)
    op = _transfer()
    a.create(op)

    def record(store: SqliteOperationStore, n: int) -> None:
        for _ in range(n):
            store.record_attempt(
                op.id, _attempt(), state=OperationState.PENDING, outcome=Outcome("UNAVAILABLE")
            )

    threads = [threading.Thread(target=record, args=(s, 10)) for s in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loaded = SqliteOperationStore(path).get(op.id)
    assert loaded is not None and len(loaded.attempts) == 40
    a.close()
    b.close()


def test_sqlite_store_satisfies_the_protocol(tmp_path: Path) -> None:
    with SqliteOperationStore(tmp_path / "ops.db") as store:
        assert isinstance(store, OperationStore)


def test_operation_is_read_only_and_round_trips_through_dicts() -> None:
    op = _transfer().with_attempt(
        _attempt("OK", True), OperationState.SUCCEEDED, Outcome("OK", replayed=True)
    )
    with pytest.raises(AttributeError):
        op.state = OperationState.FAILED  # type: ignore[misc]
    with pytest.raises(TypeError):
        op.arguments["amount_minor"] = 1  # type: ignore[index]
    assert Operation.from_dict(op.to_dict()) == op
    with pytest.raises(ValueError, match="unknown operation kind"):
        Operation.new("withdrawal", {})  # type: ignore[arg-type]
