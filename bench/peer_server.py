"""The peer a Python team would pick instead: AWS Lambda Powertools' `@idempotent_function` on Redis,
guarding the very Deposit the shard runs, in the same plain grpcio server.

It is the no-idempotency twin (`bench/noidem_server.py`: the shard's `TransferServicer`, pool,
server options and admission, each Deposit one psycopg transaction) with Powertools in front of the
Deposit: `RedisCachePersistenceLayer` on the bench's own `redis-server`, the key read from the call's
idempotency-key metadata (`event_key_jmespath`), the stored outcome the serialized DepositResponse.
The in-progress record expires when the call's deadline does (the Lambda's remaining time in
Powertools' terms; here a per-thread stand-in for the Lambda context reads the gRPC deadline).

Payload validation is OFF: in 3.37 the Redis layer's completion write (`_update_record`) drops the
validation hash its in-progress write stored, so with validation on every replay fails it
(`IdempotencyValidationError`). Powertools' local cache is off too (its default).

Powertools and redis-py come from the optional extra `bench-peer`; they are imported by name at
start so the project type-checks without them. Run as `python -m bench.peer_server` with
PEER_REDIS_PORT set (bench/peer.py starts it; SIGTERM stops it).
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import threading
from typing import Any

import grpc

from bench.noidem_server import PlainTransferServicer, serve
from shardrouter.core.keys import KEY_METADATA
from shardrouter.shardd.db import Database
from shardrouter.shardd.ledger.service import ShardLocator
from shardrouter.v1 import transfer_pb2

log = logging.getLogger("bench.peer")

#: Where the in-progress expiry comes from when a call carries no deadline (Powertools then has none
#: either and would hold the key until the record's TTL): the loadgen always sets one.
_NO_DEADLINE_MS = 60_000


class CallDeadline:
    """Powertools reads the in-progress expiry from `config.lambda_context.get_remaining_time_in_millis()`.
    One config serves every thread of the server, so the remaining time is kept per thread: the
    handler sets it from its gRPC call before entering the guarded function."""

    def __init__(self) -> None:
        self._local = threading.local()

    def set(self, remaining_s: float | None) -> None:
        """The current thread's call has `remaining_s` seconds left (None: no deadline)."""
        self._local.remaining_ms = _NO_DEADLINE_MS if remaining_s is None else max(0, int(remaining_s * 1000))

    def get_remaining_time_in_millis(self) -> int:
        """Milliseconds the current thread's call has left."""
        return int(getattr(self._local, "remaining_ms", _NO_DEADLINE_MS))


class PeerTransferServicer(PlainTransferServicer):
    """Deposit guarded by Powertools; every other method as in the no-idempotency twin."""

    def __init__(self, database: Database, locator: ShardLocator, redis_port: int) -> None:
        super().__init__(database, locator)
        idem: Any = importlib.import_module("aws_lambda_powertools.utilities.idempotency")
        persistence: Any = importlib.import_module(
            "aws_lambda_powertools.utilities.idempotency.persistence.redis"
        )
        errors: Any = importlib.import_module("aws_lambda_powertools.utilities.idempotency.exceptions")
        self._in_progress_error: type[Exception] = errors.IdempotencyAlreadyInProgressError
        self._store_error: type[Exception] = errors.IdempotencyPersistenceLayerError
        self.deadline = CallDeadline()
        config = idem.IdempotencyConfig(
            event_key_jmespath="idempotency_key",
            raise_on_no_idempotency_key=True,
            # payload_validation_jmespath left empty: see the module docstring.
        )
        config.register_lambda_context(self.deadline)
        store = persistence.RedisCachePersistenceLayer(host="127.0.0.1", port=redis_port, ssl=False)
        self._guarded = idem.idempotent_function(
            self._apply, data_keyword_argument="payload", persistence_store=store, config=config
        )

    def _apply(
        self, *, payload: dict[str, Any], request: transfer_pb2.DepositRequest, context: grpc.ServicerContext
    ) -> dict[str, str]:
        """The Deposit in its own transaction; its answer as JSON-storable data (Powertools stores it)."""
        del payload  # Powertools hashes it for the key; the handler reads the request itself
        response = PlainTransferServicer.Deposit(self, request, context)  # the twin's transaction
        return {"response": base64.b64encode(response.SerializeToString()).decode()}

    def Deposit(
        self, request: transfer_pb2.DepositRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.DepositResponse:
        """Powertools first; the handler runs only for a key it has not seen (or whose record expired)."""
        key = next((str(v) for k, v in context.invocation_metadata() if k == KEY_METADATA), "")
        self.deadline.set(context.time_remaining())
        try:
            stored = self._guarded(payload={"idempotency_key": key}, request=request, context=context)
        except self._in_progress_error:
            context.abort(grpc.StatusCode.ABORTED, "a call with this idempotency key is in progress")
        except self._store_error as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"idempotency store: {error}")
        return transfer_pb2.DepositResponse.FromString(base64.b64decode(stored["response"]))


def main() -> int:
    """Serve the Powertools peer until SIGTERM/SIGINT."""
    redis_port = int(os.environ["PEER_REDIS_PORT"])
    return serve("peer", lambda database, locator: PeerTransferServicer(database, locator, redis_port))


if __name__ == "__main__":
    raise SystemExit(main())
