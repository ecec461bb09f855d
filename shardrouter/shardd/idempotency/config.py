"""Settings of the idempotency mechanism, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from shardrouter.shardd.idempotency.placement import CLAIM_PLACEMENTS


@dataclass(frozen=True, kw_only=True)
class IdempotencyConfig:
    """How keys are claimed, answered and expired."""

    #: Keys older than this are refused as expired; their partitions are dropped by retention.
    retention: timedelta = timedelta(days=30)
    #: Keys dated further in the future than this are refused (caller clock skew).
    max_clock_skew: timedelta = timedelta(minutes=5)
    #: How long a duplicate in this process waits for its twin's claim (ms). The claim itself never
    #: waits: it only tries the key's advisory lock.
    claim_lock_timeout_ms: int = 50
    #: Lock wait allowed to the handler after the claim (hot account rows).
    handler_lock_timeout_ms: int = 2000
    #: Delay suggested in RetryInfo when the same key is in flight. (The delay after a transient
    #: database failure is the `Database`'s, which maps those failures.)
    in_flight_retry_ms: int = 100
    #: Refuse every key but a UUIDv7 (INVALID_ARGUMENT): only a key that dates itself lets a retry
    #: that comes after its record was dropped be refused as expired instead of applied again.
    require_uuidv7: bool = False
    #: Longest a duplicate that asked to wait for its original in flight waits (ms); a longer ask is
    #: capped to it, and 0 turns waiting off (every duplicate in flight is answered ABORTED at once).
    max_duplicate_wait_ms: int = 10_000
    #: A waiting duplicate ends a claim whose session has waited this long on its stalled daemon (ms),
    #: and runs the call itself; 0: never.
    stalled_claim_ms: int = 0
    #: Where a UUIDv7 key's claim goes (`placement.CLAIM_PLACEMENTS`): with the handler's first
    #: statements while few claims are duplicates (`adaptive`), always on its own (`first`), or
    #: always with the handler (`ahead`).
    claim_placement: str = "adaptive"

    def __post_init__(self) -> None:
        if self.retention <= timedelta(0):
            raise ValueError("retention must be positive")
        if self.max_clock_skew < timedelta(0):
            raise ValueError("max_clock_skew must not be negative")
        for name in ("claim_lock_timeout_ms", "handler_lock_timeout_ms", "in_flight_retry_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.claim_placement not in CLAIM_PLACEMENTS:
            raise ValueError(f"claim_placement must be one of {', '.join(CLAIM_PLACEMENTS)}")
        if self.max_duplicate_wait_ms < 0 or self.stalled_claim_ms < 0:
            raise ValueError("max_duplicate_wait_ms and stalled_claim_ms must not be negative")


__all__ = [
    "IdempotencyConfig",
]
