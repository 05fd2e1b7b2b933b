"""Every metric the chart's autoscalers and dashboard read is a series a real process exports: the
HorizontalPodAutoscalers (and the README's prometheus-adapter example), the KEDA ScaledObjects'
queries, the planner's default queries, the Grafana dashboard's queries, and every `kvmesh_*`
name written anywhere in the chart (values.yaml, templates, README, dashboards). A name no process
exports (say `kvmesh_waiting_requests`) gives the autoscaler no value, so it never scales, and a
panel stays empty, and nothing else says so.

Checked twice: against the registry each service's /metrics page is built from
(`services.metrics.service_registry`), and on the page of a real worker process started with the
environment the chart renders for each pool's pods (null model, real Redis, loopback ports).
"""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import prefix_cache_svc.metrics  # noqa: F401  (registers the prefix-cache index's families)
from services import metrics
from services.metrics_catalog import catalog, series_names as catalog_series
from services.planner.signals import QUERIES as PLANNER_QUERIES
from tests.helm.chart import CHART, FULLNAME, RELEASE, by_kind, helm, run_helm  # noqa: F401
from tests.helm.live_pod import start_pool_worker
from tests.helm.promql import dashboard_queries, promql_metric_names
from tests.helm.test_chart_probes_live import wait_serving
from tests.integration.stack import redis_and_procs

# Every HPA the chart can make, each pool and service autoscaled with its default metrics.
AUTOSCALED = ["--set", "worker.autoscaling.enabled=true", "--set", "workerPools.mixed.enabled=true",
              "--set", "gateway.autoscaling.enabled=true", "--set", "tokenizer.autoscaling.enabled=true"]
UNNAMED_TYPES = ("Resource", "ContainerResource")   # cpu / memory from the kubelet, not a process
SCRAPE_TIMEOUT_S = 60.0


SERIES_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                   "gauge": ("",), "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}


def exported_series(service: str) -> set[str]:
    """Sample names on `service`'s /metrics page (what Prometheus stores as series names),
    including those of labelled families with no child yet (no sample until one is used)."""
    names = set()
    for family in metrics.service_registry(service).collect():
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in SERIES_SUFFIXES.get(family.type, ())}
    return names


def render_docs(helm: str, tmp_path, *args: str) -> list[dict]:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def hpa_metric_names(docs: list[dict]) -> dict[str, tuple[str, list[str]]]:
    """HPA name -> (the service its Deployment runs, the custom metric names it reads)."""
    deps = by_kind(docs, "Deployment")
    out = {}
    for name, hpa in by_kind(docs, "HorizontalPodAutoscaler").items():
        target = deps[hpa["spec"]["scaleTargetRef"]["name"]]
        service = target["spec"]["template"]["metadata"]["labels"]["kvmesh.io/service"]
        names = []
        for m in hpa["spec"]["metrics"]:
            if m["type"] in UNNAMED_TYPES:
                continue
            names.append(m[m["type"][0].lower() + m["type"][1:]]["metric"]["name"])
        out[name] = (service, names)
    return out


def missing_metrics(docs: list[dict]) -> list[str]:
    return [f"{hpa}: {name} (not exported by the {service})"
            for hpa, (service, names) in hpa_metric_names(docs).items()
            for name in names if name not in exported_series(service)]


def test_every_hpa_reads_a_metric_its_pods_export(helm, tmp_path):
    docs = render_docs(helm, tmp_path, *AUTOSCALED)
    found = hpa_metric_names(docs)
    assert {f"{FULLNAME}-{p}" for p in ("prefill", "decode", "mixed")} <= set(found)
    assert all(names for hpa, (service, names) in found.items() if service == "worker")
    assert not missing_metrics(docs)


def test_the_check_catches_a_metric_nothing_exports(helm, tmp_path):
    """The check itself: a name nothing exports is reported, as is a counter named without its `_total`."""
    docs = render_docs(helm, tmp_path, *AUTOSCALED,
                       "--set", "workerPools.decode.autoscaling.metrics[0].type=Pods",
                       "--set", "workerPools.decode.autoscaling.metrics[0].pods.metric.name=kvmesh_waiting_requests",
                       "--set", "workerPools.decode.autoscaling.metrics[0].pods.target.type=AverageValue",
                       "--set", "workerPools.decode.autoscaling.metrics[0].pods.target.averageValue=4",
                       "--set", "workerPools.prefill.autoscaling.metrics[0].type=Pods",
                       "--set", "workerPools.prefill.autoscaling.metrics[0].pods.metric.name=kvmesh_worker_generated_tokens",
                       "--set", "workerPools.prefill.autoscaling.metrics[0].pods.target.type=AverageValue",
                       "--set", "workerPools.prefill.autoscaling.metrics[0].pods.target.averageValue=4")
    assert sorted(missing_metrics(docs)) == [
        f"{FULLNAME}-decode: kvmesh_waiting_requests (not exported by the worker)",
        f"{FULLNAME}-prefill: kvmesh_worker_generated_tokens (not exported by the worker)"]


def adapter_example() -> dict:
    """The prometheus-adapter rules in the chart README's Autoscaling section."""
    text = (CHART / "README.md").read_text()
    section = text.split("### Autoscaling", 1)[1]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    (rules,) = [yaml.safe_load(b) for b in blocks if b.startswith("rules:")]
    return rules


def series_of(query: str) -> list[str]:
    """Metric names a seriesQuery selects: `name{...}` or `{__name__=~"a|b",...}` with plain names."""
    m = re.match(r'^\{__name__=~"([a-zA-Z0-9_:|]+)"', query) or re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", query)
    assert m, f"cannot read the metric names of {query!r}"
    return m.group(1).split("|")


def test_readme_adapter_example_serves_the_default_hpas(helm, tmp_path):
    rules = adapter_example()["rules"]
    exposed = set()
    for rule in rules:
        for name in series_of(rule["seriesQuery"]):
            assert name in exported_series("worker"), f"README: the adapter asks for {name}, which no worker exports"
            exposed.add(name)   # names pass through unchanged (the rule renames nothing)
        assert rule.get("name", {}).get("as", "${1}") in ("${1}", "$1", "$0", "${0}"), rule
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}   # a per-pod metric
    wanted = {name for service, names in hpa_metric_names(render_docs(helm, tmp_path, *AUTOSCALED)).values()
              if service == "worker" for name in names}
    assert wanted <= exposed, f"the README's adapter rules do not expose {sorted(wanted - exposed)}"


def scrape(url: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(httpx.get(url, timeout=5).text) for s in f.samples}


@pytest.mark.parametrize("pool", ["prefill", "decode", "mixed"])
def test_a_worker_started_like_the_pools_pods_serves_its_hpa_metrics(helm, pool, tmp_path):
    docs = render_docs(helm, tmp_path, *AUTOSCALED)
    (_, wanted) = hpa_metric_names(docs)[f"{FULLNAME}-{pool}"]
    (tmp_path / "model").mkdir()
    with redis_and_procs(tmp_path) as (redis, procs):
        proc, env = start_pool_worker(docs, pool, f"{pool}-0", procs, redis.url, tmp_path / "model", tmp_path)
        wait_serving(int(env["KVMESH_HEALTH_PORT"]), proc)
        url = f"http://127.0.0.1:{env['KVMESH_METRICS_PORT']}/metrics"
        deadline = time.monotonic() + SCRAPE_TIMEOUT_S
        shown: set[str] = set()
        while time.monotonic() < deadline and not set(wanted) <= shown:
            shown = scrape(url)
            time.sleep(0.2)
        assert wanted and set(wanted) <= shown, f"{pool}: {sorted(set(wanted) - shown)} not on the worker's page"
        assert proc.poll() is None


# ----------------------------------------------------------------------------- every query's names

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# KEDA on every pool, each with its default query
KEDA_ALL = ["--set", "worker.keda.enabled=true", "--set", "worker.keda.serverAddress=http://prometheus:9090",
            "--set", "workerPools.mixed.enabled=true"]


def all_exported_series() -> set[str]:
    """Sample names on any kvmesh process's /metrics page (the prefix index's collector and the
    fleet page's families included)."""
    return set().union(*(exported_series(s) for s in metrics.SERVICES)) | catalog_series()


def all_exported_names() -> set[str]:
    """Series names and the family names they belong to (a histogram's, a counter's without _total)."""
    families = {f.name for s in metrics.SERVICES for f in metrics.service_registry(s).collect()}
    families |= {d.family for d in catalog()}
    return all_exported_series() | families


def keda_queries(docs: list[dict]) -> dict[str, str]:
    return {name: trig["metadata"]["query"] for name, obj in by_kind(docs, "ScaledObject").items()
            for trig in obj["spec"]["triggers"] if trig["type"] == "prometheus"}


def unexported(queries: dict[str, str], series: set[str]) -> list[str]:
    return sorted(f"{where}: {name}" for where, query in queries.items()
                  for name in promql_metric_names(query) if name not in series)


def all_queries(helm: str, tmp_path) -> dict[str, str]:
    """where -> PromQL, over KEDA (every pool on), the planner's defaults and every dashboard."""
    queries = {f"ScaledObject {n}": q for n, q in keda_queries(render_docs(helm, tmp_path, *KEDA_ALL)).items()}
    queries |= {f"planner {signal}": q for signal, q in PLANNER_QUERIES.items()}
    for path in DASHBOARDS:
        for i, q in enumerate(dashboard_queries(json.loads(path.read_text()))):
            queries[f"{path.name} #{i}"] = q
    return queries


def test_every_keda_planner_and_dashboard_query_reads_exported_series(helm, tmp_path):
    queries = all_queries(helm, tmp_path)
    assert sum(k.startswith("ScaledObject") for k in queries) == 3 and DASHBOARDS
    assert all(promql_metric_names(q) for q in queries.values()), "a query whose names were not found"
    assert not unexported(queries, all_exported_series())


def test_keda_queries_read_what_the_pools_workers_export(helm, tmp_path):
    assert not unexported(keda_queries(render_docs(helm, tmp_path, *KEDA_ALL)), exported_series("worker"))


def test_the_query_check_catches_a_name_nothing_exports(helm, tmp_path):
    docs = render_docs(helm, tmp_path, *KEDA_ALL, "--set",
                       "workerPools.decode.keda.query=avg(vllm:kv_cache_usage_perc{<<pool>>}) / max(kvmesh_kv_usage_ratio)")
    assert unexported(keda_queries(docs), all_exported_series()) == [f"{FULLNAME}-decode: vllm:kv_cache_usage_perc"]
    board = {"panels": [{"targets": [{"expr": 'histogram_quantile(0.9, sum by (le) (rate('
                                              'kvmesh_time_to_first_token_seconds{job="x"}[5m])))'}]}],
             "templating": {"list": [{"query": {"query": "label_values(kvmesh_worker_up, namespace)"}}]}}
    queries = dict(enumerate(dashboard_queries(board)))
    # a histogram is read through its _bucket series: the bare family name is not a series
    assert unexported(queries, all_exported_series()) == ["0: kvmesh_time_to_first_token_seconds",
                                                          "1: kvmesh_worker_up"]


def test_promql_names_are_read_correctly():
    assert promql_metric_names('sum by (le, component) (rate(a_bucket{x="y{z}",le!="1"}[$__rate_interval])) '
                               '/ on (pod) group_left b_total offset 5m > bool 0.5') == {"a_bucket", "b_total"}
    assert promql_metric_names("label_values(kvmesh_scheduler_workers, namespace)") == {"kvmesh_scheduler_workers"}


def chart_texts() -> dict[str, str]:
    files = [CHART / "values.yaml", CHART / "README.md", *sorted((CHART / "templates").iterdir()), *DASHBOARDS]
    return {str(p.relative_to(CHART)): p.read_text() for p in files}


# The chart README's upgrade note names the metric an older chart's HPA read and nothing exported.
NAMED_AS_NOT_EXPORTED = {"kvmesh_waiting_requests"}


def test_every_kvmesh_metric_named_in_the_chart_is_exported():
    names = all_exported_names() | NAMED_AS_NOT_EXPORTED
    missing = sorted({f"{where}: {m}" for where, text in chart_texts().items()
                      for m in re.findall(r"\bkvmesh_[a-z0-9_]+\b", text) if m not in names})
    assert not missing, f"the chart names metrics no kvmesh process exports: {missing}"
