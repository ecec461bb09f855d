"""What happened to one guarded call: its outcome kind, reported to listeners (metrics) and logged.

The kind (`OutcomeKind`, declared with the other wire names in `core.wire_names` because the router's
HTTP front reads it too) is one vocabulary from the interceptor to the span attribute
`idempotency.outcome`, the `idempotency-outcome` trailer, the `outcome` label of
`shardd_requests_total` and the call log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from shardrouter.core.wire_names import OutcomeKind

log = logging.getLogger(__name__)
#: The per-call log (one line per guarded call); its own name so it can be silenced or routed apart.
_calls_log = logging.getLogger("shardd.calls")


@dataclass(frozen=True)
class CallOutcome:
    """What happened to one guarded call, for metrics and traces."""

    method: str
    scope: str
    key: str
    outcome: OutcomeKind
    code: grpc.StatusCode
    #: Seconds from the call reaching the interceptor to its outcome being known.
    duration_s: float = 0.0


OutcomeListener = Callable[[CallOutcome], None]


class OutcomeReport:
    """Tells the listeners and the call log about each guarded call."""

    def __init__(self, listeners: Sequence[OutcomeListener] = ()) -> None:
        self._listeners = tuple(listeners)

    def __call__(self, outcome: CallOutcome) -> None:
        """Report one call (inside its span, so the log line carries its trace and span ids)."""
        level = logging.WARNING if outcome.outcome is OutcomeKind.ERROR else logging.INFO
        if _calls_log.isEnabledFor(level):  # nothing is built when the call log is off
            _log_call(level, outcome)
        for listener in self._listeners:
            try:
                listener(outcome)
            except Exception:  # a broken metrics hook must never change an answer
                log.exception("idempotency outcome listener failed")


def _log_call(level: int, outcome: CallOutcome) -> None:
    # The key and the outcome, never the request or the stored response.
    _calls_log.log(
        level,
        "%s %s: %s",
        outcome.method.rsplit("/", 1)[-1],
        outcome.outcome.value,
        outcome.code.name,
        extra={
            "key": outcome.key,
            "scope": outcome.scope,
            "outcome": outcome.outcome.value,
            "code": outcome.code.name,
            "duration_ms": round(outcome.duration_s * 1000, 3),
        },
    )


__all__ = ["CallOutcome", "OutcomeKind", "OutcomeListener", "OutcomeReport"]
