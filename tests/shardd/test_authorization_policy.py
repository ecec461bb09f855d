"""The authorization policy (`shardd.authorization_policy`): gRFC A43 semantics, the account extension, strict loading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardrouter.shardd.authorization_policy import (
    ALLOW_ALL_DOCUMENT,
    MAX_POLICY_BYTES,
    AuthzPolicyError,
    Pattern,
    load_policy_file,
    parse_policy,
    parse_policy_text,
)

TRANSFER = "/shardrouter.v1.TransferService/Transfer"
DEPOSIT = "/shardrouter.v1.TransferService/Deposit"
CREDIT = "/shardrouter.internal.v1.ShardLedgerService/CreditTransfer"

EXAMPLE = {
    "name": "payments",
    "deny_policies": [
        {"name": "frozen", "request": {"accounts": ["frozen-*"]}},
    ],
    "allow_policies": [
        {
            "name": "team-a-writes",
            "source": {"principals": ["spiffe://example.org/ns/payments/sa/team-a", "team-a"]},
            "request": {"paths": ["/shardrouter.v1.TransferService/*"], "accounts": ["team-a-*"]},
        },
        {
            "name": "shards",
            "source": {"principals": ["shard-*"]},
            "request": {"paths": ["/shardrouter.internal.v1.ShardLedgerService/*"]},
        },
    ],
}


def policy(document: object = EXAMPLE):  # type: ignore[no-untyped-def]
    return parse_policy(document)


@pytest.mark.parametrize(
    ("text", "value", "matches"),
    [
        ("*", "", True),
        ("*", "anything", True),
        ("team-a", "team-a", True),
        ("team-a", "team-ab", False),
        ("team-a", "Team-a", False),
        ("team-a-*", "team-a-1", True),
        ("team-a-*", "team-a-", True),
        ("team-a-*", "team-b-1", False),
        ("*-eu", "acct-eu", True),
        ("*-eu", "acct-us", False),
        ("/pkg.S/*", "/pkg.S/M", True),
        ("/pkg.S/*", "/pkg.Sx/M", False),
    ],
)
def test_patterns(text: str, value: str, matches: bool) -> None:
    assert Pattern.parse(text, "here").matches(value) is matches


@pytest.mark.parametrize("text", ["", "a*b", "**", "*a*", "a**"])
def test_bad_patterns_are_refused(text: str) -> None:
    with pytest.raises(AuthzPolicyError, match="here"):
        Pattern.parse(text, "here")


def test_allowed_on_its_accounts_and_refused_on_others() -> None:
    p = policy()
    assert p.decide("team-a", TRANSFER, "team-a-1").allowed
    assert p.decide("spiffe://example.org/ns/payments/sa/team-a", DEPOSIT, "team-a-2").allowed
    assert not p.decide("team-a", TRANSFER, "team-b-1").allowed
    assert not p.decide("team-b", TRANSFER, "team-a-1").allowed
    # An account rule never matches a call without an account.
    assert not p.decide("team-a", TRANSFER, None).allowed
    assert not p.decide("team-a", TRANSFER, "").allowed
    # Nothing matches: denied, by no rule.
    decision = p.decide("team-a", CREDIT, "team-a-1")
    assert not decision.allowed and decision.rule is None


def test_deny_wins_over_allow() -> None:
    p = policy(
        {
            "name": "p",
            "deny_policies": [{"name": "no-team-a-9", "request": {"accounts": ["team-a-9"]}}],
            "allow_policies": [{"name": "all"}],
        }
    )
    assert p.decide("team-a", TRANSFER, "team-a-1").allowed
    decision = p.decide("team-a", TRANSFER, "team-a-9")
    assert not decision.allowed and decision.rule == "no-team-a-9"
    # A deny policy with accounts does not match a call without one: the allow decides.
    assert p.decide("team-a", TRANSFER, None).allowed


def test_internal_calls_by_shard_identity() -> None:
    p = policy()
    assert p.decide("shard-1", CREDIT, "team-b-1").allowed  # no account rule: any account
    assert p.decide("shard-1", CREDIT, None).allowed
    assert not p.decide("shard-1", TRANSFER, "team-a-1").allowed
    assert not p.decide("team-a", CREDIT, "team-a-1").allowed


def test_absent_fields_match_anything_and_allow_all() -> None:
    p = parse_policy_text(ALLOW_ALL_DOCUMENT)
    assert p.name == "allow-all" and not p.uses_accounts
    assert p.decide("anyone", CREDIT, None).allowed
    assert p.digest and len(p.digest) == 16
    empty = policy({"name": "closed", "allow_policies": []})
    assert not empty.decide("anyone", DEPOSIT, "a").allowed


def test_star_path_and_exact_method() -> None:
    p = policy(
        {
            "name": "p",
            "allow_policies": [
                {"name": "reads", "request": {"paths": ["/shardrouter.v1.TransferService/GetBalance"]}},
                {"name": "any", "source": {"principals": ["admin"]}, "request": {"paths": ["*"]}},
            ],
        }
    )
    assert p.decide("x", "/shardrouter.v1.TransferService/GetBalance", "a").allowed
    assert not p.decide("x", DEPOSIT, "a").allowed
    assert p.decide("admin", CREDIT, None).allowed


def test_the_digest_names_the_bytes() -> None:
    a = parse_policy_text(ALLOW_ALL_DOCUMENT)
    b = parse_policy_text(ALLOW_ALL_DOCUMENT + " ")
    assert a.digest != b.digest and a.decide("x", DEPOSIT, None) == b.decide("x", DEPOSIT, None)


def _with(**changes: object) -> dict[str, object]:
    doc = json.loads(json.dumps(EXAMPLE))
    doc.update(changes)
    return doc


def _rule(**rule: object) -> dict[str, object]:
    return {"name": "p", "allow_policies": [{"name": "r", **rule}]}


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ([], "policy: expected an object"),
        ("x", "policy: expected an object"),
        ({"allow_policies": []}, "name: missing"),
        ({"name": "p"}, "allow_policies: missing"),
        ({"name": "", "allow_policies": []}, "name: must not be empty"),
        ({"name": "  ", "allow_policies": []}, "name: must not be empty"),
        ({"name": 7, "allow_policies": []}, "name: expected a string, got int"),
        ({"name": "p", "allow_policies": {}}, "allow_policies: expected a list, got dict"),
        ({"name": "p", "allow_policies": [], "extra": 1}, "policy.extra: unknown key"),
        ({"name": "p", "allow_policies": [[]]}, "allow_policies[0]: expected an object, got list"),
        ({"name": "p", "allow_policies": [{}]}, "allow_policies[0].name: missing"),
        ({"name": "p", "allow_policies": [{"name": None}]}, "allow_policies[0].name: expected a string"),
        (_rule(color="red"), "allow_policies[0].color: unknown key"),
        (_rule(source=[]), "allow_policies[0].source: expected an object"),
        (_rule(source={"principal": ["a"]}), "allow_policies[0].source.principal: unknown key"),
        (_rule(source={"principals": "a"}), "allow_policies[0].source.principals: expected a list, got str"),
        (_rule(source={"principals": []}), "allow_policies[0].source.principals: an empty list"),
        (
            _rule(source={"principals": ["a", 1]}),
            r"allow_policies\[0\].source.principals\[1\]: expected a string",
        ),
        (_rule(source={"principals": [None]}), r"principals\[0\]: expected a string pattern, got NoneType"),
        (_rule(source={"principals": [["a"]]}), r"principals\[0\]: expected a string pattern, got list"),
        (_rule(source={"principals": [{"a": 1}]}), r"principals\[0\]: expected a string pattern, got dict"),
        (_rule(source={"principals": [True]}), r"principals\[0\]: expected a string pattern, got bool"),
        (_rule(source={"principals": [""]}), r"principals\[0\]: an empty pattern"),
        (_rule(request={"paths": ["a*b"]}), r"request.paths\[0\]: 'a\*b' is no pattern"),
        (_rule(request={"paths": ["pkg.S/M"]}), r"request.paths\[0\]: a path starts with '/'"),
        (
            _rule(request={"accounts": ["ok", 3.5]}),
            r"request.accounts\[1\]: expected a string pattern, got float",
        ),
        (_rule(request={"accounts": ["*x*"]}), r"request.accounts\[0\]: '\*x\*' is no pattern"),
        (
            _rule(request={"headers": [{"key": "x", "values": ["y"]}]}),
            "allow_policies[0].request.headers: header matches are not supported",
        ),
        (
            {"name": "p", "allow_policies": [{"name": "a"}, {"name": "a"}]},
            r"allow_policies\[1\].name: 'a' is the name of another policy",
        ),
        (
            {"name": "p", "deny_policies": [{"name": "a"}], "allow_policies": [{"name": "a"}]},
            r"allow_policies\[0\].name: 'a' is the name of another policy",
        ),
        (
            {"name": "p", "deny_policies": None, "allow_policies": []},
            "deny_policies: expected a list, got NoneType",
        ),
    ],
)
def test_bad_documents_name_the_place(document: object, where: str) -> None:
    pattern = where if "\\" in where else re.escape(where)  # a raw regex, or plain text
    with pytest.raises(AuthzPolicyError, match=pattern):
        parse_policy(document)


def test_the_place_names_the_index_in_long_lists() -> None:
    doc = _with()
    doc["allow_policies"][1]["request"]["accounts"] = ["a", "b", 5]  # type: ignore[index]
    with pytest.raises(AuthzPolicyError, match=r"^allow_policies\[1\]\.request\.accounts\[2\]: "):
        parse_policy(doc)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"", "not JSON"),
        (b"{", "not JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"null", "policy: expected an object, got NoneType"),
        (b"[1,2]", "policy: expected an object, got list"),
        (b'{"name":"a","name":"b","allow_policies":[]}', "key 'name' appears twice"),
        (b'{"name":"a","allow_policies":[{"name":"r","name":"s"}]}', "key 'name' appears twice"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"name":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
        (
            b'{"name":"p","allow_policies":[{"name":"r","source":' + b"[" * 500 + b"]" * 500 + b"}]}",
            "expected an object",
        ),
        (b'{"name":"p","allow_policies":NaN}', "expected a list, got float"),
        (b'{"name": 1' + b"0" * 5000 + b', "allow_policies": []}', "cannot be read: Exceeds the limit"),
        (b'{"name": 1e999999, "allow_policies": []}', "name: expected a string, got float"),
    ],
)
def test_hostile_text(text: bytes, message: str) -> None:
    with pytest.raises(AuthzPolicyError, match=message):
        parse_policy_text(text)


def test_a_huge_file_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "huge.json"
    padding = " " * MAX_POLICY_BYTES
    path.write_text('{"name": "p", "allow_policies": []' + padding + "}")
    with pytest.raises(AuthzPolicyError, match=f"{path}: the policy is {MAX_POLICY_BYTES + 1} bytes"):
        load_policy_file(path)
    with pytest.raises(AuthzPolicyError, match="more than the"):
        parse_policy_text(b" " * (MAX_POLICY_BYTES + 1))


def test_too_many_entries_are_refused() -> None:
    many = {"name": "p", "allow_policies": [{"name": f"r{i}"} for i in range(10_001)]}
    with pytest.raises(AuthzPolicyError, match="allow_policies: more than 10000 entries"):
        parse_policy(many)
    patterns = _rule(source={"principals": ["a"] * 10_001})
    with pytest.raises(AuthzPolicyError, match="principals: more than 10000 entries"):
        parse_policy(patterns)
    with pytest.raises(AuthzPolicyError, match="longer than 1024"):
        parse_policy(_rule(request={"accounts": ["a" * 2000]}))


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(AuthzPolicyError, match="cannot read the policy file"):
        load_policy_file(tmp_path / "nope.json")
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(AuthzPolicyError, match=r"dir\.json"):
        load_policy_file(tmp_path / "dir.json")


def test_the_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(EXAMPLE))
    p = load_policy_file(path)
    assert p.name == "payments" and [r.name for r in p.allow] == ["team-a-writes", "shards"]
    assert p.uses_accounts
