"""The Grafana dashboard shipped with the chart: valid JSON Grafana can load, panels over the
topics a fleet operator watches (each query's metric names are checked against the exporters by
tests/helm/test_chart_metrics.py), and the ConfigMap Grafana's sidecar picks up."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.helm.chart import CHART, FULLNAME, RELEASE, by_kind, helm, run_helm  # noqa: F401
from tests.helm.promql import dashboard_queries, promql_metric_names

BOARD_PATH = CHART / "dashboards" / "kvmesh.json"


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads(BOARD_PATH.read_text())


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def test_dashboard_is_a_loadable_grafana_model(board):
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    for p in panels(board):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for target in p["targets"]:
            # one release's namespace at a time: two fleets in one Prometheus do not mix
            assert 'namespace="$namespace"' in target["expr"], (p["title"], target["expr"])


def test_panels_cover_the_fleet_per_pool(board):
    names = set().union(*(promql_metric_names(q) for q in dashboard_queries(board)))
    for wanted in ("kvmesh_engine_running", "kvmesh_engine_waiting", "kvmesh_time_to_first_token_seconds_bucket",
                   "kvmesh_inter_token_latency_seconds_bucket", "kvmesh_e2e_request_latency_seconds_bucket",
                   "kvmesh_kv_usage_ratio", "kvmesh_cluster_prefix_hit_ratio", "kvmesh_prefix_cache_hit_tokens",
                   "kvmesh_worker_kv_handoffs_total", "kvmesh_kv_tier_loaded_blocks",
                   "kvmesh_worker_pending_prompt_tokens", "kvmesh_planner_desired_replicas"):
        assert wanted in names, f"no panel reads {wanted}"
    per_pool = [q for q in dashboard_queries(board) if re.search(r"by \((le, )?component\)", q)]
    assert len(per_pool) >= 6, "pools are told apart by the ServiceMonitor's `component` label"


def render(helm: str, tmp_path, *args: str) -> list[dict]:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_configmap_carries_the_dashboard_with_the_sidecar_label(helm, tmp_path, board):
    assert f"{FULLNAME}-dashboards" not in by_kind(render(helm, tmp_path), "ConfigMap")
    cm = by_kind(render(helm, tmp_path, "--set", "grafana.dashboards.enabled=true"), "ConfigMap")[f"{FULLNAME}-dashboards"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "llm"
    assert json.loads(cm["data"]["kvmesh.json"]) == board
    cm = by_kind(render(helm, tmp_path, "--set", "grafana.dashboards.enabled=true",
                        "--set", "grafana.dashboards.label=dashboards", "--set", "grafana.dashboards.labelValue=kvmesh",
                        "--set", "grafana.dashboards.namespace=monitoring",
                        "--set", "grafana.dashboards.annotations.grafana_folder=LLM"), "ConfigMap")[f"{FULLNAME}-dashboards"]
    assert cm["metadata"]["labels"]["dashboards"] == "kvmesh" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
