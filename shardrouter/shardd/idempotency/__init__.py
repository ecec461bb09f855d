"""Interceptor-enforced idempotency: claim the key, run the handler, store the outcome, one transaction.

Modules: `record` (frozen record and outcome types), `store` (every SQL statement on the key table),
`config` (settings of the mechanism), `process_keys` (what one process remembers of keys), `outcomes`
(what happened to each call, for metrics and the call log), `call` (what a guarded call carries
from step to step, and the key store the steps need), `steps` (the guarded call's steps, each with one
job), `interceptor` (the gRPC server interceptor that chains the steps and answers).
"""

from shardrouter.shardd.idempotency.config import IdempotencyConfig
from shardrouter.shardd.idempotency.interceptor import IdempotencyInterceptor, MutatingMethod
from shardrouter.shardd.idempotency.record import Claim, ClaimStatus, IdempotencyRecord, StoredOutcome

__all__ = [
    "Claim",
    "ClaimStatus",
    "IdempotencyConfig",
    "IdempotencyInterceptor",
    "IdempotencyRecord",
    "MutatingMethod",
    "StoredOutcome",
]
