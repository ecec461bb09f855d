"""The followed policy file (`shardd.authorization.PolicyFile`), without a server: what replaces the
policy in force, what is refused, and what the observer is told."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardrouter.shardd.authorization import PolicyFile
from shardrouter.shardd.authorization_policy import ALLOW_ALL_DOCUMENT, AuthzPolicy, AuthzPolicyError

CLOSED = '{"name": "closed", "allow_policies": []}'


class Observer:
    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []

    def observe_authz(self, method: str, allowed: bool) -> None:
        raise AssertionError("not a call")

    def observe_policy(self, result: str, policy: AuthzPolicy) -> None:
        self.loads.append((result, policy.name))


def test_changes_replace_the_policy_and_bad_files_do_not(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(ALLOW_ALL_DOCUMENT)
    seen = Observer()
    policies = PolicyFile(path, interval_s=60, observer=seen)
    assert policies.current.name == "allow-all" and seen.loads == [("loaded", "allow-all")]
    assert not policies.check()  # unchanged: nothing read again
    path.write_text(CLOSED)
    assert policies.check() and policies.current.name == "closed"
    for bad in ("{", '{"name": "x"}', "[]", '{"name": "x", "allow_policies": [{"name": 1}]}'):
        path.write_text(bad)
        assert not policies.check() and policies.current.name == "closed"
        assert not policies.check()  # the same bad file is reported once
    path.unlink()
    assert not policies.check() and policies.current.name == "closed"
    path.write_text(ALLOW_ALL_DOCUMENT)
    assert policies.check() and policies.current.name == "allow-all"
    assert seen.loads == [
        ("loaded", "allow-all"),
        ("loaded", "closed"),
        *[("refused", "closed")] * 5,
        ("loaded", "allow-all"),
    ]


def test_a_bad_file_at_start_is_fatal(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text('{"name": "p", "allow_policies": [], "deny_policies": [{"name": "d", "x": 1}]}')
    with pytest.raises(AuthzPolicyError, match=r"deny_policies\[0\]\.x: unknown key"):
        PolicyFile(path)
    with pytest.raises(AuthzPolicyError, match="cannot read the policy file"):
        PolicyFile(tmp_path / "missing.json")


def test_the_poll_follows_the_file(tmp_path: Path) -> None:
    import time

    path = tmp_path / "policy.json"
    path.write_text(ALLOW_ALL_DOCUMENT)
    policies = PolicyFile(path, interval_s=0.02)
    policies.start()
    try:
        path.write_text(CLOSED)
        deadline = time.monotonic() + 5
        while policies.current.name != "closed":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        policies.stop()
