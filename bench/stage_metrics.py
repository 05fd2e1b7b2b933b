"""Where a request's first token spends its time: the services' stage histograms, scraped from their
/metrics endpoints before and after a run, as means over the run (shared by serve_bench.py and
control_plane.py).

    before = scrape(gateway_url, records)          # records(kind) -> the registry's ServiceRecords
    ... run ...
    st = stage_means(before, scrape(gateway_url, records), client_ttft_ms=...)
    print("\\n".join(breakdown_lines(st)))

The stages and their clocks are drawn in services/metrics.py. Every one is a duration measured
inside one process; `hops_ms` is what the gateway's upstream stage (Submit sent -> first text delta
read) holds beyond the scheduler's, the worker's and the detokenizer's own stages: the ZMQ hops
between them (wake-ups and transfers; four, or three when the gateway detokenizes itself with
--text-in-gateway). At concurrency 1 every stage counts once per request; with more, a
detokenizer step can carry several requests' first tokens, so `hops_ms` is approximate.
"""
from __future__ import annotations

import urllib.request
from typing import Any, Callable

STAGE_HISTOGRAMS = (  # (results key, where scraped, histogram): means over a run, in ms
    ("gateway_ttft", "gateway", "kvmesh_time_to_first_token_seconds"),
    ("worker_ttft", "worker", "kvmesh_worker_time_to_first_token_seconds"),
    ("worker_queue", "worker", "kvmesh_worker_request_queue_seconds"),
    ("worker_prefill", "worker", "kvmesh_worker_request_prefill_seconds"),
    ("worker_decode", "worker", "kvmesh_worker_request_decode_seconds"),
    ("engine_step", "worker", "kvmesh_engine_step_seconds"),
    # the first token's path, stage by stage (services/metrics.py)
    ("gateway_submit", "gateway", "kvmesh_gateway_submit_seconds"),
    ("gateway_tokenize", "gateway", "kvmesh_gateway_tokenize_seconds"),
    ("gateway_upstream", "gateway", "kvmesh_gateway_upstream_first_token_seconds"),
    ("gateway_first_write", "gateway", "kvmesh_gateway_first_chunk_write_seconds"),
    ("scheduler_dispatch", "scheduler", "kvmesh_scheduler_dispatch_seconds"),
    ("scheduler_prefix_match", "scheduler", "kvmesh_scheduler_prefix_match_seconds"),
    ("worker_admit", "worker", "kvmesh_worker_request_admit_seconds"),
    ("worker_first_sync", "worker", "kvmesh_worker_first_token_sync_seconds"),
    ("worker_first_send", "worker", "kvmesh_worker_first_token_send_seconds"),
    ("detok_first_token", ("tokenizer", "gateway"), "kvmesh_detok_first_token_seconds"),  # gateway: --text-in-gateway
)
WHERE = ("gateway", "scheduler", "worker", "tokenizer")


def histograms(url: str) -> dict[str, tuple[float, float]]:
    """Every unlabelled histogram of one /metrics endpoint: name -> (count, sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode(errors="replace")
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        values = {s.name: s.value for s in family.samples if not s.labels or set(s.labels) == {"le"}}
        if f"{family.name}_count" in values:
            out[family.name] = (values[f"{family.name}_count"], values.get(f"{family.name}_sum", 0.0))
    return out


def counter(url: str, name: str) -> float:
    """One unlabelled counter of one /metrics endpoint (0 when it is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode(errors="replace")
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == name + "_total" and not s.labels)
    return 0.0


def scrape(gateway_url: str, records: Callable[[str], list]) -> dict[str, dict[str, tuple[float, float]]]:
    """{"gateway" | "scheduler" | "worker" | "tokenizer": {histogram: (count, sum)}}, summed over each
    kind's processes (their registry records' `metrics` addresses). Raises when an endpoint does not
    answer or a worker registered no metrics address; a scheduler or tokenizer without one only
    leaves its stages empty."""
    workers = records("worker")
    if not workers:
        raise RuntimeError("no worker in the registry")
    if missing := [r.id for r in workers if "metrics" not in r.addrs]:
        raise RuntimeError(f"workers {missing} registered no metrics address (--metrics-port -1?)")
    out: dict[str, dict[str, tuple[float, float]]] = {"gateway": histograms(gateway_url.rstrip("/") + "/metrics")}
    for kind in ("scheduler", "worker", "tokenizer"):
        out[kind] = {}
        for r in (workers if kind == "worker" else records(kind)):
            if "metrics" not in r.addrs:
                continue
            for name, (count, total) in histograms(r.addrs["metrics"]).items():
                c, t = out[kind].get(name, (0.0, 0.0))
                out[kind][name] = (c + count, t + total)
    return out


def stage_means(before: dict, after: dict, client_ttft_ms: float | None = None) -> dict[str, Any]:
    """Mean of each STAGE_HISTOGRAMS histogram over a run (ms; None when it counted nothing), how
    many observations it made, the client's mean TTFT beside them, and `hops_ms` (module docstring)."""
    out: dict[str, Any] = {"client_ttft_ms": None if client_ttft_ms is None else round(client_ttft_ms, 3),
                           "counts": {}}
    for key, where, name in STAGE_HISTOGRAMS:
        places = (where,) if isinstance(where, str) else where
        c0, s0 = (sum(x) for x in zip(*(before.get(p, {}).get(name, (0.0, 0.0)) for p in places)))
        c1, s1 = (sum(x) for x in zip(*(after.get(p, {}).get(name, (0.0, 0.0)) for p in places)))
        out[f"{key}_ms"] = round(1000 * (s1 - s0) / (c1 - c0), 3) if c1 > c0 else None
        out["counts"][key] = int(c1 - c0)
    parts = [out[f"{k}_ms"] for k in ("scheduler_dispatch", "worker_ttft", "worker_first_send", "detok_first_token")]
    up = out["gateway_upstream_ms"]
    out["hops_ms"] = None if up is None or None in parts else round(up - sum(parts), 3)
    return out


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def breakdown_lines(st: dict[str, Any], indent: str = "") -> list[str]:
    """The mean first-token path as text, one line per process, in the order the token crosses them."""
    g = lambda k: _f(st.get(f"{k}_ms"))  # noqa: E731
    return [
        f"{indent}client TTFT {g('client_ttft')} ms; gateway TTFT {g('gateway_ttft')} = submit {g('gateway_submit')} "
        f"(tokenize {g('gateway_tokenize')}) + upstream {g('gateway_upstream')} + hand-off; "
        f"first chunk written {g('gateway_first_write')} after its delta was read",
        f"{indent}upstream {g('gateway_upstream')} = scheduler {g('scheduler_dispatch')} (prefix match "
        f"{g('scheduler_prefix_match')}) + worker TTFT {g('worker_ttft')} + send {g('worker_first_send')} + detok "
        f"{g('detok_first_token')} + hops {g('hops')}",
        f"{indent}worker TTFT {g('worker_ttft')} = queue {g('worker_queue')} (admit {g('worker_admit')}) + prefill "
        f"{g('worker_prefill')} (of which waiting for the device {g('worker_first_sync')}); step {g('engine_step')}",
    ]
