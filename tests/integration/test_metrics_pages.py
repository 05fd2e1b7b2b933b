"""`kvmesh serve`'s processes each serve a /metrics page of their own service's families: a fleet
scrape never sees, say, the gateway's request counters at zero on every worker pod."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack import records
from tests.integration.test_prefix_routing import serve

OWN = {  # a family each page must show, and families of other services it must not
    "gateway": ("kvmesh_requests", ("kvmesh_engine_running", "kvmesh_scheduler_queue_depth")),
    "scheduler": ("kvmesh_scheduler_queue_depth", ("kvmesh_requests", "kvmesh_kv_free_blocks")),
    "worker": ("kvmesh_kv_free_blocks", ("kvmesh_requests", "kvmesh_scheduler_queue_depth", "kvmesh_tokenize_seconds")),
    "tokenizer": ("kvmesh_tokenize_seconds", ("kvmesh_requests", "kvmesh_engine_running")),
    "prefix-cache": ("kvmesh_prefix_index_blocks", ("kvmesh_requests", "kvmesh_engine_running")),
}


def families(url: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(httpx.get(url, timeout=5).text)}


def test_each_process_serves_its_own_families(tiny_model, tmp_path):
    # --no-text-in-gateway: the tokenizer service runs (and tokenizes) only then; two workers: the
    # prefix-cache index runs only where the scheduler has a choice of worker
    with serve(tiny_model, 2, tmp_path / "serve.log", "--no-text-in-gateway") as (base, redis_url):
        httpx.post(base + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
                   timeout=30).raise_for_status()
        pages = {"gateway": base + "/metrics"}
        for kind in ("scheduler", "worker", "tokenizer", "prefix-cache"):
            pages[kind] = records(redis_url, kind)[0].addrs["metrics"]
        for kind, url in pages.items():
            shown = families(url)
            own, others = OWN[kind]
            assert own in shown, (kind, sorted(shown))
            assert not shown & set(others), (kind, shown & set(others))
            assert any(n.startswith("process_") or n.startswith("python_") for n in shown), kind
