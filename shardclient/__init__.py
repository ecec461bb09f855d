"""The caller library's former name, kept so that callers written against it keep working.

Import `shardrouter.client` instead: this alias re-exports its public names and warns once.
"""

import warnings

from shardrouter.client import (
    AmountError,
    Attempt,
    DuplicateOperation,
    ErrorDetails,
    InvalidOperation,
    Operation,
    OperationKind,
    OperationState,
    OperationStore,
    Outcome,
    RetryPolicy,
    RpcFailure,
    SendResult,
    SqliteOperationStore,
    TransferClient,
    UnknownOperation,
    Verdict,
    channel_options,
    classify,
    exponent,
    format_amount,
    load_service_config,
    parse_amount,
)

warnings.warn(
    "the shardclient package is now shardrouter.client; import that instead",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "AmountError",
    "Attempt",
    "DuplicateOperation",
    "ErrorDetails",
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
