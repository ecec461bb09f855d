"""Admission control: shed load only when the shard is saturated, and then the heaviest caller first.

A retry storm must not queue hundreds of calls behind the pool's connections (each holding a worker
thread until its deadline), but an ordinary client sending many calls at once must not be throttled
while the shard has room. So:
- below `max_in_flight` calls in flight (the pool's size: what the database serves at once) every
  call is admitted, whoever sends it;
- at or above it the shard is saturated: a caller already holding its fair share
  (`max_in_flight` / callers in flight) is refused with RESOURCE_EXHAUSTED (reason RATE_LIMITED); a
  caller under its share is still admitted, up to `max_waiting` calls beyond saturation, which wait
  for a connection in the pool's queue;
- past `max_in_flight + max_waiting` every call is refused with UNAVAILABLE (reason SHARD_SATURATED).
Both refusals carry RetryInfo and apply nothing. A flooding caller is thus the one refused, and callers
sending at a modest rate are not (tests/shardd/test_admission.py measures it).

Which caller a call counts for: the caller by the rule every part follows (`core.callers.CallerRule`):
the verified client certificate's name, a trusted proxy's (the router's) `x-caller-id`, an unverified
peer's `x-caller-id` in dev mode only; else the peer's address. Calls that a
shard answers without its database (an in-flight duplicate, a replay from memory) are never counted:
the idempotency interceptor admits its calls itself, after those answers. Health and reflection are
never shed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from shardrouter.core.callers import CALLER_METADATA, MAX_CALLER_LENGTH, CallerRule, peer_identity
from shardrouter.core.errors import Reason, ResourceExhausted, ShardRouterError, Unavailable
from shardrouter.core.interceptors import MethodHandler, UnaryInterceptor, with_behaviour
from shardrouter.core.status import abort_with_error

__all__ = ["Admission", "AdmissionInterceptor", "AdmissionLimits", "caller_bucket"]

_EXEMPT_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class AdmissionLimits:
    """Counters of calls in flight, in total and per caller, with the fair-share rule."""

    def __init__(self, *, max_in_flight: int, max_waiting: int, retry_after_ms: int = 200) -> None:
        if max_in_flight < 1 or max_waiting < 0:
            raise ValueError("max_in_flight must be at least 1 and max_waiting not negative")
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self.retry_after_ms = retry_after_ms
        self._lock = threading.Lock()
        self._total = 0
        self._per_caller: dict[str, int] = defaultdict(int)

    def acquire(self, caller: str) -> None:
        """Take a slot for `caller` or raise ResourceExhausted / Unavailable."""
        with self._lock:
            if self._total >= self.max_in_flight:
                self._refuse_if_over(caller)
            self._total += 1
            self._per_caller[caller] += 1

    def _refuse_if_over(self, caller: str) -> None:
        limit = self.max_in_flight + self.max_waiting
        if self._total >= limit:
            raise Unavailable(
                f"the shard is saturated ({self._total} calls in flight, limit {limit}); nothing was "
                "applied, retry with the same idempotency key",
                reason=Reason.SHARD_SATURATED,
                retry_after_ms=self.retry_after_ms,
            )
        held = self._per_caller.get(caller, 0)
        callers = len(self._per_caller) + (0 if held else 1)
        share = max(1, self.max_in_flight // callers)
        if held >= share:
            raise ResourceExhausted(
                f"the shard is saturated ({self._total} calls in flight) and caller {caller} holds {held} "
                f"of them, at least its fair share of {share} among {callers} callers; nothing was applied, "
                "slow down and retry with the same idempotency key",
                reason=Reason.RATE_LIMITED,
                retry_after_ms=self.retry_after_ms,
                metadata={"caller": caller, "in_flight": str(held), "fair_share": str(share)},
            )

    def release(self, caller: str) -> None:
        """Give back a slot taken by `acquire`."""
        with self._lock:
            self._total -= 1
            self._per_caller[caller] -= 1
            if not self._per_caller[caller]:
                del self._per_caller[caller]

    @property
    def in_flight(self) -> int:
        """Calls holding a slot now."""
        return self._total


class Admission:
    """`AdmissionLimits` applied to gRPC calls: which caller a call counts for, and its slot."""

    def __init__(
        self,
        limits: AdmissionLimits,
        trusted_proxies: frozenset[str] = frozenset(),
        *,
        dev_mode: bool,
    ) -> None:
        self.limits = limits
        self.trusted = trusted_proxies
        #: Whether the daemon runs in dev mode: only then is an unverified peer's x-caller-id believed.
        self.dev_mode = dev_mode

    @contextmanager
    def admitted(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Hold a slot for the call while the block runs; raises at once if it is shed."""
        caller = caller_bucket(context, self.trusted, dev_mode=self.dev_mode)
        self.limits.acquire(caller)
        try:
            yield
        finally:
            self.limits.release(caller)


class AdmissionInterceptor(UnaryInterceptor):
    """Applies `Admission` to every unary method but health, reflection and `skip` (methods that
    admit their calls themselves: the idempotency interceptor's)."""

    def __init__(self, admission: Admission, skip: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self._admission = admission
        self._skip = skip

    def applies_to(self, method: str) -> bool:
        """Everything but health, reflection and the skipped methods."""
        return not method.startswith(_EXEMPT_PREFIXES) and method not in self._skip

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The handler behind an admission check."""
        behaviour = handler.unary_unary
        assert behaviour is not None
        limits, trusted, dev_mode = self._admission.limits, self._admission.trusted, self._admission.dev_mode

        def admitted(request: Any, context: grpc.ServicerContext) -> Any:
            caller = caller_bucket(context, trusted, dev_mode=dev_mode)
            try:
                limits.acquire(caller)
            except ShardRouterError as error:
                abort_with_error(context, error)
            try:
                return behaviour(request, context)
            finally:
                limits.release(caller)

        return with_behaviour(handler, admitted)


def caller_bucket(
    context: grpc.ServicerContext, trusted: frozenset[str], *, dev_mode: bool
) -> str:
    """The caller by `CallerRule`, else the peer host."""
    rule = CallerRule(dev_mode, trusted)
    # Never refused here: a malformed entry is refused by the key's scope check, a read is not scoped.
    claimed = next(
        (v[:MAX_CALLER_LENGTH] for k, v in context.invocation_metadata() if k == CALLER_METADATA and isinstance(v, str)),
        None,
    )
    return rule.caller(peer_identity(context), claimed or None) or context.peer().rsplit(":", 1)[0]
