"""The Grafana dashboard (deploy/k8s/monitoring/grafana-dashboard.json) against the metrics the code exports.

The exported names are not written down here: the test builds the instruments every process creates
(`ShardMetrics` with the map it follows, the database gauges of `ShardStateCollector`, and
`RouterMetrics`), gives each one a value, and reads the names from their Prometheus registries, as a
scrape would see them (`_total` on counters, `_bucket`/`_sum`/`_count` on histograms). A metric added to
the code is allowed on the dashboard at once; one renamed or removed fails here. A second check
compares those names with every instrument name written in shardrouter/, so an instrument created
somewhere the test does not build is noticed too.

Every PromQL query of the dashboard (panel targets and template variables) may name only those
metrics. The ConfigMap for the Grafana sidecar is checked as kustomize renders it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.metrics import CallbackOptions, Observation
from prometheus_client import CollectorRegistry

from shardrouter.core import metrics as core_metrics
from shardrouter.router.metrics import RouterMetrics
from shardrouter.shardd.idempotency.process_keys import CompletedKeys, KeyFlights
from shardrouter.shardd.idempotency.waiting import KeyWaits
from shardrouter.shardd.observability import ShardMetrics, ShardStateCollector
from tests.deploy.test_k8s_manifests import K8S, ROOT, objects

DASHBOARD = K8S / "monitoring" / "grafana-dashboard.json"
SOURCE = ROOT / "shardrouter"


# --- the names the code exports ----------------------------------------------------------------------


class _EveryInstrument:
    """A meter that creates the real instruments, but makes every observable one report 1 (their real
    callbacks read a database or a shard map), and remembers the synchronous ones to record a value."""

    def __init__(self, meter: Any) -> None:
        self._meter = meter
        self.synchronous: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        create = getattr(self._meter, name)
        if not name.startswith("create_"):
            return create
        if name.startswith("create_observable_"):

            def observable(instrument: str, callbacks: Any = None, **kwargs: Any) -> Any:
                def one(_options: CallbackOptions) -> list[Observation]:
                    return [Observation(1)]

                return create(instrument, callbacks=[one], **kwargs)

            return observable

        def synchronous(instrument: str, **kwargs: Any) -> Any:
            made = create(instrument, **kwargs)
            self.synchronous.append(made)
            return made

        return synchronous


def _registry_names(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


def exported_metric_names(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every series name the router and the shard daemons expose, read from their registries."""
    meters: list[_EveryInstrument] = []

    def meter(pipeline: core_metrics.MetricsPipeline, name: str) -> _EveryInstrument:
        meters.append(_EveryInstrument(pipeline.provider.get_meter(name)))
        return meters[-1]

    monkeypatch.setattr(core_metrics.MetricsPipeline, "meter", meter)
    shard = ShardMetrics()
    router = RouterMetrics()
    try:
        # what `shardd serve` and `router` add once they follow a shard map and read their database
        shard.follow_ownership(None)  # type: ignore[arg-type]
        shard.follow_key_waits(KeyWaits(None, KeyFlights(), CompletedKeys(max_entries=1, max_bytes=1)))  # type: ignore[arg-type]
        ShardStateCollector(None, retention=timedelta(days=30), metrics=shard)  # type: ignore[arg-type]
        router.follow_shard_map(None)  # type: ignore[arg-type]
        for m in meters:
            for instrument in m.synchronous:
                (instrument.add if hasattr(instrument, "add") else instrument.record)(1)
        return _registry_names(shard.registry) | _registry_names(router.registry)
    finally:
        shard.shutdown()
        router.shutdown()


@pytest.fixture(scope="module")
def exported() -> Iterator[set[str]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield exported_metric_names(monkeypatch)


_INSTRUMENT_IN_SOURCE = re.compile(
    r"""create_(?:observable_)?(?:counter|up_down_counter|gauge|histogram)\(\s*["']([a-z_:][a-z0-9_:]*)["']"""
    r"""|\(\s*["'](shardd_[a-z0-9_]+)["'],\s*["'][^"']*["'],"""  # the gauge table of ShardStateCollector
)


def instrument_names_in_source() -> set[str]:
    names: set[str] = set()
    for path in SOURCE.rglob("*.py"):
        for m in _INSTRUMENT_IN_SOURCE.finditer(path.read_text(encoding="utf-8")):
            names.add(m.group(1) or m.group(2))
    return names


def test_the_exported_names_cover_every_instrument_in_the_code(exported: set[str]) -> None:
    in_source = instrument_names_in_source()
    assert {
        "shardd_requests",
        "shardd_handler_duration_seconds",
        "router_request_duration_seconds",
    } <= in_source
    # a series keeps the instrument's name, with _total, _bucket/_sum/_count or nothing added
    missing = {n for n in in_source if not any(e == n or e.startswith(n + "_") for e in exported)}
    assert missing == set(), "instruments the test does not build: add them to exported_metric_names()"
    assert {
        "shardd_requests_total",
        "shardd_handler_duration_seconds_bucket",
        "shardd_outbox_backlog",
        "shardd_shard_map_version",
        "router_request_duration_seconds_bucket",
        "router_shard_map_version",
    } <= exported


# --- the names a query uses --------------------------------------------------------------------------

_KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "inf",
        "nan",
    }
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL query (with Grafana's `$variables`) selects."""
    names = {
        alternative
        for m in re.finditer(r'__name__\s*=~?\s*"([^"]*)"', expr)
        for alternative in m.group(1).split("|")
    }
    text = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", text)  # strings (label_replace, label_values)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)\s*(\()?", text):
        word, call = m.group(1), m.group(2)
        if not call and word.lower() not in _KEYWORDS:
            names.add(word)
    # label_values(metric, label): the label is no metric
    for m in re.finditer(r"label_values\(\s*([a-zA-Z_:][\w:]*)[^,]*,\s*(\w+)\s*\)", expr):
        names.discard(m.group(2))
        names.add(m.group(1))
    return names


def test_metric_names_of_a_query() -> None:
    assert metric_names(
        "histogram_quantile(0.99, sum by (shard, le) (rate(shardd_handler_duration_seconds_bucket"
        '{namespace="$namespace", shard=~"$shard"}[$__rate_interval])))'
    ) == {"shardd_handler_duration_seconds_bucket"}
    assert metric_names(
        'sum by (shard, outcome) (rate(shardd_requests_total{outcome=~"replay|in_flight"}[5m]))'
        " / on (shard) group_left sum by (shard) (rate(shardd_requests_total[5m])) > bool 0.5"
    ) == {"shardd_requests_total"}
    assert metric_names("time() - max by (pod) (shardd_retention_last_success_timestamp_seconds)") == {
        "shardd_retention_last_success_timestamp_seconds"
    }
    assert metric_names('max({__name__=~"router_shard_map_version|shardd_shard_map_version"})') == {
        "router_shard_map_version",
        "shardd_shard_map_version",
    }
    assert metric_names('label_values(shardd_shard_map_version{namespace="$namespace"}, shard)') == {
        "shardd_shard_map_version"
    }
    assert metric_names('label_replace(up, "volume", "wal", "pvc", ".+-wal")') == {"up"}


# --- the dashboard -----------------------------------------------------------------------------------


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return dashboard


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    found: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [
        (f"panel {p['id']} {p.get('title')!r} target {t.get('refId')}", t["expr"])
        for p in all_panels(dashboard)
        for t in p.get("targets", [])
    ]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "query":
            query = variable["query"]
            found.append(
                (f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query)
            )
    return found


def dashboard_problems(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    """Queries naming metrics the code does not export, and panels that are no valid dashboard panel."""
    problems = [
        f"{where}: {name} is not exported by the code"
        for where, expr in queries(dashboard)
        for name in sorted(metric_names(expr) - exported)
    ]
    ids = [p.get("id") for p in all_panels(dashboard)]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids are missing or repeated: {ids}")
    for panel in all_panels(dashboard):
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        if not {"type", "title", "gridPos"} <= panel.keys():
            problems.append(f"{where}: needs type, title and gridPos")
        if panel.get("type") in ("row", "text"):
            continue
        if panel.get("datasource", {}).get("type") != "prometheus":
            problems.append(f"{where}: no Prometheus datasource")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{where}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(refs) != len(set(refs)) or not all(t.get("expr") for t in targets):
            problems.append(f"{where}: targets need an expr and distinct refIds")
    return problems


def test_every_query_names_only_exported_metrics_and_the_panels_are_valid(exported: set[str]) -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    assert dashboard_problems(dashboard, exported) == []


def test_a_made_up_metric_or_a_broken_panel_is_reported(exported: set[str]) -> None:
    dashboard = load_dashboard()
    panel = next(p for p in all_panels(dashboard) if p.get("targets"))
    panel["targets"].append({"refId": "Z", "expr": "sum(rate(shardd_dead_letters_made_up_total[5m]))"})
    broken = dict(next(p for p in all_panels(dashboard) if p.get("targets") and p is not panel))
    broken["datasource"] = {}
    dashboard["panels"].append(broken)  # no datasource, and its id twice
    problems = dashboard_problems(dashboard, exported)
    assert any("shardd_dead_letters_made_up_total is not exported" in p for p in problems), problems
    assert any("repeated" in p for p in problems) and any("no Prometheus datasource" in p for p in problems)


def test_the_dashboard_shows_what_a_shard_needs(exported: set[str]) -> None:
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "shard"} <= variables.keys()
    every = " ".join(expr for _, expr in queries(dashboard))
    used = metric_names(every)
    for needed in (
        "shardd_requests_total",  # calls by outcome, shedding
        "shardd_handler_duration_seconds_bucket",  # p50/p99 of guarded calls
        "router_request_duration_seconds_bucket",  # p50/p99 of the router
        "shardd_outbox_backlog",
        "shardd_idempotency_records",  # key-table size
        "shardd_retention_lag_seconds",
        "shardd_slot_move_active",  # moves
        "router_shard_map_version",
        "shardd_shard_map_version",
    ):
        assert needed in used, needed
    assert "histogram_quantile(0.5," in every and "histogram_quantile(0.99," in every
    # the router's p99 per shard it forwarded to (its `shard` label), beside the shards' own
    assert "histogram_quantile(0.99, sum by (shard, le) (rate(router_request_duration_seconds_bucket" in every
    assert 'outcome="shed"' in every
    # every shardd panel is per shard (the variable), every query in the chosen namespace
    for where, expr in queries(dashboard):
        if where.startswith("panel"):
            assert 'namespace="$namespace"' in expr, where
            if "shardd_" in expr:
                assert 'shard=~"$shard"' in expr, where


def test_the_dashboard_is_a_configmap_for_the_grafana_sidecar() -> None:
    for target in ("monitoring", "prod"):
        (configmap,) = [
            o
            for o in objects(target)
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "shard-router-dashboard"
        ]
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        (content,) = configmap["data"].values()
        assert json.loads(content) == load_dashboard()


def test_the_alerts_and_runbooks_name_only_exported_shardd_and_router_metrics(exported: set[str]) -> None:
    # The alert rules and the runbooks' PromQL read the same series: a shardd_*/router_* name there
    # must be exported too (the others come from Prometheus, the kubelet, cert-manager and CloudNativePG).
    from tests.deploy.test_alert_rules import rule_groups, runbook_promql

    exprs = [
        (rule.get("alert") or rule.get("record"), rule["expr"]) for g in rule_groups() for rule in g["rules"]
    ]
    unknown = {
        (where, name)
        for where, expr in [*exprs, *runbook_promql()]
        for name in metric_names(expr)
        if name.startswith(("shardd_", "router_")) and name not in exported
    }
    assert unknown == set()
