"""docs/metrics.md is the processes' own registries: every exported family, its labels and its
vLLM equivalent (services/metrics_catalog.py). A new or changed metric must be documented in the
same commit: paste services.metrics_catalog.metrics_markdown()."""
from __future__ import annotations

from pathlib import Path

from services import metrics
from services.metrics_catalog import VLLM_EQUIVALENT, VLLM_WITHOUT_EQUIVALENT, catalog, metrics_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_docs_hold_the_generated_tables():
    assert metrics_markdown() in DOC.read_text(encoding="utf-8"), (
        "docs/metrics.md is stale: paste services.metrics_catalog.metrics_markdown()")


def test_every_family_on_any_service_page_is_in_the_catalog():
    documented = {d.family for d in catalog()}
    for service in metrics.SERVICES:
        shown = {f.name for f in metrics.service_registry(service).collect() if f.name.startswith("kvmesh_")}
        assert shown <= documented, f"{service}: {sorted(shown - documented)} undocumented"
    assert {"kvmesh_prefix_hit_rate", "kvmesh_prefix_match_seconds", "kvmesh_fleet_page_up",
            "kvmesh_planner_desired_replicas"} <= documented


def test_vllm_names_map_to_real_families():
    documented = {d.family for d in catalog()}
    assert set(VLLM_EQUIVALENT) <= documented
    named = {v for v, _ in VLLM_EQUIVALENT.values()} | set(VLLM_WITHOUT_EQUIVALENT)
    for vllm in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success",
                 "vllm:spec_decode_num_accepted_tokens"):
        assert vllm in named, f"docs/metrics.md says nothing of {vllm}"


# A metric name the prose docs write must be one the processes export (a family, or one of its
# series); the only exception is the chart README's upgrade note naming what an old chart's HPA read.
PROSE = ["README.md", "docs/architecture.md", "docs/services.md", "docs/kv_events.md", "docs/bad-input.md",
         "helm/kvmesh/README.md", "BENCHMARKS.md"]
NOT_EXPORTED_ON_PURPOSE = {"kvmesh_waiting_requests"}


def test_every_metric_the_docs_name_is_exported():
    import re
    root = DOC.parents[1]
    known = {d.family for d in catalog()} | {s for d in catalog() for s in d.series}
    unknown = {f"{doc}: {name}" for doc in PROSE
               for name in re.findall(r"\bkvmesh_[a-z0-9_]*[a-z0-9]\b", (root / doc).read_text(encoding="utf-8"))
               if name not in known | NOT_EXPORTED_ON_PURPOSE}
    assert not unknown, f"the docs name metrics no process exports: {sorted(unknown)}"
