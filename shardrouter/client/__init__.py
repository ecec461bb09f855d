"""shardrouter.client: the caller library of shard-router.

One business operation = one durable `Operation` with one UUIDv7 idempotency key, stored before
the first network call and sent unchanged on every retry, so the shard applies it exactly once:

    from shardrouter.client import SqliteOperationStore, TransferClient, parse_amount

    with TransferClient("127.0.0.1:50051", store=SqliteOperationStore("ops.db")) as client:
        op = client.create_transfer("alice", "bob", parse_amount("25.00", "EUR"), "EUR")
        result = client.send_with_retries(op)
        print(result.state, result.replayed)

Modules: `operation` (the record), `kinds` (one operation kind per keyed RPC, from the proto's
declarations), `store` (durability), `retry` (rules), `client` (sending; `send_hedged` sends a slow
call again under the same key, `hedging`), `status` (reading rich errors), `wire` (protobuf mapping), `money` (decimal text), `service_config` (made from the declarations).
"""

from shardrouter.client.client import SendResult, TransferClient
from shardrouter.client.hedging import Hedge
from shardrouter.client.money import AmountError, exponent, format_amount, parse_amount
from shardrouter.client.operation import Attempt, Operation, OperationKind, OperationState, Outcome
from shardrouter.client.retry import RetryPolicy, Verdict, classify
from shardrouter.client.service_config import channel_options, load_service_config
from shardrouter.client.status import ErrorDetails, RpcFailure
from shardrouter.client.store import (
    DuplicateOperation,
    OperationStore,
    SqliteOperationStore,
    UnknownOperation,
)
from shardrouter.client.wire import InvalidOperation

__all__ = [
    "AmountError",
    "Attempt",
    "DuplicateOperation",
    "ErrorDetails",
    "Hedge",
    "InvalidOperation",
    "Operation",
    "OperationKind",
    "OperationState",
    "OperationStore",
    "Outcome",
    "RetryPolicy",
    "RpcFailure",
    "SendResult",
    "SqliteOperationStore",
    "TransferClient",
    "UnknownOperation",
    "Verdict",
    "channel_options",
    "classify",
    "exponent",
    "format_amount",
    "load_service_config",
    "parse_amount",
]
