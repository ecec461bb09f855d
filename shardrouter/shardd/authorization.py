"""The shard daemon's authorization: the policy file it follows, and the interceptor that enforces it.

`PolicyFile` holds the policy in force (`authorization_policy`), re-read from its file without a restart: polled
every `interval_s`, the file's bytes hashed, a changed file parsed and swapped in as a whole; a bad new
file is refused with a WARNING and the last good policy stays (as the shard map's follower does,
`core.shardmap_file`). Each reload is counted by result (`shardd_authz_policy_reloads_total{result}`),
and the policy in force is named by `shardd_authz_policy_info{name,hash}`.

`AuthorizationInterceptor` runs outside admission and the idempotency interceptor
(`interceptor_chain.py`), for every method of TransferService and ShardLedgerService, reads too: a
denied call takes no admission slot, is never claimed, replayed or stored. The caller is the one the
key scope uses (`IdentityPolicy.caller_of`: a verified certificate's identity, or a trusted proxy's
`x-caller-id`); the account is the request's routing field (`core.rpcs`), decoded when the policy
matches on accounts (or to name it in a denial). A denial is PERMISSION_DENIED with reason
PERMISSION_DENIED, naming caller, method and account (never the request), counted in
`shardd_authz_decisions_total{method,outcome}` and logged at WARNING.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import grpc

from shardrouter.core.errors import PermissionDenied, Reason, ShardRouterError
from shardrouter.core.interceptors import MethodHandler, UnaryInterceptor
from shardrouter.core.lifecycle import Poller
from shardrouter.core.rpcs import RPCS_BY_PATH, RpcDeclaration
from shardrouter.core.status import abort_with_error
from shardrouter.shardd.authorization_policy import (
    MAX_POLICY_BYTES,
    AuthzPolicy,
    AuthzPolicyError,
    Decision,
    load_policy_file,
)
from shardrouter.shardd.error_interceptor import decode_request
from shardrouter.shardd.identity import IdentityPolicy

log = logging.getLogger(__name__)

__all__ = ["AuthorizationInterceptor", "AuthzObserver", "PolicyFile"]


class AuthzObserver(Protocol):
    """Where decisions and reloads are counted (`ShardMetrics`)."""

    def observe_authz(self, method: str, allowed: bool) -> None:
        """One call decided."""

    def observe_policy(self, result: str, policy: AuthzPolicy) -> None:
        """One load of the policy file (`result`: loaded | refused); `policy` is the one in force."""


class PolicyFile(Poller):
    """The authorization policy in force, followed in its file without a restart."""

    def __init__(
        self, path: str | Path, *, interval_s: float = 1.0, observer: AuthzObserver | None = None
    ) -> None:
        super().__init__(interval_s, "authz-policy-reload")
        self._path = Path(path)
        self._observer = observer
        self._lock = threading.Lock()
        # Raises AuthzPolicyError: at start-up a bad file is fatal, there is no last good policy.
        self._policy = load_policy_file(self._path)
        self._seen = self._raw()
        if observer is not None:
            observer.observe_policy("loaded", self._policy)

    @property
    def path(self) -> Path:
        """The policy file."""
        return self._path

    @property
    def current(self) -> AuthzPolicy:
        """The policy in force (replaced as a whole)."""
        return self._policy

    def check(self) -> bool:
        """Reload if the file's content changed; True when a new policy took effect."""
        with self._lock:
            raw = self._raw()
            if raw == self._seen:
                return False
            self._seen = raw  # a bad file is reported once, not at every poll
            try:
                new = load_policy_file(self._path)
            except AuthzPolicyError as exc:
                log.warning(
                    "authorization policy reload refused, keeping policy %r (hash %s): %s",
                    self._policy.name,
                    self._policy.digest,
                    exc,
                    extra={"path": str(self._path)},
                )
                self._observe("refused")
                return False
            self._policy = new
        log.info(
            "authorization policy loaded: %r (hash %s), %d deny and %d allow policies",
            new.name,
            new.digest,
            len(new.deny),
            len(new.allow),
            extra={"path": str(self._path)},
        )
        self._observe("loaded")
        return True

    def _observe(self, result: str) -> None:
        if self._observer is not None:
            self._observer.observe_policy(result, self._policy)

    def _raw(self) -> bytes | None:
        try:
            with self._path.open("rb") as f:  # no more than the loader reads: a huge file is refused
                return f.read(MAX_POLICY_BYTES + 1)
        except OSError:
            return None  # gone for a moment (a ConfigMap's swap) or unreadable: the load says why



def _short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


class AuthorizationInterceptor(UnaryInterceptor):
    """Refuses, before admission and the idempotency claim, every call the policy does not allow."""

    def __init__(
        self,
        policy: Callable[[], AuthzPolicy],
        identity: IdentityPolicy,
        observer: AuthzObserver | None = None,
    ) -> None:
        super().__init__()
        self._policy = policy
        self._identity = identity
        self._observer = observer

    def applies_to(self, method: str) -> bool:
        """Every method of the public and the shard-to-shard API (not health, not reflection)."""
        return method in RPCS_BY_PATH

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The handler behind the policy's decision; it sees what the handler below it sees."""
        behaviour = handler.unary_unary
        assert behaviour is not None
        declaration = RPCS_BY_PATH[method]
        # The handler below decodes the request itself (the idempotency interceptor, the error
        # mapping take bytes) or has grpc decode it: decode here with its decoder when it has one,
        # and hand on the decoded request; else decode a copy with the declared request type.
        below = handler.request_deserializer
        decode: Callable[[bytes], Any] = below if below is not None else declaration.request_type.FromString

        def account_of(request: Any) -> str | None:
            return str(getattr(request, declaration.routing_field)) or None

        def authorized(raw: Any, context: grpc.ServicerContext) -> Any:
            request: Any = None
            try:
                policy = self._policy()
                caller = self._identity.caller_of(context, context.invocation_metadata())
                if below is not None or policy.uses_accounts:
                    request = decode_request(decode, raw, method)
                decision = policy.decide(
                    caller, declaration.full_name, None if request is None else account_of(request)
                )
                if self._observer is not None:
                    self._observer.observe_authz(declaration.name, decision.allowed)
                if not decision.allowed:
                    # The refusal names the account even when the policy did not need it.
                    shown = account_of(request if request is not None else decode_request(decode, raw, method))
                    raise _denial(policy, decision, caller, declaration, shown)
            except ShardRouterError as error:
                abort_with_error(context, error)
            return behaviour(request if below is not None else raw, context)

        return grpc.unary_unary_rpc_method_handler(
            authorized, response_serializer=handler.response_serializer
        )


def _denial(
    policy: AuthzPolicy, decision: Decision, caller: str, declaration: RpcDeclaration, account: str | None
) -> PermissionDenied:
    """The refusal of a call the policy denies, logged at WARNING (never with the request's content)."""
    shown = _shown(account) if account else ""
    on = f" on account {shown}" if shown else ""
    log.warning(
        "call refused by authorization policy %r: caller %s may not call %s%s",
        policy.name,
        caller,
        declaration.full_name,
        on,
        extra={
            "caller": caller,
            "method": declaration.full_name,
            "account": shown,
            "policy": policy.name,
            "rule": decision.rule or "",
        },
    )
    return PermissionDenied(
        f"caller {caller} may not call {declaration.full_name}{on} (authorization policy "
        f"{policy.name!r}); nothing was applied",
        reason=Reason.PERMISSION_DENIED,
        metadata={"caller": caller, "method": declaration.full_name, **({"account": shown} if shown else {})},
    )


#: Longest account shown in a denial: a request may carry any string; its status travels in trailers.
_SHOWN_ACCOUNT = 128


def _shown(account: str) -> str:
    """The account as a denial names it: control characters escaped (a log line stays one line), cut short."""
    if not account.isprintable():
        account = account.encode("unicode_escape").decode("ascii")
    return account if len(account) <= _SHOWN_ACCOUNT else account[:_SHOWN_ACCOUNT] + "..."
