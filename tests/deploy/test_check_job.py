"""Offline checks of `shard-router check` as a Kubernetes Job (deploy/k8s/examples/check): rendered
with `kubectl kustomize`, validated against pinned Kubernetes schemas, locked down like every other
pod, the reshard Job's pod of overlays/dev (image, DSN Secrets, mounts) running the check, pointed at
the router's Service, allowed by NetworkPolicy to reach the router, and its script run here with a
stand-in `shard-router` to show what it passes: the target, every shard's DSN, its arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.test_k8s_manifests import (
    K8S,
    K8S_VERSIONS,
    NAMESPACES,
    README,
    _run_without_embedded_postgres,
    check_locked_down,
    containers,
    env_value,
    kustomize,
    objects,
    one,
    pod_spec,
    reshard_job,
    run_reshard_job_script,
)

CHECK_EXAMPLE = K8S / "examples" / "check"


def _rendered() -> tuple[dict[str, Any], ...]:
    return kustomize(CHECK_EXAMPLE)


def check_job() -> dict[str, Any]:
    (job,) = [o for o in _rendered() if o["kind"] == "Job"]
    return job


def _container(job: dict[str, Any]) -> dict[str, Any]:
    spec = pod_spec(job)
    assert spec is not None
    (c,) = spec["containers"]
    return c


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_check_example_validates_and_is_locked_down(version: str) -> None:
    rendered = _rendered()
    assert sorted(o["kind"] for o in rendered) == ["Job", "NetworkPolicy"]
    for obj in rendered:
        kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACES["dev"]
    job = check_job()
    spec = pod_spec(job)
    assert spec is not None
    # it calls the router and reads the databases: no Kubernetes API token
    assert spec["automountServiceAccountToken"] is False
    assert job["spec"]["backoffLimit"] == 0, "a failed check is a verdict, not something to retry"
    for c in containers(spec):
        check_locked_down(job, {**spec, "automountServiceAccountToken": True}, c)


def test_check_job_is_the_reshard_pod_running_the_check_against_the_routers_service() -> None:
    job, reshard = check_job(), reshard_job("dev")
    assert job["metadata"]["name"] == "shard-check"
    c, r = _container(job), _container(reshard)
    assert c["image"] == r["image"] and c["volumeMounts"] == r["volumeMounts"]
    spec, reshard_spec = pod_spec(job), pod_spec(reshard)
    assert spec is not None and reshard_spec is not None
    (dsns,) = [v for v in spec["volumes"] if v["name"] == "databases"]
    (reshard_dsns,) = [v for v in reshard_spec["volumes"] if v["name"] == "databases"]
    assert dsns == reshard_dsns, "every shard's DSN Secret, as the reshard and reconcile Jobs mount them"
    # the reshard pod's labels (its NetworkPolicies: every database on 5432), and one more
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert reshard["spec"]["template"]["metadata"]["labels"].items() <= labels.items()
    assert labels["app.kubernetes.io/component"] == "check"
    # the target is the router's Service in the Job's namespace, on its gRPC port
    host, _, port = (env_value(c, "CHECK_TARGET") or "").partition(":")
    service = one("dev", "Service", host)
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "router"
    assert int(port) in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}
    assert env_value(c, "CHECK_ARGS"), "a bounded run by default"
    assert "exec shard-router check --target" in c["args"][0]


def test_the_check_pod_may_reach_the_router_and_the_router_admits_it() -> None:
    labels = check_job()["spec"]["template"]["metadata"]["labels"]
    (policy,) = [o for o in _rendered() if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = policy["spec"]["egress"]
    assert rule["to"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "router"}}}]
    allowed = {p["port"] for p in rule["ports"]}
    router = one("dev", "NetworkPolicy", "router")
    open_ports = {p["port"] for r in router["spec"]["ingress"] if "from" not in r for p in r.get("ports", [])}
    assert allowed == {50051, 8080} and allowed <= open_ports
    # the Service's gRPC port reaches the router's container on the port the policies name
    deployment = one("dev", "Deployment", "router")
    spec = pod_spec(deployment)
    assert spec is not None
    grpc_port = next(
        p["containerPort"] for c in spec["containers"] for p in c.get("ports", []) if p["name"] == "grpc"
    )
    assert grpc_port in allowed
    # the database egress comes from the reshard pod's own policy, which selects this pod too
    reshard_policies = [
        p
        for p in objects("dev")
        if p["kind"] == "NetworkPolicy"
        and p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == "shard-reshard"
    ]
    assert reshard_policies and all(
        p["spec"]["podSelector"]["matchLabels"].items() <= labels.items() for p in reshard_policies
    )


def test_check_job_script_passes_the_target_every_dsn_and_its_arguments(tmp_path: Path) -> None:
    dsns = {"shard-0": "postgresql://a:p#w@b/c", "shard-1": "postgresql://a@d/c"}
    result = run_reshard_job_script(
        tmp_path, "--operations 50 --seed 7", dsns, job=check_job(), args_variable="CHECK_ARGS"
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


def test_shard_router_check_runs_where_the_image_has_no_local_cluster() -> None:
    """The Job's `shard-router check` starts without embedded-postgres (the `local` extra)."""
    result = _run_without_embedded_postgres(
        "import shardrouter.localcluster.command as command\nsys.exit(command.main(['check', '--help']))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "shard-router check" in result.stdout and "--operations" in result.stdout


def test_the_readme_says_how_to_run_the_check_job() -> None:
    readme = README.read_text(encoding="utf-8")
    assert "kubectl kustomize deploy/k8s/examples/check" in readme
    assert "job/shard-check" in readme
