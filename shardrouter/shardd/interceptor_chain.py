"""The order of the shard daemon's server interceptors, and which methods each one takes.

Outermost first:
1. the SERVER span (when tracing is on), so it covers everything below;
2. authorization (`authorization.py`, when a policy is in force) for every method of both services,
   reads too: a denied call takes no admission slot and never reaches the claim;
3. admission for the methods the idempotency interceptor does not guard: a shed call costs no
   connection (guarded calls are admitted by the idempotency interceptor itself, after the answers
   it gives from memory, which take no slot);
4. the domain-error mapping for the same unguarded methods (the guarded ones answer their own errors,
   since their outcome is stored and replayed);
5. the idempotency interceptor, next to the handlers.
The skip sets are the guard's own list of methods, so the three can never disagree about a method.
"""

from __future__ import annotations

from shardrouter.core.interceptors import ServerInterceptorBase
from shardrouter.shardd.admission import Admission, AdmissionInterceptor
from shardrouter.shardd.authorization import AuthorizationInterceptor
from shardrouter.shardd.error_interceptor import DomainErrorInterceptor
from shardrouter.shardd.idempotency import IdempotencyInterceptor


def build_interceptors(
    *,
    idempotency: IdempotencyInterceptor,
    admission: Admission,
    tracing: ServerInterceptorBase | None = None,
    authorization: AuthorizationInterceptor | None = None,
) -> list[ServerInterceptorBase]:
    """The daemon's interceptors, outermost first (see the module's docstring for the order)."""
    guarded = idempotency.guarded_methods
    chain: list[ServerInterceptorBase] = [] if tracing is None else [tracing]
    if authorization is not None:
        chain.append(authorization)
    chain += [
        AdmissionInterceptor(admission, skip=guarded),
        DomainErrorInterceptor(skip=guarded),
        idempotency,
    ]
    return chain


__all__ = ["build_interceptors"]
