"""The alert rules (deploy/k8s/monitoring) against recorded series, with `promtool test rules`.

The rule groups come from the rendered PrometheusRule (`kubectl kustomize deploy/k8s/monitoring`),
written as a plain rules file into a temporary directory next to copies of the unit-test files in
deploy/k8s/monitoring/tests/. `promtool check rules` checks the full rules (annotation templates
included); the unit tests run on a copy without annotations, so that they compare alerts by their
labels. promtool comes with Debian's `prometheus` package, which .ci/run installs; CI sets
SHARD_ROUTER_REQUIRE_PROMTOOL=1, so there a missing promtool fails these tests. Elsewhere (the
README's test command on a machine without it) they are skipped with a line saying what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_k8s_manifests import K8S, objects

UNIT_TESTS = K8S / "monitoring" / "tests"


_MISSING = (
    "promtool is not installed: the alert rules are checked with `promtool test rules` "
    "(Debian/Ubuntu: `apt-get install --no-install-recommends prometheus`; or a Prometheus release tarball)"
)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("SHARD_ROUTER_REQUIRE_PROMTOOL") == "1":
            pytest.fail(_MISSING, pytrace=False)
        pytest.skip(_MISSING)
    return path


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    for rule in objects("monitoring"):
        if rule["kind"] == "PrometheusRule":
            groups += rule["spec"]["groups"]
    assert groups
    return groups


def alert_names() -> set[str]:
    return {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}


def unit_test_files() -> list[Path]:
    files = sorted(UNIT_TESTS.glob("*.yaml"))
    assert files, UNIT_TESTS
    return files


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("alert-rules")
    groups = rule_groups()
    full = directory / "full-rules.yaml"
    full.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    result = _run(promtool(), "check", "rules", str(full))
    assert result.returncode == 0, result.stdout + result.stderr
    bare = [
        {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
        for g in groups
    ]
    (directory / "rules.yaml").write_text(yaml.safe_dump({"groups": bare}, sort_keys=False), encoding="utf-8")
    for path in unit_test_files():
        shutil.copy(path, directory / path.name)
    return directory


def test_promtool_unit_tests_pass(rules_dir: Path) -> None:
    tool = promtool()
    # One promtool per file, side by side: the slowest file sets the time.
    with futures.ThreadPoolExecutor(max_workers=len(unit_test_files())) as pool:
        results = list(
            pool.map(
                lambda p: (p.name, _run(tool, "test", "rules", str(rules_dir / p.name))), unit_test_files()
            )
        )
    failed = [f"{name}:\n{r.stdout}{r.stderr}" for name, r in results if r.returncode != 0]
    assert not failed, "\n".join(failed)


def test_promtool_unit_tests_can_fail(rules_dir: Path, tmp_path: Path) -> None:
    # The same test with the healthy expectation turned around must fail.
    for name in ("rules.yaml", "availability.yaml"):
        shutil.copy(rules_dir / name, tmp_path / name)
    test = yaml.safe_load((tmp_path / "availability.yaml").read_text(encoding="utf-8"))
    (healthy,) = [t for t in test["tests"] if t["name"] == "healthy"]
    healthy["alert_rule_test"][0]["exp_alerts"] = [{"exp_labels": {"severity": "critical"}}]
    test["tests"] = [healthy]
    (tmp_path / "availability.yaml").write_text(yaml.safe_dump(test), encoding="utf-8")
    result = _run(promtool(), "test", "rules", str(tmp_path / "availability.yaml"))
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in unit_test_files():
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert document["rule_files"] == ["rules.yaml"], path.name
        for test in document["tests"]:
            for check in test.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = alert_names()
    assert names - fires == set(), "alerts without a test where they fire"
    assert names - quiet == set(), "alerts without a test where they stay quiet"
    assert (fires | quiet) <= names, "tests of alerts that do not exist"


def test_the_availability_certificate_and_replication_alerts_exist() -> None:
    rules = {r["alert"]: r["expr"] for g in rule_groups() for r in g["rules"]}
    assert 'absent(up{job="shardd"})' in rules["ShardDaemonsAbsent"]
    assert 'absent(up{job="router"})' in rules["RouterAbsent"]
    assert "< 1" in rules["ShardDown"] and "by (namespace, shard)" in rules["ShardDown"]
    assert 'router_requests_total{code="UNAVAILABLE"}' in rules["RouterUnavailableRatioHigh"]
    assert "certmanager_certificate_expiration_timestamp_seconds" in rules["CertificateExpiresSoon"]
    assert "cnpg_pg_replication_lag" in rules["PostgresReplicationLagHigh"]
    assert "cnpg_pg_replication_streaming_replicas" in rules["PostgresStandbyLost"]


def test_the_shard_map_alerts_compare_every_process_and_the_databases() -> None:
    rules = {r["alert"]: r for g in rule_groups() for r in g["rules"]}
    skew = rules["ShardMapVersionSkew"]
    # routers and daemons together, per namespace: the newest map in force minus the oldest
    both = '{__name__=~"router_shard_map_version|shardd_shard_map_version"}'
    assert f"max by (namespace) ({both})" in skew["expr"] and f"min by (namespace) ({both})" in skew["expr"]
    assert skew["for"] == "5m"
    behind = rules["ShardMapBehindDatabases"]
    assert "shardd_ownership_overrides" in behind["expr"] and "> 0" in behind["expr"]
    assert behind["for"] == "10m"
    assert (UNIT_TESTS / "shard-map.yaml") in unit_test_files()


def test_alerts_use_the_jobs_and_labels_the_monitors_make() -> None:
    rendered = objects("prod")
    monitors = {
        (o["kind"], o["metadata"]["name"]): o
        for o in rendered
        if o["kind"] in ("ServiceMonitor", "PodMonitor")
    }
    shardd = monitors[("ServiceMonitor", "shardd")]["spec"]
    # job `shardd` from the Services' label, `shard` by relabelling, on every endpoint
    assert shardd["jobLabel"] == "app.kubernetes.io/name"
    for endpoint in shardd["endpoints"]:
        assert {
            "sourceLabels": ["__meta_kubernetes_service_label_shard_router_shard"],
            "targetLabel": "shard",
        } in (endpoint["relabelings"])
    services = [o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"].startswith("shardd-")]
    assert services and {s["metadata"]["labels"]["app.kubernetes.io/name"] for s in services} == {"shardd"}
    assert all(s["metadata"]["labels"]["shard-router/shard"] for s in services)
    # job `postgres` from the CNPG pods' inherited label, `cluster` by relabelling
    postgres = monitors[("PodMonitor", "postgres")]["spec"]
    assert postgres["jobLabel"] == "app.kubernetes.io/name"
    for cluster in (o for o in rendered if o["kind"] == "Cluster"):
        assert cluster["spec"]["inheritedMetadata"]["labels"]["app.kubernetes.io/name"] == "postgres"
    (endpoint,) = postgres["podMetricsEndpoints"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_cnpg_io_cluster"], "targetLabel": "cluster"} in (
        endpoint["relabelings"]
    )
    # the standby count the alert expects: instances - 1
    standby_lost = next(
        r["expr"] for g in rule_groups() for r in g["rules"] if r["alert"] == "PostgresStandbyLost"
    )
    for cluster in (o for o in rendered if o["kind"] == "Cluster"):
        assert f"< {cluster['spec']['instances'] - 1}" in standby_lost


def test_missing_promtool_fails_where_it_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)
    monkeypatch.setenv("SHARD_ROUTER_REQUIRE_PROMTOOL", "1")
    with pytest.raises(pytest.fail.Exception, match="promtool is not installed"):
        promtool()
    monkeypatch.delenv("SHARD_ROUTER_REQUIRE_PROMTOOL")
    with pytest.raises(pytest.skip.Exception, match="promtool is not installed"):
        promtool()
