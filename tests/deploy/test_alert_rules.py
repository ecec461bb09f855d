"""The alert rules (deploy/k8s/monitoring) against recorded series, with `promtool test rules`.

The rule groups come from the rendered PrometheusRule (`kubectl kustomize deploy/k8s/monitoring`),
written as a plain rules file into a temporary directory next to copies of the unit-test files in
deploy/k8s/monitoring/tests/. `promtool check rules` checks the full rules (annotation templates
included); the unit tests run on a copy without annotations, so that they compare alerts by their
labels. promtool comes with Debian's `prometheus` package, which .ci/run installs; CI sets
SHARD_ROUTER_REQUIRE_PROMTOOL=1, so there a missing promtool fails these tests. Elsewhere (the
README's test command on a machine without it) they are skipped with a line saying what to install.

Every alert links a runbook (`runbook_url`): a section of a file in docs/runbooks/, under the one base
URL set in monitoring/kustomization.yaml; and every monitoring object carries the `release:` label
that kube-prometheus-stack selects on, set in the same file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_k8s_manifests import K8S, ROOT, objects

UNIT_TESTS = K8S / "monitoring" / "tests"
MONITORING = K8S / "monitoring"
RUNBOOKS = ROOT / "docs" / "runbooks"
#: What alerts.yaml writes in front of every runbook's file name; kustomize replaces it.
RUNBOOK_PLACEHOLDER = "RUNBOOK_BASE_URL"


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
    assert 'router_requests_total{code="UNAVAILABLE", shard!="none"}' in rules["RouterUnavailableRatioHigh"]
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


# --- runbooks ---------------------------------------------------------------------------------------


def _kustomization() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((MONITORING / "kustomization.yaml").read_text(encoding="utf-8"))
    return document


def runbook_base_url() -> str:
    """The one base URL of the runbooks: the literal `base-url` of the generator `runbook-base-url`."""
    (generator,) = [g for g in _kustomization()["configMapGenerator"] if g["name"] == "runbook-base-url"]
    (literal,) = generator["literals"]
    key, _, url = literal.partition("=")
    assert key == "base-url" and url and not url.endswith("/"), literal
    return url


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading: lower case, punctuation but
    `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def markdown_anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            anchors.add(github_anchor(m.group(1)))
    return anchors


def runbook_problems(rules: list[dict[str, Any]], base_url: str, runbooks: Path) -> list[str]:
    """What is wrong with the rules' runbook links: every alert needs a `runbook_url` under
    `base_url` naming a Markdown file in `runbooks` and an anchor of one of its headings."""
    problems: list[str] = []
    for rule in rules:
        if "alert" not in rule:
            continue
        name = rule["alert"]
        url = rule.get("annotations", {}).get("runbook_url")
        if not url:
            problems.append(f"{name}: no runbook_url")
            continue
        if not url.startswith(base_url + "/"):
            problems.append(f"{name}: {url} is not under {base_url}/")
            continue
        page, _, anchor = url[len(base_url) + 1 :].partition("#")
        path = runbooks / page
        if "/" in page or not page.endswith(".md") or not path.is_file():
            problems.append(f"{name}: {page} is not a runbook in {runbooks}")
        elif not anchor or anchor not in markdown_anchors(path):
            problems.append(f"{name}: {page} has no heading with the anchor #{anchor}")
    return problems


def _rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"]]


def test_every_alert_links_a_section_of_its_runbook() -> None:
    assert runbook_problems(_rules(), runbook_base_url(), RUNBOOKS) == []
    # the prod overlay renders the same links
    prod = [
        r
        for o in objects("prod")
        if o["kind"] == "PrometheusRule"
        for g in o["spec"]["groups"]
        for r in g["rules"]
    ]
    assert runbook_problems(prod, runbook_base_url(), RUNBOOKS) == []


def test_runbook_links_that_lead_nowhere_are_reported(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## SomeAlert\n\n```\n# NotAHeading\n```\n", encoding="utf-8")
    base = "https://example.org/runbooks"
    rules = [
        {"alert": "Good", "annotations": {"runbook_url": f"{base}/a.md#somealert"}},
        {"alert": "NoLink", "annotations": {"summary": "x"}},
        {"alert": "OtherBase", "annotations": {"runbook_url": "https://elsewhere/a.md#somealert"}},
        {"alert": "NoFile", "annotations": {"runbook_url": f"{base}/b.md#somealert"}},
        {"alert": "NoAnchor", "annotations": {"runbook_url": f"{base}/a.md#missing"}},
        {"alert": "InCode", "annotations": {"runbook_url": f"{base}/a.md#notaheading"}},
        {"record": "not:an:alert", "expr": "1"},
    ]
    problems = runbook_problems(rules, base, tmp_path)
    assert [p.split(":")[0] for p in problems] == ["NoLink", "OtherBase", "NoFile", "NoAnchor", "InCode"]


def test_the_runbook_base_url_is_set_in_one_place() -> None:
    base = runbook_base_url()
    raw = (MONITORING / "alerts.yaml").read_text(encoding="utf-8")
    # alerts.yaml names the placeholder only, once per alert; the URL itself is nowhere but the kustomization
    raw_links = re.findall(r"^\s*runbook_url:\s*(\S+)\s*$", raw, flags=re.MULTILINE)
    assert len(raw_links) == len(alert_names())
    assert all(link.startswith(RUNBOOK_PLACEHOLDER + "/") for link in raw_links), raw_links
    assert base not in raw
    for target in ("monitoring", "prod"):
        rendered = objects(target)
        assert RUNBOOK_PLACEHOLDER not in yaml.safe_dump(rendered), target
        # the generator's ConfigMap is kustomize's own (local-config): never applied
        assert not [o for o in rendered if o["metadata"]["name"] == "runbook-base-url"], target


def test_every_runbook_file_is_linked_or_an_index() -> None:
    linked = {
        r["annotations"]["runbook_url"].split("#")[0].rsplit("/", 1)[-1] for r in _rules() if "alert" in r
    }
    # restore-one-shard.md is a procedure the backup runbooks link to, README.md the index
    others = {p.name for p in RUNBOOKS.glob("*.md")} - linked - {"README.md", "restore-one-shard.md"}
    assert others == set(), "runbooks no alert links"
    index = (RUNBOOKS / "README.md").read_text(encoding="utf-8")
    assert all(f"({name})" in index for name in linked), "runbooks missing from docs/runbooks/README.md"


# --- the label Prometheus selects on -------------------------------------------------------------------


def release_label() -> dict[str, str]:
    """The `labels:` entry of monitoring/kustomization.yaml: the one place the label is set."""
    (entry,) = _kustomization()["labels"]
    assert entry["includeSelectors"] is False
    pairs: dict[str, str] = entry["pairs"]
    assert "release" in pairs
    return pairs


@pytest.mark.parametrize("target", ["monitoring", "prod"])
def test_prometheus_objects_carry_the_release_label(target: str) -> None:
    label = release_label()
    kinds = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
    rendered = [o for o in objects(target) if o["kind"] in kinds]
    assert {o["kind"] for o in rendered} >= {"ServiceMonitor", "PrometheusRule"}
    if target == "prod":  # the databases' PodMonitor too, set in its own kustomization
        assert "PodMonitor" in {o["kind"] for o in rendered}
    for o in rendered:
        assert label.items() <= o["metadata"]["labels"].items(), o["metadata"]["name"]
        # never in a selector: the Services and pods do not carry it
        assert "release" not in yaml.safe_dump(o.get("spec", {}).get("selector", {})), o["metadata"]["name"]
    for name in ("service-monitors.yaml", "alerts.yaml"):
        assert "release:" not in (MONITORING / name).read_text(encoding="utf-8"), name


# --- the alerts issue 28 asked for ---------------------------------------------------------------------


def test_latency_backup_disk_and_slot_alerts_exist() -> None:
    rules = {r["alert"]: r["expr"] for r in _rules() if "alert" in r}
    assert "histogram_quantile(0.99" in rules["ShardGuardedCallLatencyHigh"]
    assert "shardd_handler_duration_seconds_bucket" in rules["ShardGuardedCallLatencyHigh"]
    assert "by (namespace, shard, le)" in rules["ShardGuardedCallLatencyHigh"]
    assert "router_request_duration_seconds_bucket" in rules["RouterLatencyHigh"]
    # per shard the router forwarded to (its `shard` label), so the alert names the slow one
    router_p99 = rules["RouterLatencyHigh"]
    assert "by (namespace, shard, le)" in router_p99
    assert "sum by (namespace, shard) (rate(router_request_duration_seconds_count" in router_p99
    assert 'outcome="shed"' in rules["ShardAdmissionShedding"]
    assert "cnpg_pg_stat_archiver_failed_count" in rules["PostgresWALArchivingFailing"]
    assert "cnpg_pg_stat_archiver_seconds_since_last_archival" in rules["PostgresWALArchivingStalled"]
    for name in ("PostgresBackupTooOld", "PostgresBackupFailed"):
        assert "barman_cloud_cloudnative_pg_io_last_available_backup_timestamp" in rules[name]
        assert "cnpg_collector_last_available_backup_timestamp" in rules[name]
    for name in ("PostgresVolumeFillingUp", "PostgresVolumeAlmostFull"):
        assert "kubelet_volume_stats_available_bytes" in rules[name]
        assert "kubelet_volume_stats_capacity_bytes" in rules[name]
    assert "predict_linear" in rules["PostgresVolumeFillingUp"]
    for name in ("PostgresReplicationSlotRetainingWAL", "PostgresReplicationSlotNearLimit"):
        assert "cnpg_pg_replication_slots_pg_wal_lsn_diff" in rules[name]


_PG_UNITS = {"kB": 1, "MB": 1024, "GB": 1024**2, "TB": 1024**3}


def test_the_slot_alerts_assume_the_clusters_max_slot_wal_keep_size() -> None:
    rules = {r["alert"]: r["expr"] for r in _rules() if "alert" in r}
    assumed = {
        name: re.search(r"> 0\.\d+ \* (\d+) \* 1024 \* 1024 \* 1024", rules[name])
        for name in ("PostgresReplicationSlotRetainingWAL", "PostgresReplicationSlotNearLimit")
    }
    assert all(assumed.values()), rules
    (gib,) = {int(m.group(1)) for m in assumed.values() if m}
    settings = {
        c["metadata"]["name"]: c["spec"]
        .get("postgresql", {})
        .get("parameters", {})
        .get("max_slot_wal_keep_size")
        for c in objects("prod")
        if c["kind"] == "Cluster"
    }
    for cluster, value in settings.items():
        if value is None:  # unset: no cap (the alerts still say how much a slot keeps, against 8 GiB)
            continue
        m = re.fullmatch(r"(\d+)\s*(kB|MB|GB|TB)", str(value))
        assert m, f"{cluster}: max_slot_wal_keep_size {value!r}"
        assert int(m.group(1)) * _PG_UNITS[m.group(2)] == gib * 1024**2, (
            cluster,
            value,
            f"alerts assume {gib} GiB",
        )


def test_links_between_runbooks_resolve() -> None:
    broken = []
    for page in sorted(RUNBOOKS.glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file) if file else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in markdown_anchors(path):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def runbook_promql() -> list[tuple[str, str]]:
    """(page, query) of every query in the runbooks' ```promql blocks (queries are separated by a
    blank line or start on a line of their own)."""
    found: list[tuple[str, str]] = []
    for page in sorted(RUNBOOKS.glob("*.md")):
        for block in re.findall(r"```promql\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.DOTALL):
            query: list[str] = []
            for line in [*block.splitlines(), ""]:
                text = re.sub(r"\s+#.*$", "", line).rstrip()
                if query and (not text or not line.startswith(" ")):
                    found.append((page.name, " ".join(query)))
                    query = []
                if text:
                    query.append(text.strip())
    return found


def test_the_runbooks_promql_parses(tmp_path: Path) -> None:
    queries = runbook_promql()
    assert len(queries) > 10
    rules = [{"record": f"runbook:query{i}", "expr": q} for i, (_, q) in enumerate(queries)]
    path = tmp_path / "runbook-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "runbooks", "rules": rules}]}), encoding="utf-8")
    result = _run(promtool(), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr + "\n" + "\n".join(map(str, queries))
