"""The planner's SLO signals, per pool, from Prometheus' HTTP API or straight off /metrics pages.

    prefill  ttft_p90_s            p90 of the prefill workers' TTFT (dispatch -> first token)
             pending_prompt_tokens prompt tokens per prefill pod with no first token yet
    decode   itl_p90_s             p90 of the gateways' inter-token latency (what clients see)
             kv_usage              mean KV-cache usage of the decode pods (0..1)

A latency quantile over a window with no request in it is 0 (nothing waited); a signal with no
series behind it, or a source that did not answer, is None (unknown: the pool does not shrink).
"""
from __future__ import annotations

import json
import logging
import math
from typing import Mapping, NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvmesh.planner")

MAX_BODY_BYTES = 8 << 20      # one Prometheus answer or /metrics page; a bigger one is refused
POOL_SIGNALS = {"prefill": ("ttft_p90_s", "pending_prompt_tokens"), "decode": ("itl_p90_s", "kv_usage")}

# PromQL of each signal; <<prefill>>, <<decode>>, <<gateway>> become the pools' label matchers.
QUERIES: dict[str, str] = {
    "ttft_p90_s": "histogram_quantile(0.9, sum by (le) "
                  "(rate(kvmesh_worker_time_to_first_token_seconds_bucket{<<prefill>>}[2m])))",
    "pending_prompt_tokens": "avg(kvmesh_worker_pending_prompt_tokens{<<prefill>>})",
    "itl_p90_s": "histogram_quantile(0.9, sum by (le) (rate(kvmesh_inter_token_latency_seconds_bucket{<<gateway>>}[2m])))",
    "kv_usage": "avg(kvmesh_kv_usage_ratio{<<decode>>})",
}
LATENCIES = {"ttft_p90_s", "itl_p90_s"}

# Scraping the pages directly: which page set and series each signal reads.
SCRAPED: dict[str, tuple[str, str]] = {
    "ttft_p90_s": ("prefill", "kvmesh_worker_time_to_first_token_seconds"),
    "pending_prompt_tokens": ("prefill", "kvmesh_worker_pending_prompt_tokens"),
    "itl_p90_s": ("gateway", "kvmesh_inter_token_latency_seconds"),
    "kv_usage": ("decode", "kvmesh_kv_usage_ratio"),
}

def query_text(signal: str, selectors: Mapping[str, str]) -> str:
    text = QUERIES[signal]
    for pool, matchers in selectors.items():
        text = text.replace(f"<<{pool}>>", matchers)
    return text


def _get(client: httpx.Client, url: str, **params: str) -> str:
    with client.stream("GET", url, params=params) as r:
        r.raise_for_status()
        body = bytearray()
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ValueError(f"{url} answered more than {MAX_BODY_BYTES} bytes")
    return body.decode()


class PrometheusSignals:
    """Each signal is one instant query at `url`/api/v1/query."""

    def __init__(self, url: str, selectors: Mapping[str, str], timeout_s: float) -> None:
        self.url = url.rstrip("/") + "/api/v1/query"
        self.selectors = selectors
        self.client = httpx.Client(timeout=timeout_s)

    def read_all(self, wanted: list[str]) -> dict[str, float | None]:
        return {signal: self.read(signal) for signal in wanted}

    def read(self, signal: str) -> float | None:
        try:
            answer = json.loads(_get(self.client, self.url, query=query_text(signal, self.selectors)))
            if answer.get("status") != "success":
                raise ValueError(str(answer.get("error", "no status"))[:200])
            result = answer["data"]["result"]
            if not result:
                return None             # no series: nothing scraped there (yet), or a wrong selector
            value = float(result[0]["value"][1])
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, IndexError, TypeError) as exc:
            log.warning("prometheus: %s failed: %s", signal, exc)
            return None
        if math.isnan(value):
            # a quantile of a window without observations; a gauge's NaN says nothing
            return 0.0 if signal in LATENCIES else None
        return value

    def close(self) -> None:
        self.client.close()


class Bucket(NamedTuple):
    le: float
    count: float      # cumulative


def histogram_quantile(q: float, buckets: list[Bucket]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets: linear inside the bucket that holds
    the q-th observation; None with no observation."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1].count <= 0:
        return None
    rank = q * buckets[-1].count
    lower_le, lower_count = 0.0, 0.0
    for b in buckets:
        if b.count >= rank:
            if math.isinf(b.le):
                return lower_le            # the highest finite bound, as Prometheus does
            if b.count == lower_count:
                return b.le
            return lower_le + (b.le - lower_le) * (rank - lower_count) / (b.count - lower_count)
        lower_le, lower_count = b.le, b.count
    return buckets[-1].le


class ScrapedSignals:
    """Reads the pages themselves: gauges averaged over the pool's pages, latency quantiles over
    the histogram buckets observed since the previous read (what `rate()` does)."""

    def __init__(self, pages: Mapping[str, list[str]], timeout_s: float) -> None:
        self.pages = pages          # "prefill" | "decode" | "gateway" -> /metrics URLs
        self.client = httpx.Client(timeout=timeout_s)
        self.last_buckets: dict[tuple[str, str], dict[float, float]] = {}   # (url, series) -> le -> count

    def read_all(self, wanted: list[str]) -> dict[str, float | None]:
        samples = {url: self._scrape(url) for urls in self.pages.values() for url in urls}
        return {signal: self._signal(signal, samples) for signal in wanted}

    def _scrape(self, url: str) -> list | None:
        try:
            return [s for f in text_string_to_metric_families(_get(self.client, url)) for s in f.samples]
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("scrape %s failed: %s", url, exc)
            return None

    def _signal(self, signal: str, samples: Mapping[str, list | None]) -> float | None:
        page_set, series = SCRAPED[signal]
        pages = [(url, samples[url]) for url in self.pages.get(page_set, [])]
        if not pages or any(s is None for _, s in pages):
            return None
        if signal not in LATENCIES:
            values = [s.value for _, page in pages for s in page if s.name == series]
            return sum(values) / len(values) if values else None
        return self._window_quantile(series, pages)

    def _window_quantile(self, series: str, pages: list) -> float | None:
        delta: dict[float, float] = {}
        first_read = False
        for url, page in pages:
            now = {float(s.labels["le"]): s.value for s in page if s.name == series + "_bucket"}
            before = self.last_buckets.get((url, series))
            self.last_buckets[(url, series)] = now
            if before is None:
                first_read = True
                continue
            # a restarted process counts from zero again: all of its count is new
            restarted = now.get(math.inf, 0.0) < before.get(math.inf, 0.0)
            for le, count in now.items():
                delta[le] = delta.get(le, 0.0) + (count if restarted else count - before.get(le, 0.0))
        if first_read:
            return None
        value = histogram_quantile(0.9, [Bucket(le, c) for le, c in delta.items()])
        return 0.0 if value is None else value

    def close(self) -> None:
        self.client.close()
