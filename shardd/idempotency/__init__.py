"""Interceptor-enforced idempotency: claim the key, run the handler, store the outcome, one transaction.

Modules: `record` (frozen record and outcome types), `store` (every SQL statement on the key table),
`config` (settings of the mechanism), `interceptor` (the gRPC server interceptor that drives it).
"""

from shardd.idempotency.config import IdempotencyConfig
from shardd.idempotency.interceptor import IdempotencyInterceptor, MutatingMethod
from shardd.idempotency.record import Claim, ClaimStatus, IdempotencyRecord, StoredOutcome

__all__ = [
    "Claim",
    "ClaimStatus",
    "IdempotencyConfig",
    "IdempotencyInterceptor",
    "IdempotencyRecord",
    "MutatingMethod",
    "StoredOutcome",
]
