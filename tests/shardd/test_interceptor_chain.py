"""The shard daemon's interceptor order and skips (`shardd.interceptor_chain`), without a server."""

from __future__ import annotations

from typing import cast

from shardrouter.core.error_interceptor import DomainErrorInterceptor
from shardrouter.core.interceptors import ServerInterceptorBase
from shardrouter.shardd.admission import Admission, AdmissionInterceptor, AdmissionLimits
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency import IdempotencyConfig, IdempotencyInterceptor, MutatingMethod
from shardrouter.shardd.identity import IdentityPolicy
from shardrouter.shardd.interceptor_chain import build_interceptors

DEPOSIT = "/shardrouter.v1.TransferService/Deposit"
TRANSFER = "/shardrouter.v1.TransferService/Transfer"
GET_BALANCE = "/shardrouter.v1.TransferService/GetBalance"
HEALTH = "/grpc.health.v1.Health/Check"


def _guard() -> IdempotencyInterceptor:
    return IdempotencyInterceptor(
        database=cast(Database, None),  # never reached: building touches no database
        methods=[MutatingMethod(DEPOSIT, lambda r: None), MutatingMethod(TRANSFER, lambda r: None)],
        config=IdempotencyConfig(),
        identity=IdentityPolicy(dev_mode=True),
    )


def _admission() -> Admission:
    return Admission(AdmissionLimits(max_in_flight=2, max_waiting=0), dev_mode=True)


class _Span(ServerInterceptorBase):
    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        return continuation(handler_call_details)


def test_span_first_then_admission_then_errors_then_the_guard_next_to_the_handlers() -> None:
    guard, span = _guard(), _Span()
    chain = build_interceptors(idempotency=guard, admission=_admission(), tracing=span)
    assert chain[0] is span and chain[-1] is guard
    assert [type(i) for i in chain[1:3]] == [AdmissionInterceptor, DomainErrorInterceptor]
    untraced = build_interceptors(idempotency=guard, admission=_admission())
    assert [type(i) for i in untraced] == [
        AdmissionInterceptor,
        DomainErrorInterceptor,
        IdempotencyInterceptor,
    ]


def test_each_method_is_admitted_and_answered_by_exactly_one_interceptor() -> None:
    guard = _guard()
    admission, errors, _ = build_interceptors(idempotency=guard, admission=_admission())
    assert isinstance(admission, AdmissionInterceptor) and isinstance(errors, DomainErrorInterceptor)
    assert guard.guarded_methods == {DEPOSIT, TRANSFER}
    for path in (DEPOSIT, TRANSFER):  # the guard admits them (after its memory) and answers them
        assert guard.applies_to(path)
        assert not admission.applies_to(path) and not errors.applies_to(path)
    assert not guard.applies_to(GET_BALANCE)
    assert admission.applies_to(GET_BALANCE) and errors.applies_to(GET_BALANCE)
    assert not admission.applies_to(HEALTH)  # never shed
