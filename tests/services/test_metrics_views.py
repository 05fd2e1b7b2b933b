"""Each service's /metrics page shows its own families and the process ones, never another service's
(every process creates every metric: services/metrics.py)."""
from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services import metrics
from services.metrics import SERVICES, _FAMILIES, serve_metrics, service_registry

# a gateway with --text-in-gateway detokenizes too: the only families two services share
DETOKENIZER_FAMILIES = {"kvmesh_detok_first_token_seconds", "kvmesh_detok_dropped_tokens",
                        "kvmesh_detok_migration_stall_seconds", "kvmesh_detok_migrations"}


def families(text: str) -> set[str]:
    """Family names on a page (the text format's `_created` series parse as families of their own)."""
    return {f.name for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def kvmesh_families(service: str) -> set[str]:
    return {n for n in families(generate_latest(service_registry(service)).decode()) if n.startswith("kvmesh_")}


def test_every_kvmesh_metric_belongs_to_a_service():
    import prefix_cache_svc.metrics  # noqa: F401  (its histogram is the prefix-cache's)
    from prometheus_client import REGISTRY
    claimed = set().union(*_FAMILIES.values())
    unclaimed = {f.name for f in REGISTRY.collect() if f.name.startswith("kvmesh_")} - claimed
    assert not unclaimed, f"tag these with services.metrics.shown_by: {sorted(unclaimed)}"


EVERY_SERVICE = {"kvmesh_dropped_frames"}     # every process has internal sockets


def test_each_service_shows_only_its_own_families():
    import prefix_cache_svc.metrics  # noqa: F401
    shown = {s: kvmesh_families(s) for s in SERVICES}
    assert {"kvmesh_requests", "kvmesh_time_to_first_token_seconds"} <= shown["gateway"]
    assert {"kvmesh_engine_running", "kvmesh_kv_free_blocks", "kvmesh_engine_step_seconds"} <= shown["worker"]
    assert {"kvmesh_scheduler_queue_depth", "kvmesh_worker_kv_usage_ratio"} <= shown["scheduler"]
    assert {"kvmesh_tokenize_seconds", "kvmesh_detok_first_token_seconds"} <= shown["tokenizer"]
    assert shown["prefix-cache"] == {"kvmesh_prefix_match_seconds", *EVERY_SERVICE}
    assert all(EVERY_SERVICE <= families for families in shown.values())
    assert "kvmesh_engine_running" not in shown["gateway"] and "kvmesh_requests" not in shown["worker"]
    # a gateway with --text-in-gateway observes the detokenizer's first-token stage
    assert "kvmesh_detok_first_token_seconds" in shown["gateway"]
    for a in SERVICES:
        for b in SERVICES:
            if a != b:
                assert not (shown[a] & shown[b]) - DETOKENIZER_FAMILIES - EVERY_SERVICE, (a, b, shown[a] & shown[b])


def test_a_service_page_keeps_the_process_families_and_live_values():
    metrics.KV_FREE_BLOCKS.set(123)
    port = serve_metrics("127.0.0.1", 0, "worker")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "kvmesh_kv_free_blocks 123.0" in text
    assert "python_gc_objects_collected" in families(text) or "python_gc_objects_collected_total" in text
    assert "kvmesh_requests" not in families(text)
    gateway_page, _ = metrics.render()
    assert "kvmesh_kv_free_blocks" not in families(gateway_page.decode())


def test_metrics_off():
    assert serve_metrics("127.0.0.1", -1, "worker") == -1
