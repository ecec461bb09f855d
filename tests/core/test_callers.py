"""One caller rule for the shard's key scopes, admission and the router: a verified name, a trusted
proxy's claim, or a claim in dev mode only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from shardrouter.core.callers import CALLER_METADATA, MAX_CALLER_LENGTH, CallerRule, claimed_caller
from shardrouter.core.errors import InvalidArgument, Unauthenticated
from shardrouter.router.metadata import CallerPolicy
from shardrouter.shardd.admission import Admission, AdmissionLimits, caller_bucket
from shardrouter.shardd.identity import ANONYMOUS, IdentityPolicy


@dataclass
class FakeContext:
    """What the rule reads of a servicer context: metadata, the peer, its certificate, TLS or not."""

    claim: str | None = None
    common_name: str | None = None
    tls: bool = False
    metadata: list[tuple[str, str | bytes]] = field(default_factory=list)

    def invocation_metadata(self) -> list[tuple[str, str | bytes]]:
        return [*self.metadata, *([(CALLER_METADATA, self.claim)] if self.claim is not None else [])]

    def auth_context(self) -> dict[str, list[bytes]]:
        auth = {"transport_security_type": [b"ssl" if self.tls else b"insecure"]}
        if self.common_name is not None:
            auth["x509_common_name"] = [self.common_name.encode()]
        return auth

    def peer(self) -> str:
        return "ipv4:10.0.0.7:51234"


PEER_HOST = "ipv4:10.0.0.7"


@pytest.mark.parametrize(
    ("dev_mode", "verified", "claimed", "caller"),
    [
        (False, None, "mallory", None),  # an unverified claim outside dev mode: not believed
        (True, None, "alice", "alice"),
        (True, None, None, None),
        (False, "bob", "mallory", "bob"),  # a verified caller cannot claim to be another
        (True, "bob", "mallory", "bob"),  # not even in dev mode
        (False, "router", "alice", "alice"),  # a trusted proxy speaks for its caller
        (False, "router", None, "router"),
    ],
)
def test_the_rule(dev_mode: bool, verified: str | None, claimed: str | None, caller: str | None) -> None:
    rule = CallerRule(dev_mode=dev_mode, trusted_proxies=frozenset({"router"}))
    assert rule.caller(verified, claimed) == caller


def test_admission_does_not_believe_the_entry_outside_dev_mode_from_an_untrusted_peer() -> None:
    """Before, admission counted a plaintext peer's `x-caller-id` even outside dev mode, so a
    caller could be counted as another (and shed in its place)."""
    trusted = frozenset({"router"})
    plaintext = FakeContext(claim="victim")
    assert caller_bucket(plaintext, trusted, dev_mode=False) == PEER_HOST  # type: ignore[arg-type]
    assert caller_bucket(plaintext, trusted, dev_mode=True) == "victim"  # type: ignore[arg-type]
    unverified_tls = FakeContext(claim="victim", tls=True)
    assert caller_bucket(unverified_tls, trusted, dev_mode=False) == PEER_HOST  # type: ignore[arg-type]
    verified = FakeContext(claim="victim", common_name="mallory", tls=True)
    assert caller_bucket(verified, trusted, dev_mode=False) == "mallory"  # type: ignore[arg-type]
    proxied = FakeContext(claim="alice", common_name="router", tls=True)
    assert caller_bucket(proxied, trusted, dev_mode=False) == "alice"  # type: ignore[arg-type]


def test_admission_counts_the_call_for_the_caller_of_the_rule() -> None:
    admission = Admission(
        AdmissionLimits(max_in_flight=1, max_waiting=0), frozenset({"router"}), dev_mode=False
    )
    context: Any = FakeContext(claim="victim")
    with admission.admitted(context):
        assert admission.limits._per_caller == {PEER_HOST: 1}


def test_the_shards_key_scope_follows_the_same_rule() -> None:
    policy = IdentityPolicy(dev_mode=False, trusted_proxies=frozenset({"router"}))
    context: Any = FakeContext(claim="alice", common_name="router", tls=True)
    assert policy.caller_of(context, context.invocation_metadata()) == "alice"
    context = FakeContext(claim="victim", common_name="mallory", tls=True)
    assert policy.caller_of(context, context.invocation_metadata()) == "mallory"
    context = FakeContext(claim="victim")
    with pytest.raises(Unauthenticated):
        policy.caller_of(context, context.invocation_metadata())
    dev = IdentityPolicy(dev_mode=True)
    context = FakeContext()
    assert dev.caller_of(context, context.invocation_metadata()) == ANONYMOUS
    context = FakeContext(claim="alice")
    assert dev.caller_of(context, context.invocation_metadata()) == "alice"


@pytest.mark.parametrize("value", ["", "-dash", "a" * (MAX_CALLER_LENGTH + 1), "with space"])
def test_a_malformed_entry_is_refused(value: str) -> None:
    with pytest.raises(InvalidArgument):
        claimed_caller([(CALLER_METADATA, value)])
    with pytest.raises(InvalidArgument):
        claimed_caller([(CALLER_METADATA, "a"), (CALLER_METADATA, "b")])


def test_the_router_forwards_a_verified_name_or_a_dev_mode_claim_and_nothing_else() -> None:
    verifying = CallerPolicy(verifies_callers=True, dev_mode=True)
    context: Any = FakeContext(claim="victim", common_name="mallory", tls=True, metadata=[("a", "1")])
    assert verifying.outgoing(context) == [("a", "1"), (CALLER_METADATA, "mallory")]
    dev = CallerPolicy(verifies_callers=False, dev_mode=True)
    assert dev.outgoing(FakeContext(claim="alice")) == [(CALLER_METADATA, "alice")]  # type: ignore[arg-type]
    with pytest.raises(Unauthenticated, match="ROUTER_TLS_CA"):
        CallerPolicy(verifies_callers=False, dev_mode=False).outgoing(FakeContext(claim="alice"))  # type: ignore[arg-type]
    with pytest.raises(Unauthenticated, match="requires a verified client certificate"):
        verifying.outgoing(FakeContext(claim="alice", tls=True))  # type: ignore[arg-type]
