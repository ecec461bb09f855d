"""The "no idempotency" baseline: the shard's real `TransferServicer` without the idempotency interceptor.

Everything else is built by the same builders as `shardd.server.start_shard`: the same sync gRPC thread-pool server and options,
the same `Database` pool (with its checkout probe), admission, domain error mapping, and the same
settings (read from the SHARDD_* environment). The only difference is that a mutating call runs the
handler in a transaction of its own, published with `shardd.db.bind_transaction` as the interceptor
does, with no key claim, no lock and no stored outcome. So "shard directly" minus this row is the
price of idempotency, and nothing else.

Run as `python -m bench.noidem_server` (the harness starts it; SIGTERM stops it).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from psycopg.pq import TransactionStatus

from shardrouter.core import grpcserver
from shardrouter.core.keys import KEY_METADATA, parse_key
from shardrouter.core.logs import configure_logging
from shardrouter.core.termination import TerminationSignals
from shardrouter.shardd import server as shard_server
from shardrouter.shardd.admission import AdmissionInterceptor
from shardrouter.shardd.db import Database, bind_transaction, mapped_database_errors
from shardrouter.shardd.error_interceptor import DomainErrorInterceptor
from shardrouter.shardd.ledger.service import ShardLocator, TransferServicer
from shardrouter.shardd.settings import parse_settings
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

log = logging.getLogger("bench.noidem")


class PlainTransferServicer(TransferServicer):
    """The real handlers, each mutating one in its own transaction (what the interceptor would open)."""

    def __init__(self, database: Database, locator: ShardLocator) -> None:
        super().__init__(database, locator)
        self._database = database

    def _in_transaction(
        self, handler: Callable[[Any, grpc.ServicerContext], Any], request: Any, context: grpc.ServicerContext
    ) -> Any:
        # The handlers write the key into ledger rows, so it is still read (but never stored as a claim).
        key = next((parse_key(str(v)) for k, v in context.invocation_metadata() if k == KEY_METADATA), None)
        database = self._database
        with mapped_database_errors(database.transient_retry_ms), database.connection() as conn:
            # As the interceptor runs a claimed key's handler: BEGIN goes with the handler's first
            # statement and the COMMIT with the Sync that ends the pipeline (two round trips for a
            # Deposit), minus the claim, the record and the lock.
            try:
                with conn.pipeline() if database.pipeline else contextlib.nullcontext():
                    conn.execute("BEGIN")
                    with bind_transaction(conn, key.text if key else str(uuid.uuid4())):
                        result = handler(request, context)
                    conn.execute("COMMIT")
            except BaseException:
                if conn.info.transaction_status is not TransactionStatus.IDLE:
                    conn.execute("ROLLBACK")
                raise
            return result

    def Deposit(
        self, request: transfer_pb2.DepositRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.DepositResponse:
        """The real Deposit handler in a plain transaction."""
        result: transfer_pb2.DepositResponse = self._in_transaction(super().Deposit, request, context)
        return result

    def Transfer(
        self, request: transfer_pb2.TransferRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.TransferResponse:
        """The real Transfer handler in a plain transaction."""
        result: transfer_pb2.TransferResponse = self._in_transaction(super().Transfer, request, context)
        return result


def serve(name: str, servicer: Callable[[Database, ShardLocator], TransferServicer]) -> int:
    """Serve the TransferService `servicer` builds until SIGTERM/SIGINT, on the shard's own builders:
    the same pool, server options, admission limits (a fair comparison) and start-up order as
    `start_shard` (the real migrations and partitions). `name` labels the logs."""
    settings = parse_settings([])
    configure_logging(f"bench/{name}", level=settings.log_level, fmt=settings.log_format)
    stop = TerminationSignals(starting=False).stop
    database = shard_server.new_database(settings)
    admission = shard_server.admission_from(settings)
    server = shard_server.new_grpc_server(
        settings, [AdmissionInterceptor(admission), DomainErrorInterceptor()]
    )
    transfer_pb2_grpc.add_TransferServiceServicer_to_server(
        servicer(database, ShardLocator(settings.shard_id)), server
    )
    health = grpcserver.add_health_and_reflection(server, [shard_server.PUBLIC_SERVICE])
    shard_server.listen_when_ready(settings, server, database)
    grpcserver.mark_serving(health, [shard_server.PUBLIC_SERVICE])
    log.info("%s serving on %s", name, settings.listen)
    stop.wait()
    grpcserver.graceful_stop(server, health, settings.shutdown_grace_s)
    database.close()
    return 0


def main() -> int:
    """Serve the no-idempotency twin until SIGTERM/SIGINT."""
    return serve("noidem", PlainTransferServicer)


if __name__ == "__main__":
    raise SystemExit(main())
