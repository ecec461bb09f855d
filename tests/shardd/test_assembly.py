"""The shard daemon's composition root, as `start_shard` builds it: every declared RPC meets the right interceptors."""

from __future__ import annotations

from shardrouter.core.lifecycle import stop_all
from shardrouter.core.rpcs import RPCS
from shardrouter.core.tracing import server_interceptor
from shardrouter.shardd.admission import AdmissionInterceptor
from shardrouter.shardd.error_interceptor import DomainErrorInterceptor
from shardrouter.shardd.idempotency import IdempotencyInterceptor
from shardrouter.shardd.interceptor_chain import build_interceptors
from shardrouter.shardd.ledger.service import ShardLocator
from shardrouter.shardd.server import (
    admission_from,
    new_database,
    new_idempotency_interceptor,
)
from tests.helpers import make_settings

_DSN = "postgresql://nobody@127.0.0.1:1/none"  # never opened: building touches no database


def _chain(traced: bool):
    settings = make_settings(_DSN)
    admission = admission_from(settings)
    guard = new_idempotency_interceptor(
        settings, new_database(settings), ShardLocator(settings.shard_id), admission, listeners=(), tracer=None
    )
    return guard, build_interceptors(
        idempotency=guard, admission=admission, tracing=server_interceptor(None) if traced else None
    )


def test_the_chain_runs_span_admission_errors_then_the_guard_next_to_the_handlers() -> None:
    guard, chain = _chain(traced=True)
    assert [type(i) for i in chain[1:]] == [AdmissionInterceptor, DomainErrorInterceptor, IdempotencyInterceptor]
    assert chain[-1] is guard
    _, untraced = _chain(traced=False)
    assert [type(i) for i in untraced] == [AdmissionInterceptor, DomainErrorInterceptor, IdempotencyInterceptor]


def test_each_declared_rpc_is_taken_by_exactly_one_admission_and_one_error_answer() -> None:
    _, chain = _chain(traced=False)
    admission, errors, guard = chain
    for declaration in RPCS:
        path = declaration.full_name
        # Keyed calls: the guard admits them (after its answers from memory) and answers their errors.
        assert guard.applies_to(path) is declaration.keyed
        assert admission.applies_to(path) is not declaration.keyed
        assert errors.applies_to(path) is not declaration.keyed
    assert not admission.applies_to("/grpc.health.v1.Health/Check")


def test_background_parts_stop_in_reverse_order_of_their_start() -> None:
    stopped: list[str] = []

    class Part:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            stopped.append(self.name)

    stop_all([Part("map"), Part("keeper"), Part("relay")])
    assert stopped == ["relay", "keeper", "map"]
