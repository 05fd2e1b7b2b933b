"""Every metric family a kvmesh process exports, read from the processes' own registries and
collectors (so it cannot drift from them), with its vLLM equivalent: the source of
docs/metrics.md (`metrics_markdown()`; tests/services/test_metrics_docs.py keeps the file equal)
and of the chart tests' list of exported series.
"""
from __future__ import annotations

from typing import NamedTuple

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from services import metrics
from services.metrics import SERVICES

# kvmesh family -> (vLLM metric, how they differ); only where the two measure the same thing
VLLM_EQUIVALENT: dict[str, tuple[str, str]] = {
    "kvmesh_engine_running": ("vllm:num_requests_running", ""),
    "kvmesh_engine_waiting": ("vllm:num_requests_waiting", ""),
    "kvmesh_kv_usage_ratio": ("vllm:kv_cache_usage_perc", "both a fraction from 0 to 1"),
    "kvmesh_prefix_cache_query_tokens": ("vllm:prefix_cache_queries",
                                         "vLLM's is a counter; this gauge holds the engine's running total"),
    "kvmesh_prefix_cache_hit_tokens": ("vllm:prefix_cache_hits",
                                       "vLLM's is a counter; this gauge holds the engine's running total"),
    "kvmesh_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",
                                           "measured at the gateway: HTTP arrival to the first token read"),
    "kvmesh_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                           "gaps between streamed chunks at the gateway"),
    "kvmesh_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds", ""),
    "kvmesh_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", ""),
    "kvmesh_requests": ("vllm:request_success", "vLLM counts finished requests by finished_reason; this, "
                                                "HTTP requests by route and status"),
    "kvmesh_prompt_tokens": ("vllm:prompt_tokens", ""),
    "kvmesh_generation_tokens": ("vllm:generation_tokens", "per gateway; kvmesh_worker_generated_tokens per worker"),
    "kvmesh_worker_request_queue_seconds": ("vllm:request_queue_time_seconds", ""),
    "kvmesh_worker_request_prefill_seconds": ("vllm:request_prefill_time_seconds", ""),
    "kvmesh_worker_request_decode_seconds": ("vllm:request_decode_time_seconds", ""),
    "kvmesh_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "labelled by method"),
    "kvmesh_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "labelled by method"),
    "kvmesh_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "labelled by method"),
    "kvmesh_spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",
                                                       "labelled by method and position"),
}
# vLLM metrics with no kvmesh family, and why
VLLM_WITHOUT_EQUIVALENT: dict[str, str] = {
    "vllm:num_preemptions": "kvmesh does not count preemptions yet",
    "vllm:iteration_tokens_total": "kvmesh_engine_step_seconds times a step instead of counting its tokens",
    "vllm:request_prompt_tokens": "no per-request token-count histograms; kvmesh_prompt_tokens_total counts them",
    "vllm:request_generation_tokens": "no per-request token-count histograms; "
                                      "kvmesh_generation_tokens_total counts them",
}
# families exported outside the registries above: `kvmesh serve`'s one-page view (services/fleet_metrics.py)
SERVE_FAMILIES = (("kvmesh_fleet_page_up", "gauge", ("service", "worker"),
                   "1 when a local service's /metrics answered this scrape of the fleet page, else 0"),)
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


class MetricDoc(NamedTuple):
    family: str
    type: str                    # counter | gauge | histogram
    labels: tuple[str, ...]
    services: tuple[str, ...]    # the processes whose /metrics show it
    help: str

    @property
    def series(self) -> tuple[str, ...]:
        """The names PromQL selects (a counter's `_total`, a histogram's `_bucket`, `_sum`, `_count`)."""
        return tuple(self.family + s for s in SERIES_SUFFIXES[self.type])


def _registered() -> list[MetricDoc]:
    shown = {s: {f.name for f in metrics.service_registry(s).collect()} for s in SERVICES}
    docs = []
    for collector in list(REGISTRY._collector_to_names):
        if isinstance(collector, MetricWrapperBase) and collector._name.startswith("kvmesh_"):
            by = tuple(s for s in SERVICES if collector._name in shown[s])
            docs.append(MetricDoc(collector._name, collector._type, tuple(collector._labelnames), by,
                                  collector._documentation))
    return docs


def _prefix_index() -> list[MetricDoc]:
    """The prefix-cache index's families, read off its collector over an empty index."""
    try:
        from prefix_cache_svc.core import PrefixCore
        from prefix_cache_svc.metrics import CoreCollector
    except ImportError:          # the optional prefix-cache package is not installed
        return []
    return [MetricDoc(f.name, f.type, tuple(getattr(f, "_labelnames", ())), ("prefix-cache",), f.documentation)
            for f in CoreCollector(PrefixCore(16)).collect()]


def catalog() -> list[MetricDoc]:
    """Every kvmesh family, sorted by name."""
    try:
        import prefix_cache_svc.metrics  # noqa: F401  (registers its histogram)
    except ImportError:
        pass
    docs = _registered() + _prefix_index()
    docs += [MetricDoc(name, kind, labels, ("serve",), help_) for name, kind, labels, help_ in SERVE_FAMILIES]
    return sorted(docs)


def series_names() -> set[str]:
    return {name for doc in catalog() for name in doc.series}


def metrics_markdown() -> str:
    """docs/metrics.md's tables."""
    rows = ["| metric | type | labels | shown by | meaning | vLLM |", "|---|---|---|---|---|---|"]
    for d in catalog():
        name = f"`{d.series[0]}`" if d.type != "histogram" else f"`{d.family}` (`_bucket`, `_sum`, `_count`)"
        vllm, note = VLLM_EQUIVALENT.get(d.family, ("", ""))
        vllm_text = f"`{vllm}`" + (f" ({note})" if note else "") if vllm else ""
        text = " ".join(d.help.split()).replace("|", "\\|")
        rows.append(f"| {name} | {d.type} | {', '.join(d.labels)} | {', '.join(d.services)} | {text} | {vllm_text} |")
    rows += ["", "| vLLM metric | in kvmesh |", "|---|---|"]
    rows += [f"| `{name}` | {why} |" for name, why in sorted(VLLM_WITHOUT_EQUIVALENT.items())]
    return "\n".join(rows)
