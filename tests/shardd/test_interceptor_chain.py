"""The shard daemon's interceptor order and skips (`shardd.interceptor_chain`), without a server."""

from __future__ import annotations

from typing import cast

import grpc
import pytest

from shardrouter.core.interceptors import ServerInterceptorBase
from shardrouter.shardd.admission import Admission, AdmissionInterceptor, AdmissionLimits
from shardrouter.shardd.authorization import AuthorizationInterceptor
from shardrouter.shardd.authorization_policy import ALLOW_ALL_DOCUMENT, parse_policy_text
from shardrouter.shardd.db import Database
from shardrouter.shardd.error_interceptor import DomainErrorInterceptor
from shardrouter.shardd.idempotency import IdempotencyConfig, IdempotencyInterceptor, MutatingMethod
from shardrouter.shardd.identity import IdentityPolicy
from shardrouter.shardd.interceptor_chain import build_interceptors
from shardrouter.v1 import transfer_pb2

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


def test_authorization_comes_after_the_span_and_before_admission() -> None:
    guard, span = _guard(), _Span()
    authz = AuthorizationInterceptor(
        lambda: parse_policy_text(ALLOW_ALL_DOCUMENT), IdentityPolicy(dev_mode=True)
    )
    chain = build_interceptors(idempotency=guard, admission=_admission(), tracing=span, authorization=authz)
    assert chain[:2] == [span, authz] and isinstance(chain[2], AdmissionInterceptor)
    for path in (
        DEPOSIT,
        TRANSFER,
        GET_BALANCE,
        "/shardrouter.internal.v1.ShardLedgerService/CreditTransfer",
    ):
        assert authz.applies_to(path)  # every method of both services, reads too
    assert not authz.applies_to(HEALTH) and not authz.applies_to("/grpc.reflection.v1.ServerReflection/X")


class _Aborted(Exception):
    pass


class _Context:
    """Just enough of a servicer context for a call that is answered before any handler runs."""

    def __init__(self, caller: str) -> None:
        self.metadata = (("x-caller-id", caller),)
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def auth_context(self) -> dict[str, object]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort_with_status(self, status: grpc.Status) -> None:
        self.code = status.code
        raise _Aborted


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def test_a_denied_call_never_takes_an_admission_slot() -> None:
    """With the shard saturated, an allowed call is shed by admission, a denied one is refused first."""
    limits = AdmissionLimits(max_in_flight=1, max_waiting=0)
    reached: list[object] = []
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: reached.append(request),
        request_deserializer=transfer_pb2.GetBalanceRequest.FromString,
    )
    details = _Details(GET_BALANCE)
    admitted = AdmissionInterceptor(Admission(limits, dev_mode=True)).intercept_service(
        lambda d: handler, details
    )  # type: ignore[arg-type]
    policy = parse_policy_text(
        '{"name": "p", "allow_policies": [{"name": "svc", "source": {"principals": ["svc"]},'
        ' "request": {"accounts": ["a-*"]}}]}'
    )
    authz = AuthorizationInterceptor(lambda: policy, IdentityPolicy(dev_mode=True))
    outer = authz.intercept_service(lambda d: admitted, details)  # type: ignore[arg-type]
    assert outer is not None and outer.unary_unary is not None and outer.request_deserializer is None
    limits.acquire("someone else")  # saturated: the next admitted call is shed
    body = transfer_pb2.GetBalanceRequest(account_id="b-1").SerializeToString()
    for caller, account, code in (
        ("svc", "b-1", grpc.StatusCode.PERMISSION_DENIED),
        ("mallory", "a-1", grpc.StatusCode.PERMISSION_DENIED),
        ("svc", "a-1", grpc.StatusCode.UNAVAILABLE),  # allowed, so it meets admission
    ):
        context = _Context(caller)
        body = transfer_pb2.GetBalanceRequest(account_id=account).SerializeToString()
        with pytest.raises(_Aborted):
            outer.unary_unary(body, context)
        assert context.code == code, (caller, account)
    assert limits.in_flight == 1 and not reached
    limits.release("someone else")
    outer.unary_unary(body, _Context("svc"))
    assert reached == [transfer_pb2.GetBalanceRequest(account_id="a-1")] and limits.in_flight == 0
