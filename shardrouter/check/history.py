"""The history file of a check run: one JSON object a line, the run's header, then each operation
(what the checker meant to do under one key) and each attempt (one send of it and its answer) as it
happens. The proofs (`verify`) read only this file and the shard databases, so a history written
by one run can be checked again later, or by hand."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

#: gRPC codes that are an answer the key keeps: the handler's result, or a refusal that is stored or
#: that no resend changes. Every other code (UNAVAILABLE, ABORTED in flight, DEADLINE_EXCEEDED, ...)
#: says nothing about whether the operation applied: the caller resends the same key.
DEFINITE_CODES = frozenset(
    {"OK", "FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT", "PERMISSION_DENIED", "OUT_OF_RANGE"}
)


@dataclass(frozen=True)
class Operation:
    """One business operation under one key: a deposit or a transfer."""

    key: str
    #: "deposit" or "transfer".
    kind: str
    #: Why it is in the workload: seed, deposit, same_shard, cross_shard, to_unopened, expired_key.
    label: str
    #: The deposit's account, or the transfer's source.
    account: str
    #: The transfer's destination ("" for a deposit).
    destination: str
    amount_minor: int
    currency: str


@dataclass(frozen=True)
class Attempt:
    """One send of an operation's key and what came back."""

    key: str
    method: str
    #: first, in_flight_duplicate, later_duplicate, retry (a resend of the key's own request), or
    #: reused_body (the key with another request, and every resend of that).
    role: str
    request_sha256: str
    #: The gRPC status code's name; "" when the call never got one.
    code: str
    reason: str
    message: str
    #: The shard's `idempotency-outcome` trailer (new, replay, key_reused, ...), "" if absent.
    outcome: str
    #: The response message's bytes, base64 ("" on an error status).
    response_b64: str
    #: Whether the answer carried the replayed trailer.
    replayed: bool
    started_at: float
    ended_at: float

    @property
    def definite(self) -> bool:
        """Whether the answer is one the key keeps (see DEFINITE_CODES)."""
        return self.code in DEFINITE_CODES

    @property
    def response(self) -> bytes:
        """The response bytes."""
        return base64.b64decode(self.response_b64)

    def answer(self) -> tuple[str, str, str, str]:
        """What a replay must repeat byte for byte: code, reason, message, response bytes."""
        return self.code, self.reason, self.message, self.response_b64


def sha256_hex(data: bytes) -> str:
    """The request bytes' hash, as recorded."""
    return hashlib.sha256(data).hexdigest()


def b64(data: bytes) -> str:
    """Bytes as recorded."""
    return base64.b64encode(data).decode("ascii")


@dataclass
class History:
    """A history file, read back: the run's header, operations by key, attempts by key in order."""

    header: dict[str, Any] = field(default_factory=dict)
    operations: dict[str, Operation] = field(default_factory=dict)
    attempts: dict[str, list[Attempt]] = field(default_factory=lambda: defaultdict(list))

    @property
    def accounts(self) -> set[str]:
        """Every account the operations name."""
        named = {op.account for op in self.operations.values()}
        return named | {op.destination for op in self.operations.values() if op.destination}


class HistoryWriter:
    """Appends records to a history file from many threads, one flushed line each, so a checker
    killed mid-run leaves every answer it had received."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._out: TextIO = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def header(self, **fields: Any) -> None:
        """The run's parameters."""
        self._write({"type": "run", **fields})

    def operation(self, op: Operation) -> None:
        """An operation, before its first send."""
        self._write({"type": "operation", **dataclasses.asdict(op)})

    def attempt(self, attempt: Attempt) -> None:
        """An attempt, once answered."""
        self._write({"type": "attempt", **dataclasses.asdict(attempt)})

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._out.close()


def read_history(path: Path) -> History:
    """A history file; ValueError naming the line that is not a record of one."""
    history = History()
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                kind = record.pop("type")
                if kind == "run":
                    history.header = record
                elif kind == "operation":
                    op = Operation(**record)
                    history.operations[op.key] = op
                elif kind == "attempt":
                    attempt = Attempt(**record)
                    history.attempts[attempt.key].append(attempt)
                else:
                    raise ValueError(f"unknown record type {kind!r}")
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: not a history record: {exc}") from None
    return history


__all__ = [
    "DEFINITE_CODES",
    "Attempt",
    "History",
    "HistoryWriter",
    "Operation",
    "b64",
    "read_history",
    "sha256_hex",
]
