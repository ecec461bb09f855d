"""Admission control: shed load before it reaches the database pool.

A retry storm must not queue hundreds of calls behind the pool's connections (each holding a worker
thread until its deadline). Two bounds, both answered at once with RetryInfo:
- calls in flight per caller (RESOURCE_EXHAUSTED, reason RATE_LIMITED): one noisy caller cannot take
  every connection from the others;
- calls in flight in total (UNAVAILABLE, reason DATABASE_BUSY): beyond what the pool can serve soon.
Health and reflection are never shed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from shardrouter.errors import Reason, ResourceExhausted, ShardRouterError, Unavailable, to_grpc_status
from shardrouter.grpcserver import MethodHandler, UnaryInterceptor, with_behaviour

_EXEMPT_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
CALLER_METADATA = "x-caller-id"


class AdmissionLimits:
    """Counters of calls in flight, in total and per caller."""

    def __init__(self, *, max_in_flight: int, max_per_caller: int, retry_after_ms: int = 200) -> None:
        if max_in_flight < 1 or max_per_caller < 1:
            raise ValueError("admission limits must be at least 1")
        self.max_in_flight = max_in_flight
        self.max_per_caller = max_per_caller
        self.retry_after_ms = retry_after_ms
        self._lock = threading.Lock()
        self._total = 0
        self._per_caller: dict[str, int] = defaultdict(int)

    @contextmanager
    def admit(self, caller: str) -> Iterator[None]:
        """Hold one slot for the call, or raise at once if none is free."""
        self.acquire(caller)
        try:
            yield
        finally:
            self.release(caller)

    def acquire(self, caller: str) -> None:
        """Take a slot for `caller` or raise ResourceExhausted / Unavailable."""
        with self._lock:
            if self._per_caller[caller] >= self.max_per_caller:
                raise ResourceExhausted(
                    f"caller {caller} already has {self.max_per_caller} calls in flight on this shard; "
                    "slow down and retry with the same idempotency key",
                    reason=Reason.RATE_LIMITED,
                    retry_after_ms=self.retry_after_ms,
                )
            if self._total >= self.max_in_flight:
                raise Unavailable(
                    f"the shard is at its limit of {self.max_in_flight} calls in flight; nothing was applied, "
                    "retry with the same idempotency key",
                    reason=Reason.DATABASE_BUSY,
                    retry_after_ms=self.retry_after_ms,
                )
            self._total += 1
            self._per_caller[caller] += 1

    def release(self, caller: str) -> None:
        """Give back a slot taken by `acquire`."""
        with self._lock:
            self._total -= 1
            self._per_caller[caller] -= 1
            if not self._per_caller[caller]:
                del self._per_caller[caller]


class AdmissionInterceptor(UnaryInterceptor):
    """Applies `AdmissionLimits` to every unary method but health and reflection.

    The caller key here is the claimed `x-caller-id` or the peer address: a cheap, pre-authentication
    bucket. Identity for key scopes is decided later by the idempotency interceptor.
    """

    def __init__(self, limits: AdmissionLimits, trusted_proxies: frozenset[str] = frozenset()) -> None:
        self._limits = limits
        self._trusted = trusted_proxies

    def applies_to(self, method: str) -> bool:
        """Everything but health and reflection."""
        return not method.startswith(_EXEMPT_PREFIXES)

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The handler behind an admission check."""
        behaviour = handler.unary_unary
        assert behaviour is not None
        limits, trusted = self._limits, self._trusted

        def admitted(request: Any, context: grpc.ServicerContext) -> Any:
            caller = _bucket(context, trusted)
            try:
                limits.acquire(caller)
            except ShardRouterError as error:
                context.abort_with_status(to_grpc_status(error))
                raise AssertionError("unreachable") from None
            try:
                return behaviour(request, context)
            finally:
                limits.release(caller)

        return with_behaviour(handler, admitted)


def _bucket(context: grpc.ServicerContext, trusted: frozenset[str]) -> str:
    """Verified certificate name; a trusted proxy's or a plaintext peer's claimed caller; the peer host."""
    claimed = next(
        (v[:128] for k, v in context.invocation_metadata() if k == CALLER_METADATA and isinstance(v, str)),
        None,
    )
    names = context.auth_context().get("x509_common_name")
    if names:
        first = names if isinstance(names, bytes) else next(iter(names))
        verified = first.decode("utf-8", "replace")
        return claimed if claimed and verified in trusted else verified
    return claimed or context.peer().rsplit(":", 1)[0]
