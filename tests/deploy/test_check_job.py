"""Offline checks of `shard-router check` as a Kubernetes Job (deploy/k8s/examples/check, `dev` and
`prod`): rendered with `kubectl kustomize`, validated against pinned Kubernetes schemas, locked down
like every other pod, the reshard Job's pod of each overlay (image, DSN Secrets, mounts) running the
check against the router's Service, allowed by NetworkPolicy to reach the router, and its script run
here with a stand-in `shard-router` to show what it passes. In prod the check is a caller of its
own: a client certificate approver-policy approves (never the router's identity), its databases
verified as every prod client verifies them, and the authorization rule deploy/k8s/README.md gives
allowing exactly the calls the check sends.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from shardrouter.check.drive import ACCOUNT_PREFIX, DEPOSIT, TRANSFER
from shardrouter.shardd.authorization_policy import parse_policy
from tests.deploy.site_file import example_settings
from tests.deploy.test_k8s_manifests import (
    K8S,
    K8S_VERSIONS,
    NAMESPACES,
    README,
    ROUTER_SPIFFE_ID,
    _approved,
    _request,
    _run_without_embedded_postgres,
    approver_policies,
    check_database_tls,
    check_locked_down,
    containers,
    env_value,
    kustomize,
    objects,
    of_kind,
    one,
    pod_spec,
    reshard_job,
    run_reshard_job_script,
)

CHECK_EXAMPLES = {"dev": K8S / "examples" / "check" / "dev", "prod": K8S / "examples" / "check" / "prod"}
VARIANTS = tuple(CHECK_EXAMPLES)
#: The check's own identity in prod: its service account, named in its certificate's SPIFFE ID.
CHECK_SPIFFE_ID = "spiffe://cluster.local/ns/shard-router/sa/shard-check"


@functools.cache
def _rendering(variant: str) -> tuple[dict[str, Any], ...]:
    return kustomize(CHECK_EXAMPLES[variant])


def _rendered(variant: str) -> tuple[dict[str, Any], ...]:
    """A fresh copy of the variant's objects (rendered once per process)."""
    return copy.deepcopy(_rendering(variant))


def _only(rendered: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in rendered if o["kind"] == kind]
    return obj


def check_job(variant: str) -> dict[str, Any]:
    return _only(_rendered(variant), "Job")


def _container(job: dict[str, Any]) -> dict[str, Any]:
    spec = pod_spec(job)
    assert spec is not None
    (c,) = spec["containers"]
    return c


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_check_example_validates_and_is_locked_down(variant: str, version: str) -> None:
    rendered = _rendered(variant)
    kinds = {
        "dev": ["Job", "NetworkPolicy"],
        "prod": ["Certificate", "Job", "NetworkPolicy", "ServiceAccount"],
    }
    assert sorted(o["kind"] for o in rendered) == kinds[variant]
    for obj in rendered:
        if obj["kind"] != "Certificate":
            kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACES[variant]
    job = check_job(variant)
    spec = pod_spec(job)
    assert spec is not None
    # it calls the router and reads the databases: no Kubernetes API token
    assert spec["automountServiceAccountToken"] is False
    assert job["spec"]["backoffLimit"] == 0, "a failed check is a verdict, not something to retry"
    for c in containers(spec):
        check_locked_down(job, {**spec, "automountServiceAccountToken": True}, c)


@pytest.mark.parametrize("variant", VARIANTS)
def test_check_job_is_the_reshard_pod_running_the_check_against_the_routers_service(variant: str) -> None:
    job, reshard = check_job(variant), reshard_job(variant)
    assert job["metadata"]["name"] == "shard-check"
    c, r = _container(job), _container(reshard)
    assert c["image"] == r["image"]
    # the reshard pod's mounts (DSNs, in prod each database's CA), plus in prod the client certificate
    extra = [m for m in c["volumeMounts"] if m not in r["volumeMounts"]]
    assert [m for m in r["volumeMounts"] if m not in c["volumeMounts"]] == []
    assert [m["name"] for m in extra] == ([] if variant == "dev" else ["caller-tls"])
    spec, reshard_spec = pod_spec(job), pod_spec(reshard)
    assert spec is not None and reshard_spec is not None
    for name in ("databases", "databases-ca"):
        ours = [v for v in spec["volumes"] if v["name"] == name]
        assert ours == [v for v in reshard_spec["volumes"] if v["name"] == name], name
    assert any(v["name"] == "databases" for v in spec["volumes"])
    # the database TLS mode of the overlay's reshard Job stays (prod: verify-full)
    assert env_value(c, "PGSSLMODE") == env_value(r, "PGSSLMODE")
    # the reshard pod's labels (its NetworkPolicies: every database on 5432), and one more
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert reshard["spec"]["template"]["metadata"]["labels"].items() <= labels.items()
    assert labels["app.kubernetes.io/component"] == "check"
    # the target is the router's Service in the Job's namespace, on its gRPC port
    host, _, port = (env_value(c, "CHECK_TARGET") or "").partition(":")
    service = one(variant, "Service", host)
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "router"
    assert int(port) in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}
    assert env_value(c, "CHECK_ARGS"), "a bounded run by default"
    assert "exec shard-router check --target" in c["args"][0]
    for variable in ("RESHARD_MAP", "RESHARD_ARGS", "RESHARD_REPLICATION_CA_DIR", "POD_NAMESPACE"):
        assert env_value(c, variable) is None, f"{variable}: the reshard command's, not the check's"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_check_pod_may_reach_the_router_and_the_router_admits_it(variant: str) -> None:
    labels = check_job(variant)["spec"]["template"]["metadata"]["labels"]
    policy = _only(_rendered(variant), "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = policy["spec"]["egress"]
    assert rule["to"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "router"}}}]
    allowed = {p["port"] for p in rule["ports"]}
    router = one(variant, "NetworkPolicy", "router")
    open_ports = {p["port"] for r in router["spec"]["ingress"] if "from" not in r for p in r.get("ports", [])}
    assert allowed == {50051, 8080} and allowed <= open_ports
    # the Service's gRPC port reaches the router's container on the port the policies name
    spec = pod_spec(one(variant, "Deployment", "router"))
    assert spec is not None
    grpc_port = next(
        p["containerPort"] for c in spec["containers"] for p in c.get("ports", []) if p["name"] == "grpc"
    )
    assert grpc_port in allowed
    # the database egress comes from the reshard pod's own policy, which selects this pod too
    reshard_policies = [
        p
        for p in objects(variant)
        if p["kind"] == "NetworkPolicy"
        and p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == "shard-reshard"
    ]
    assert reshard_policies and all(
        p["spec"]["podSelector"]["matchLabels"].items() <= labels.items() for p in reshard_policies
    )


def test_dev_check_job_script_passes_the_target_every_dsn_and_its_arguments(tmp_path: Path) -> None:
    dsns = {"shard-0": "postgresql://a:p#w@b/c", "shard-1": "postgresql://a@d/c"}
    result = run_reshard_job_script(
        tmp_path, "--operations 50 --seed 7", dsns, job=check_job("dev"), args_variable="CHECK_ARGS"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["dsns"] == dsns
    work = tmp_path / "work"
    assert state["args"] == [
        "check",
        "--target",
        "router:50051",
        "--databases",
        str(work / "databases.yaml"),
        "--history",
        str(work / "check.jsonl"),
        "--operations",
        "50",
        "--seed",
        "7",
    ]


def test_prod_check_job_verifies_every_database_and_presents_its_own_certificate(tmp_path: Path) -> None:
    job = check_job("prod")
    spec = pod_spec(job)
    assert spec is not None
    c = _container(job)
    # every DSN made by the script verifies its database against that database's own cluster CA
    check_database_tls(tmp_path, job, spec, c)
    args = json.loads((tmp_path / "state.json").read_text())["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--tls-")}
    # the three files of the check's own certificate Secret, as mounted
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "caller-tls"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "caller-tls"]
    certificate = _only(_rendered("prod"), "Certificate")
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    files = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    assert files == {"ca.crt": "ca.crt", "tls.crt": "tls.crt", "tls.key": "tls.key"}
    assert flags == {
        "--tls-ca": f"{mount['mountPath']}/ca.crt",
        "--tls-cert": f"{mount['mountPath']}/tls.crt",
        "--tls-key": f"{mount['mountPath']}/tls.key",
    }
    assert mount["readOnly"] is True and volume["secret"]["defaultMode"] & 0o007 == 0, (
        "the key is no one else's"
    )


def test_check_job_script_refuses_half_a_client_certificate(tmp_path: Path) -> None:
    job = check_job("prod")
    c = _container(job)
    c["env"] = [e for e in c["env"] if e["name"] != "CHECK_TLS_KEY"]
    dsns = {"shard-0": "postgresql://a@postgres-shard-0-rw.shard-router:5432/shardd"}
    ca = {"/etc/shard-databases-ca/shard-0/ca.crt": "ca"}
    result = run_reshard_job_script(tmp_path, "", dsns, job=job, args_variable="CHECK_ARGS", files=ca)
    assert result.returncode != 0 and "CHECK_TLS_KEY" in result.stderr
    assert not (tmp_path / "state.json").exists(), "the check never ran without its key"


def test_the_prod_checks_certificate_is_its_own_and_approved() -> None:
    rendered = _rendered("prod")
    certificate, account = _only(rendered, "Certificate"), _only(rendered, "ServiceAccount")
    spec = certificate["spec"]
    job_spec = pod_spec(check_job("prod"))
    assert job_spec is not None
    # one SPIFFE ID, naming the service account the Job runs as (no token: it never calls the API)
    assert spec["uris"] == [CHECK_SPIFFE_ID]
    assert CHECK_SPIFFE_ID.rsplit("/", 1)[1] == account["metadata"]["name"] == job_spec["serviceAccountName"]
    assert account["automountServiceAccountToken"] is False
    assert spec["issuerRef"] == {"group": "cert-manager.io", "kind": "Issuer", "name": "shard-router-ca"}
    assert "client auth" in spec["usages"] and "server auth" not in spec["usages"]
    assert not spec.get("dnsNames") and not spec.get("isCA")
    # the lifetime of every other certificate of the namespace's CA (the expiry alerts watch them all)
    others = [
        o for o in of_kind("prod", "Certificate") if o["spec"]["issuerRef"]["name"] == "shard-router-ca"
    ]
    assert others and {
        (o["spec"]["duration"], o["spec"]["renewBefore"]) for o in others if not o["spec"].get("isCA")
    } == {(spec["duration"], spec["renewBefore"])}
    policies = approver_policies()
    assert _approved(policies, _request(certificate))
    # the same request for the router's identity, or under its common name, is refused
    assert not _approved(policies, {**_request(certificate), "uris": [ROUTER_SPIFFE_ID]})
    assert not _approved(policies, {**_request(certificate), "commonName": "router"})


def _readme_authz_rule() -> dict[str, Any]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Check exactly once under your own faults") :]
    match = re.search(r"```json\n(.*?)```", section, re.S)
    assert match, "deploy/k8s/README.md gives the check's authorization rule"
    rule: dict[str, Any] = json.loads(match.group(1))
    return rule


def test_the_documented_authorization_rule_allows_the_check_exactly_its_calls() -> None:
    rule = _readme_authz_rule()
    assert rule["source"]["principals"] == [CHECK_SPIFFE_ID]
    site_policy = json.loads(example_settings()["authz-policy.json"])
    site_policy["allow_policies"].append(rule)
    policy = parse_policy(site_policy)
    account = f"{ACCOUNT_PREFIX}run1-0"
    for path in (DEPOSIT, TRANSFER):
        assert policy.decide(CHECK_SPIFFE_ID, path, account).allowed, path
        # the check's rule gives nothing on anyone else's accounts, nor to anyone else
        assert not policy.decide(CHECK_SPIFFE_ID, path, "team-a-1").allowed, path
        assert not policy.decide("spiffe://cluster.local/ns/payments/sa/team-b", path, account).allowed
    assert not policy.decide(
        CHECK_SPIFFE_ID, "/shardrouter.internal.v1.ShardLedgerService/Credit", account
    ).allowed


def test_shard_router_check_runs_where_the_image_has_no_local_cluster() -> None:
    """The Job's `shard-router check` starts without embedded-postgres (the `local` extra)."""
    result = _run_without_embedded_postgres(
        "import shardrouter.localcluster.command as command\nsys.exit(command.main(['check', '--help']))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "shard-router check" in result.stdout and "--operations" in result.stdout


def test_the_readme_says_how_to_run_the_check_job() -> None:
    readme = README.read_text(encoding="utf-8")
    for variant in VARIANTS:
        assert f"deploy/k8s/examples/check/{variant}" in readme
    assert "job/shard-check" in readme and "shard-check-tls" in readme
