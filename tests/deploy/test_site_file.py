"""The site file (deploy/k8s/site/site.yaml) and rollouts that keep serving, offline.

What a production install chooses is in one file; the component deploy/k8s/site copies each setting
to every place that needs it. Checked here with `kubectl kustomize`: the committed site file (every
setting unset) renders nothing for production and names the setting it misses, as does the filled
example with any one setting taken out; with values other than the example's, every place carries
them and none keeps a default; the image recipe's base digest is a build argument that stops the
build, naming it, when unset. The restore component (examples/restore/use-restored) points the
daemons, the other shards' databases and the reshard and reconcile Jobs at the restored cluster. And a rolling
update of a shard's daemons, or of the routers, never leaves them without a ready pod: surge before
stopping, readiness, a disruption budget, and grace periods longer than the daemons' own drain.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardrouter.router import settings as router_settings
from shardrouter.shardd import settings as shardd_settings
from tests.deploy.site_file import REPOSITORY_K8S, example_settings, k8s_copy
from tests.deploy.test_image import DIGEST, DOCKERFILE, from_images
from tests.deploy.test_k8s_manifests import K8S, containers, objects, pod_spec

#: Every kustomization that renders for production, and so includes the site component.
PRODUCTION = (
    "overlays/prod",
    "overlays/prod/databases",
    "approver-policy",
    "examples/restore",
    "examples/restore/reconcile",
    "examples/restore/reshard",
    "examples/reshard/prod",
    "examples/reconcile/prod",
    "examples/check/prod",
)
#: Settings other than the example's, each one recognisable where it lands.
OTHER = {
    "image": "registry.example.org/payments/shard-router:7.0.0@sha256:" + "b" * 64,
    "namespace": "money",
    "trust-domain": "example.org",
    "cluster-domain": "k8s.internal",
    "traces-backend": "tempo.obs.svc:4317",
    "authz-policy.json": '{"name": "site", "deny_policies": [], "allow_policies": []}\n',
    "prometheus-release": "prom-main",
    "runbook-base-url": "https://wiki.example.org/ops/runbooks",
    "monitoring-namespace": "obs",
    "cnpg-namespace": "cnpg-ops",
    "backup-bucket": "s3://money-backups/",
    "backup-role-arn": "arn:aws:iam::444455556666:role/money-backups",
    "storage-class": "fast-expandable",
    "storage-size": "80Gi",
    "wal-storage-size": "30Gi",
    "restore-target-time": "2026-11-30 23:00:00.00000+00",
}
#: The settings only the restore example reads.
RESTORE_ONLY = {"restore-target-time"}
CLUSTER_SCOPED = {"CertificateRequestPolicy", "ClusterRole", "ClusterRoleBinding", "Namespace"}


def render(directory: Path) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not installed: the site file is checked with `kubectl kustomize`", pytrace=False
        )
    return subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )


def rendered(directory: Path) -> list[dict[str, Any]]:
    result = render(directory)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def missing_setting(result: subprocess.CompletedProcess[str]) -> str:
    """The setting a failed render names as missing."""
    assert result.returncode != 0, "rendered without the setting"
    match = re.search(
        r"fieldPath `data\.\[?([\w.-]+?)\]?` is missing for replacement source ConfigMap\S*/site",
        result.stderr,
    )
    assert match, result.stderr
    return match[1]


# --- unset settings stop the render ------------------------------------------------------------------


def test_the_committed_site_file_sets_nothing_and_nothing_renders_for_production() -> None:
    site = yaml.safe_load((REPOSITORY_K8S / "site" / "site.yaml").read_text(encoding="utf-8"))
    assert not site.get("data"), "the committed site file must leave every setting to the site"
    assert site["metadata"]["annotations"]["config.kubernetes.io/local-config"] == "true"
    for target in PRODUCTION:
        assert missing_setting(render(REPOSITORY_K8S / target)) in example_settings(), target
    # every setting is described in the committed file, and the example fills each
    text = (REPOSITORY_K8S / "site" / "site.yaml").read_text(encoding="utf-8")
    for setting in example_settings():
        assert re.search(rf"^  # {re.escape(setting)}:", text, re.M), f"site.yaml does not describe {setting}"
    assert set(OTHER) == set(example_settings())


def test_each_setting_left_unset_is_named(tmp_path: Path) -> None:
    for setting in example_settings():
        settings = {k: v for k, v in example_settings().items() if k != setting}
        root = k8s_copy(tmp_path / setting, settings)
        target = "examples/restore" if setting in RESTORE_ONLY else "overlays/prod"
        assert missing_setting(render(root / target)) == setting
        if setting in RESTORE_ONLY:  # needed by the restore alone: the application renders without it
            rendered(root / "overlays" / "prod")


def test_the_filled_example_renders_every_production_kustomization() -> None:
    image = example_settings()["image"]
    for target in PRODUCTION:
        objs = rendered(K8S / target)
        assert objs, target
        # the site file itself is kustomize's own: never applied
        assert not [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "site"]
        for obj in objs:
            spec = pod_spec(obj)
            for c in containers(spec) if spec else []:
                if c["image"].startswith("shard-router"):
                    assert c["image"] == image, (target, obj["metadata"]["name"], c["name"])


# --- every setting lands everywhere -------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = k8s_copy(tmp_path_factory.mktemp("other-site"), OTHER)
    return {target: rendered(root / target) for target in PRODUCTION}


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_no_default_is_left_where_a_setting_goes(other_site: dict[str, list[dict[str, Any]]]) -> None:
    example = example_settings()
    for target, objs in other_site.items():
        for obj in objs:
            where = f"{target}: {obj['kind']} {obj['metadata']['name']}"
            if obj["kind"] not in CLUSTER_SCOPED:
                assert obj["metadata"].get("namespace") == OTHER["namespace"], where
            for text in _strings(obj):
                assert "set-by-the-site-file" not in text and "set by the site file" not in text, where
                assert "cluster.local" not in text and "cluster\\.local" not in text, (where, text)
                assert ".shard-router.svc" not in text and "/ns/shard-router/" not in text, (where, text)
                assert not re.fullmatch(r"router\.shard-router(\..*)?", text), (where, text)
                for setting in ("backup-bucket", "backup-role-arn", "traces-backend", "image"):
                    assert example[setting] not in text, (where, setting)
                if text.startswith("https://") and ".md#" in text:
                    assert text.startswith(OTHER["runbook-base-url"] + "/"), (where, text)


def _only(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _env(c: dict[str, Any], name: str) -> str:
    (value,) = [e["value"] for e in c.get("env", []) if e["name"] == name]
    return str(value)


def test_every_setting_reaches_its_places(other_site: dict[str, list[dict[str, Any]]]) -> None:
    app, databases = other_site["overlays/prod"], other_site["overlays/prod/databases"]
    ns, trust, domain = OTHER["namespace"], OTHER["trust-domain"], OTHER["cluster-domain"]
    shardd_tls = _only(app, "Certificate", "shardd-tls")["spec"]
    assert shardd_tls["uris"] == [f"spiffe://{trust}/ns/{ns}/sa/shardd"]
    for shard in ("shard-0", "shard-1"):
        assert {f"shardd-{shard}", f"shardd-{shard}.{ns}.svc", f"shardd-{shard}.{ns}.svc.{domain}"} <= set(
            shardd_tls["dnsNames"]
        )
        deployment = _only(app, "Deployment", f"shardd-{shard}")
        spec = deployment["spec"]["template"]["spec"]
        for c in [*spec["initContainers"], *spec["containers"]]:
            assert c["image"] == OTHER["image"]
            assert f"@postgres-{shard}-rw.{ns}.svc:5432/" in _env(c, "SHARDD_DSN")
        (daemon,) = [c for c in spec["containers"] if c["name"] == "shardd"]
        assert _env(daemon, "SHARDD_TRUSTED_PROXIES") == f"spiffe://{trust}/ns/{ns}/sa/router"
    router_tls = _only(app, "Certificate", "router-tls")["spec"]
    assert router_tls["dnsNames"] == [
        "router",
        f"router.{ns}",
        f"router.{ns}.svc",
        f"router.{ns}.svc.{domain}",
    ]
    collector = _only(app, "Deployment", "otel-collector")["spec"]["template"]["spec"]["containers"][0]
    assert _env(collector, "TRACES_BACKEND") == OTHER["traces-backend"]
    policy = _only(app, "ConfigMap", "shardd-authz-policy")["data"]["policy.json"]
    assert policy == OTHER["authz-policy.json"]
    for objs in (app, databases):
        for obj in objs:
            if obj["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
                assert obj["metadata"]["labels"]["release"] == OTHER["prometheus-release"]
    for binding in (o for o in app if o["kind"] == "RoleBinding"):
        assert {s["namespace"] for s in binding["subjects"]} == {ns}
    # the databases and the restored one
    restore = other_site["examples/restore"]
    for cluster in [o for o in [*databases, *restore] if o["kind"] == "Cluster"]:
        spec = cluster["spec"]
        assert spec["storage"] == {"size": OTHER["storage-size"], "storageClass": OTHER["storage-class"]}
        assert spec["walStorage"] == {
            "size": OTHER["wal-storage-size"],
            "storageClass": OTHER["storage-class"],
        }
        annotations = spec["serviceAccountTemplate"]["metadata"]["annotations"]
        assert annotations == {"eks.amazonaws.com/role-arn": OTHER["backup-role-arn"]}
    (cluster,) = [o for o in restore if o["kind"] == "Cluster"]
    target_time = cluster["spec"]["bootstrap"]["recovery"]["recoveryTarget"]["targetTime"]
    # kustomize writes it unquoted, as it did the file's own: YAML may read it as a timestamp
    assert target_time == yaml.safe_load(f"t: {OTHER['restore-target-time']}")["t"]
    store = _only(databases, "ObjectStore", "postgres-backups")
    assert store["spec"]["configuration"]["destinationPath"] == OTHER["backup-bucket"]
    operators = {"cnpg-system": OTHER["cnpg-namespace"], "monitoring": OTHER["monitoring-namespace"]}
    for objs in (app, databases, restore):
        for policy_obj in (o for o in objs if o["kind"] == "NetworkPolicy"):
            for rule in policy_obj["spec"].get("ingress", []):
                for peer in rule.get("from", []):
                    selected = peer.get("namespaceSelector", {}).get("matchLabels", {})
                    assert selected.get("kubernetes.io/metadata.name") not in operators, policy_obj[
                        "metadata"
                    ]
    # approver-policy: the namespace's requests, the router's names, the reserved identities
    policies = {
        o["metadata"]["name"]: o["spec"]
        for o in other_site["approver-policy"]
        if o["kind"] == "CertificateRequestPolicy"
    }
    assert {
        p["selector"]["namespace"]["matchNames"][0] for p in policies.values() if "namespace" in p["selector"]
    } == {ns}
    router = policies["shard-router-router-identity"]["allowed"]
    assert router["uris"]["values"] == [f"spiffe://{trust}/ns/{ns}/sa/router"]
    assert router["dnsNames"]["values"] == router_tls["dnsNames"]
    # the reshard Job and the reconcile and check Jobs made from it
    for target in ("examples/reshard/prod", "examples/reconcile/prod", "examples/check/prod"):
        (job,) = [o for o in other_site[target] if o["kind"] == "Job"]
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert c["image"] == OTHER["image"] and job["metadata"]["namespace"] == ns
    # the check's own identity
    check_tls = _only(other_site["examples/check/prod"], "Certificate", "shard-check-tls")["spec"]
    assert check_tls["uris"] == [f"spiffe://{trust}/ns/{ns}/sa/shard-check"]


# --- the restore component -----------------------------------------------------------------------------


def test_the_restore_component_points_everything_at_the_restored_cluster(tmp_path: Path) -> None:
    root = k8s_copy(tmp_path)
    restored = "postgres-shard-0-restore"
    for target in ("overlays/prod", "overlays/prod/databases"):
        path = root / target / "kustomization.yaml"
        text = path.read_text(encoding="utf-8")
        relative = Path(*[".."] * len(Path(target).parts)) / "examples" / "restore" / "use-restored"
        site = Path(*[".."] * len(Path(target).parts)) / "site"
        assert f"\n  - {site}\n" in text, target
        text = text.replace(f"\n  - {site}\n", f"\n  - {relative}\n  - {site}\n")
        if target == "overlays/prod":
            text = text.replace("\n  - database-shard-0\n", "\n")
        path.write_text(text, encoding="utf-8")
    app = rendered(root / "overlays" / "prod")
    spec = _only(app, "Deployment", "shardd-shard-0")["spec"]["template"]["spec"]
    for c in [*spec["initContainers"], *spec["containers"]]:
        assert f"@{restored}-rw." in _env(c, "SHARDD_DSN")
    assert {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} >= {f"{restored}-ca"}
    assert "postgres-shard-0-ca" not in yaml.safe_dump(_only(app, "Deployment", "shardd-shard-0"))
    databases = rendered(root / "overlays" / "prod" / "databases")
    projected = _only(databases, "Cluster", "postgres-shard-1")["spec"]["projectedVolumeTemplate"]["sources"]
    assert [s["secret"]["name"] for s in projected] == [f"{restored}-ca"]
    (job,) = rendered(root / "examples" / "restore" / "reshard")
    names = {
        s["secret"]["name"]
        for v in job["spec"]["template"]["spec"]["volumes"]
        for s in v.get("projected", {}).get("sources", [])
    }
    assert {f"{restored}-app", f"{restored}-ca"} <= names
    assert not names & {"postgres-shard-0-app", "postgres-shard-0-ca"}
    # the restore's reconcile Job (examples/restore/reconcile) names the same Secrets
    (reconcile,) = rendered(root / "examples" / "restore" / "reconcile")
    assert {
        s["secret"]["name"]
        for v in reconcile["spec"]["template"]["spec"]["volumes"]
        for s in v.get("projected", {}).get("sources", [])
    } == names


# --- the image's base digest ----------------------------------------------------------------------------


def test_the_base_images_digest_is_a_build_argument_that_stops_the_build_when_unset() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    unset = from_images(text)
    assert len(unset) >= 2
    for image in unset:
        # an invalid reference (no `algorithm:hex` digest): the build stops there, naming the argument
        assert "PYTHON_DIGEST" in image and not DIGEST.search(image), image
        assert not re.fullmatch(r"[\w./:-]+(@[a-z0-9]+:[0-9a-f]+)?", image), image
    digest = "sha256:" + "c" * 64
    given = from_images(re.sub(r"(?m)^ARG PYTHON_DIGEST=.*$", f"ARG PYTHON_DIGEST={digest}", text))
    assert given == ["python:3.11-slim-bookworm@" + digest] * len(unset)


# --- rollouts that keep serving ---------------------------------------------------------------------


#: What a process waits past its shutdown grace before it is gone: shardd's parent kills a serving
#: process still there 5 s after the grace (shardd/processes.py ServingProcesses.stop); the router
#: gives its stop 15 s past the grace (router/server.py ThreadedRouter.stop).
PAST_GRACE_S = {"shardd": 5.0, "router": 15.0}


def _drain_s(daemon: str, c: dict[str, Any]) -> float:
    """The longest the daemon takes from SIGTERM to exit, from its settings (a manifest's
    `*_SHUTDOWN_GRACE_S` over the code's default)."""
    module = shardd_settings if daemon == "shardd" else router_settings
    env = {
        e["name"]: e["value"]
        for e in c.get("env", [])
        if "value" in e and e["name"].endswith("SHUTDOWN_GRACE_S")
    }
    grace = module.parse_settings(argv=[], env=env).shutdown_grace_s
    return grace + PAST_GRACE_S[daemon]


def rollout_problems(objs: list[dict[str, Any]]) -> list[str]:
    """Why a rolling update (or a drain) of a shard's daemons or of the routers could leave them
    without a ready pod, or cut a call short."""
    problems: list[str] = []
    budgets = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for deployment in (o for o in objs if o["kind"] == "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        daemon = labels.get("app.kubernetes.io/name")
        if daemon not in ("shardd", "router"):
            continue
        name, spec = deployment["metadata"]["name"], deployment["spec"]
        replicas = spec.get("replicas", 2)  # the router's: its autoscaler's minimum, 2 or more
        rolling = spec.get("strategy", {}).get("rollingUpdate", {})
        if spec.get("strategy", {}).get("type", "RollingUpdate") != "RollingUpdate":
            problems.append(f"{name}: not a rolling update")
        if rolling.get("maxUnavailable") != 0:
            problems.append(f"{name}: maxUnavailable {rolling.get('maxUnavailable')!r}, not 0")
        if not isinstance(rolling.get("maxSurge"), int) or rolling["maxSurge"] < 1:
            problems.append(
                f"{name}: maxSurge {rolling.get('maxSurge')!r}: no new pod before an old one stops"
            )
        if replicas < 2:
            problems.append(f"{name}: {replicas} replica(s): a drain or a crash leaves none")
        if daemon == "shardd" and spec.get("minReadySeconds", 0) < 1:
            problems.append(f"{name}: no minReadySeconds")
        pod = spec["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == daemon]
        if "readinessProbe" not in c:
            problems.append(f"{name}: no readinessProbe: a pod is ready before it serves")
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        if pre_stop < 1:
            problems.append(f"{name}: no preStop sleep: it stops taking calls while still an endpoint")
        period = pod.get("terminationGracePeriodSeconds", 30)
        if period <= pre_stop + _drain_s(daemon, c):
            problems.append(
                f"{name}: terminationGracePeriodSeconds {period} <= {pre_stop} + {_drain_s(daemon, c)}"
            )
        selecting = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        if len(selecting) != 1:
            problems.append(f"{name}: {len(selecting)} PodDisruptionBudgets select its pods")
        for budget in selecting:
            allowed = budget["spec"].get("maxUnavailable")
            if not isinstance(allowed, int) or not 1 <= allowed < replicas:
                problems.append(f"{name}: its budget lets {allowed!r} of {replicas} pods go at once")
    return problems


@pytest.mark.parametrize("target", ["dev", "prod", "prod-restored"])
def test_a_rolling_update_never_leaves_a_shard_or_the_routers_without_a_ready_pod(target: str) -> None:
    objs = objects(target)
    shards = [
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("shardd-shard-")
    ]
    assert len(shards) >= 2
    assert rollout_problems(objs) == []


def test_the_rollout_check_can_fail() -> None:
    def problem(edit: Any) -> list[str]:
        objs = objects("prod")
        edit(objs)
        return rollout_problems(objs)

    def shard0(objs: list[dict[str, Any]]) -> dict[str, Any]:
        return _only(objs, "Deployment", "shardd-shard-0")

    def daemon(objs: list[dict[str, Any]]) -> dict[str, Any]:
        (c,) = [c for c in shard0(objs)["spec"]["template"]["spec"]["containers"] if c["name"] == "shardd"]
        return c

    def unavailable(o: list[dict[str, Any]]) -> None:
        shard0(o)["spec"]["strategy"]["rollingUpdate"] = {"maxUnavailable": 1, "maxSurge": 0}

    def short_grace(o: list[dict[str, Any]]) -> None:
        shard0(o)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 15

    def long_drain(o: list[dict[str, Any]]) -> None:
        daemon(o)["env"].append({"name": "SHARDD_SHUTDOWN_GRACE_S", "value": "25"})

    def one_replica(o: list[dict[str, Any]]) -> None:
        shard0(o)["spec"]["replicas"] = 1

    checks = {
        "maxUnavailable": unavailable,
        "terminationGracePeriodSeconds 15": short_grace,
        "<= 5 + 30.0": long_drain,
        "1 replica(s)": one_replica,
        "no readinessProbe": lambda o: daemon(o).pop("readinessProbe"),
        "no preStop sleep": lambda o: daemon(o).pop("lifecycle"),
        "0 PodDisruptionBudgets": lambda o: o.remove(_only(o, "PodDisruptionBudget", "shardd-shard-0")),
    }
    for expected, edit in checks.items():
        found = problem(edit)
        assert any(expected in p and "shardd-shard-0" in p for p in found), (expected, found)
