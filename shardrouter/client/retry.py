"""When to send again, and how long to wait first: the retry rules of `send_with_retries`.

Sending again is safe only because every attempt carries the operation's one idempotency key. So
the rules are about usefulness, not safety:

- OK: done (SUCCEEDED).
- UNAVAILABLE, DEADLINE_EXCEEDED: nothing known to be applied; back off (full jitter) and resend.
- ABORTED: the same key is in flight on the shard; wait the server's `RetryInfo` delay (fallback:
  the `grpc-retry-pushback-ms` trailer, then backoff) and resend - the resend normally replays.
- RESOURCE_EXHAUSTED with a server delay (RetryInfo or pushback): wait that long and resend; without
  one it is a final refusal.
- FAILED_PRECONDITION with reason IDEMPOTENCY_KEY_EXPIRED: NEEDS_RECONCILIATION (the shard can no
  longer tell whether the key was applied).
- UNKNOWN, INTERNAL, CANCELLED, DATA_LOSS: stop, but leave the operation PENDING. The effect may or
  may not have happened; only a later resend with the same key (`resume_pending`) can tell, and
  hammering a failing server in a loop would not help.
- everything else (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, PERMISSION_DENIED, ...): a final
  answer (FAILED); recorded and never resent.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import grpc

from shardrouter.client.operation import OperationState
from shardrouter.client.status import ErrorDetails
from shardrouter.core.errors import Reason

__all__ = ["RetryPolicy", "Verdict", "backoff_s", "classify", "server_delay_s"]

_BACKOFF_RETRY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_UNCERTAIN = frozenset(
    {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED, grpc.StatusCode.DATA_LOSS}
)


class Verdict(enum.Enum):
    """What to do after one attempt."""

    SUCCEEDED = "succeeded"
    RETRY = "retry"
    FAILED = "failed"
    NEEDS_RECONCILIATION = "needs_reconciliation"
    STOP_PENDING = "stop_pending"

    @property
    def state(self) -> OperationState:
        """The operation state this verdict leaves behind."""
        return {
            Verdict.SUCCEEDED: OperationState.SUCCEEDED,
            Verdict.FAILED: OperationState.FAILED,
            Verdict.NEEDS_RECONCILIATION: OperationState.NEEDS_RECONCILIATION,
        }.get(self, OperationState.PENDING)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Timing of `send_with_retries`: per-attempt deadline, overall budget, backoff bounds (seconds)."""

    attempt_timeout_s: float = 2.0
    budget_s: float = 30.0
    base_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if min(self.attempt_timeout_s, self.budget_s) <= 0:
            raise ValueError("attempt_timeout_s and budget_s must be positive")
        if not 0 <= self.base_backoff_s <= self.max_backoff_s:
            raise ValueError("backoff bounds must satisfy 0 <= base_backoff_s <= max_backoff_s")


def classify(code: grpc.StatusCode, details: ErrorDetails, server_delay: float | None) -> Verdict:
    """The verdict for one attempt's answer (see the module docstring)."""
    if code is grpc.StatusCode.OK:
        return Verdict.SUCCEEDED
    if code in _BACKOFF_RETRY or code is grpc.StatusCode.ABORTED:
        return Verdict.RETRY
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Verdict.RETRY if server_delay is not None else Verdict.FAILED
    if code is grpc.StatusCode.FAILED_PRECONDITION and details.reason == Reason.IDEMPOTENCY_KEY_EXPIRED:
        return Verdict.NEEDS_RECONCILIATION
    if code in _UNCERTAIN:
        return Verdict.STOP_PENDING
    return Verdict.FAILED


def server_delay_s(details: ErrorDetails, pushback: float | None) -> float | None:
    """The wait the server asked for: RetryInfo first, then the pushback trailer."""
    return details.retry_delay_s if details.retry_delay_s is not None else pushback


def backoff_s(retry_number: int, policy: RetryPolicy, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(max, base * 2**(n-1))] for retry n >= 1."""
    ceiling = min(policy.max_backoff_s, policy.base_backoff_s * 2 ** max(0, retry_number - 1))
    return rng.uniform(0, ceiling)
