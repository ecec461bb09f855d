"""Run as a subprocess by the crash tests: store an operation, then die at a chosen point.

    python -m tests.client.crash_helper before-send STORE TARGET SOURCE DEST AMOUNT_MINOR
    python -m tests.client.crash_helper after-apply STORE TARGET SOURCE DEST AMOUNT_MINOR

Prints `op <id> <key>` (flushed) once the operation is durable, then SIGKILLs itself either before the
first send, or right after the shard answered and before the answer could be recorded.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from shardrouter.client import SqliteOperationStore, TransferClient


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class DiesOnRecord:
    """An OperationStore that forwards everything, but dies instead of recording an attempt."""

    def __init__(self, inner: SqliteOperationStore) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def record_attempt(self, *args: Any, **kwargs: Any) -> Any:
        print("answered", flush=True)
        _die()


def main() -> None:
    mode, store_path, target, source, destination, amount = sys.argv[1:7]
    inner = SqliteOperationStore(store_path)
    store = DiesOnRecord(inner) if mode == "after-apply" else inner
    client = TransferClient(target, store=store)
    op = client.create_transfer(source, destination, int(amount), "EUR", reference="crash test")
    print(f"op {op.id} {op.idempotency_key}", flush=True)
    if mode == "before-send":
        _die()
    client.send_with_retries(op, budget_s=10)
    raise SystemExit("unreachable: the store should have killed the process")


if __name__ == "__main__":
    main()
