"""`kvmesh bench chaos`: the moved streams' added latency as their detokenizers measured it.

Two readings of the same waits, which must agree:
- each detokenizer's log line per resumed stream ("request R resumed on its new worker after a
  stall of X ms", services/text/streams.py): every wait, so the quantiles are exact (nearest rank);
- the detokenizers' /metrics (kvmesh_detok_migration_stall_seconds, kvmesh_detok_migrations_total),
  summed over them: the quantiles an operator's histogram_quantile() would give, from the buckets.
The log lines' count must equal the histogram's, and their sum its sum (to the lines' rounding).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

STALL = "kvmesh_detok_migration_stall_seconds"
OUTCOMES = "kvmesh_detok_migrations_total"
LOG_LINE = re.compile(r"request \S+ resumed on its new worker after a stall of ([0-9.]+) ms")


def logged_stalls(logs: list[Path]) -> list[float]:
    """Every stall (seconds) the detokenizers logged, sorted."""
    found = []
    for path in logs:
        if path.exists():
            found += [float(m.group(1)) / 1000 for m in LOG_LINE.finditer(path.read_text(errors="replace"))]
    return sorted(found)


def scrape(urls: list[str]) -> dict:
    """parse() over the detokenizers' /metrics pages. A page that does not answer raises: the
    figures would be short without a word."""
    pages = []
    for url in urls:
        page = httpx.get(url, timeout=5)
        page.raise_for_status()
        pages.append(page.text)
    return parse(pages)


def parse(pages: list[str]) -> dict:
    """The stall histogram and outcome counts summed over Prometheus text pages:
    {"buckets": {le: cumulative count}, "count", "sum", "outcomes": {outcome: count}}."""
    buckets: dict[float, float] = {}
    total = {"count": 0.0, "sum": 0.0}
    outcomes: dict[str, float] = {}
    for text in pages:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == STALL + "_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name in (STALL + "_count", STALL + "_sum"):
                    total[s.name.rsplit("_", 1)[1]] += s.value
                elif s.name == OUTCOMES:
                    outcomes[s.labels["outcome"]] = outcomes.get(s.labels["outcome"], 0.0) + s.value
    return {"buckets": dict(sorted(buckets.items())), **total, "outcomes": outcomes}


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile of sorted values: the smallest value with at least q of them at or below it."""
    return values[max(math.ceil(q * len(values)) - 1, 0)]


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus's histogram_quantile() over cumulative buckets {le: count} (le ascending, +Inf
    last): the bucket holding rank q * count, interpolated linearly within it; in the +Inf bucket,
    the highest finite bound. NaN with no observations."""
    bounds = list(buckets)
    count = buckets[bounds[-1]] if bounds else 0.0
    if count == 0:
        return math.nan
    rank, lower, below = q * count, 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (buckets[le] - below)
        lower, below = le, buckets[le]
    return lower


def summary(logs: list[Path], urls: list[str]) -> dict:
    """The result's figures: exact p50/p99 from the log lines, the histogram's p50/p99, the counts
    of both readings and the outcomes."""
    stalls, hist = logged_stalls(logs), scrape(urls)

    def ms(seconds: float) -> float:
        return round(1000 * seconds, 1)
    observed = hist["count"] > 0
    return {
        "moved_streams": {k: int(v) for k, v in sorted(hist["outcomes"].items())},
        "moved_stall_logged": len(stalls), "moved_stall_observed": int(hist["count"]),
        "moved_stall_logged_sum_s": round(sum(stalls), 3), "moved_stall_observed_sum_s": round(hist["sum"], 3),
        "moved_added_latency_p50_ms": ms(nearest_rank(stalls, 0.5)) if stalls else 0.0,
        "moved_added_latency_p99_ms": ms(nearest_rank(stalls, 0.99)) if stalls else 0.0,
        "moved_added_latency_max_ms": ms(stalls[-1]) if stalls else 0.0,
        "moved_added_latency_hist_p50_ms": ms(bucket_quantile(hist["buckets"], 0.5)) if observed else 0.0,
        "moved_added_latency_hist_p99_ms": ms(bucket_quantile(hist["buckets"], 0.99)) if observed else 0.0,
        "stall_buckets": {str(le): int(n) for le, n in hist["buckets"].items()},
    }
