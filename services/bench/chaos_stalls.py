"""`kvmesh bench chaos`: the moved requests' added latency, as the processes that see it measured it.

A moved request is timed by one process, never two:
- resumed: one that had streamed (or whose stream its detokenizer held), from the last tokens its
  detokenizer passed on before the move to the first from its new worker (services/text/streams.py:
  kvmesh_detok_migration_stall_seconds, a log line "request R resumed on its new worker after a
  stall of X ms");
- re-sent: one its gateway sent again to a restarted scheduler before its first token, from its
  Submit to that first token (services/gateway/core.py: kvmesh_gateway_resubmit_wait_seconds, a log
  line "request R, sent again before its first token, got it X ms after its submit");
- moved early: one the scheduler moved off a stopped worker before that worker opened its stream
  (dispatched to it within its lapsing lease: its detokenizer holds nothing, "not_held"), timed by its
  gateway the same way (the same histogram, a line "request R, moved off its worker before its first
  token, ...").

Each is read twice, and the two readings must agree: the log lines (every wait, so the quantiles are
exact: nearest rank) and the /metrics pages summed over the processes (the quantiles an operator's
histogram_quantile() would give, from the buckets). The lines' count must equal the histogram's, and
their sum its sum (to the lines' rounding).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.planner.signals import Bucket, histogram_quantile

STALL = "kvmesh_detok_migration_stall_seconds"
RESENT = "kvmesh_gateway_resubmit_wait_seconds"
OUTCOMES = "kvmesh_detok_migrations_total"
STALL_LINE = re.compile(r"request \S+ resumed on its new worker after a stall of ([0-9.]+) ms")
RESENT_LINE = re.compile(r"request \S+, sent again before its first token, got it ([0-9.]+) ms after its submit")
MOVED_EARLY_LINE = re.compile(
    r"request \S+, moved off its worker before its first token, got it ([0-9.]+) ms after its submit")


def logged(logs: list[Path], line: re.Pattern) -> list[float]:
    """Every wait (seconds) the processes logged in lines matching `line`, sorted."""
    found = []
    for path in logs:
        if path.exists():
            found += [float(m.group(1)) / 1000 for m in line.finditer(path.read_text(errors="replace"))]
    return sorted(found)


def scrape(urls: list[str]) -> dict:
    """parse() over the processes' /metrics pages. A page that does not answer raises: the figures
    would be short without a word."""
    pages = []
    for url in urls:
        page = httpx.get(url, timeout=5)
        page.raise_for_status()
        pages.append(page.text)
    return parse(pages)


def _histogram() -> dict:
    return {"buckets": {}, "count": 0.0, "sum": 0.0}


def parse(pages: list[str]) -> dict:
    """Both histograms and the detokenizers' outcome counts summed over Prometheus text pages:
    {STALL: {"buckets": {le: cumulative count}, "count", "sum"}, RESENT: {...}, "outcomes": {outcome: count}}."""
    hists = {STALL: _histogram(), RESENT: _histogram()}
    outcomes: dict[str, float] = {}
    for text in pages:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                base, _, part = s.name.rpartition("_")
                if base in hists and part == "bucket":
                    le, buckets = float(s.labels["le"]), hists[base]["buckets"]
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif base in hists and part in ("count", "sum"):
                    hists[base][part] += s.value
                elif s.name == OUTCOMES:
                    outcomes[s.labels["outcome"]] = outcomes.get(s.labels["outcome"], 0.0) + s.value
    for h in hists.values():
        h["buckets"] = dict(sorted(h["buckets"].items()))
    return {**hists, "outcomes": outcomes}


def merged_buckets(*hists: dict) -> dict[float, float]:
    """Cumulative buckets of several histograms with the same bounds (both use metrics._LAT), summed."""
    out: dict[float, float] = {}
    for h in hists:
        for le, n in h["buckets"].items():
            out[le] = out.get(le, 0.0) + n
    return dict(sorted(out.items()))


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile of sorted values: the smallest value with at least q of them at or below it."""
    return values[max(math.ceil(q * len(values)) - 1, 0)]


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus's histogram_quantile() over cumulative buckets {le: count} (the planner's, which
    reads the same histograms); NaN with no observations."""
    value = histogram_quantile(q, [Bucket(le, n) for le, n in buckets.items()])
    return math.nan if value is None else value


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 1)


def _exact(prefix: str, waits: list[float]) -> dict:
    """p50 / p99 / max of sorted waits (nearest rank), in ms; 0 with none."""
    return {f"{prefix}_p50_ms": _ms(nearest_rank(waits, 0.5)) if waits else 0.0,
            f"{prefix}_p99_ms": _ms(nearest_rank(waits, 0.99)) if waits else 0.0,
            f"{prefix}_max_ms": _ms(waits[-1]) if waits else 0.0}


def summary(logs: list[Path], hist: dict) -> dict:
    """The result's figures from the processes' logs and their pages' parse() (scrape()): exact
    p50/p99 over every moved request (resumed, re-sent and moved early) and over each kind, the
    histograms' p50/p99 over all, the counts and sums of both readings (the gateways' two kinds
    share one histogram), the outcomes."""
    stalls, resent, early = logged(logs, STALL_LINE), logged(logs, RESENT_LINE), logged(logs, MOVED_EARLY_LINE)
    gateway = sorted(resent + early)
    buckets = merged_buckets(hist[STALL], hist[RESENT])
    observed = hist[STALL]["count"] + hist[RESENT]["count"] > 0
    return {
        "moved_streams": {k: int(v) for k, v in sorted(hist["outcomes"].items())},
        "moved_timed": len(stalls) + len(gateway),
        "moved_stall_logged": len(stalls), "moved_stall_observed": int(hist[STALL]["count"]),
        "moved_stall_logged_sum_s": round(sum(stalls), 3), "moved_stall_observed_sum_s": round(hist[STALL]["sum"], 3),
        "resent_wait_logged": len(resent), "moved_early_logged": len(early),
        "gateway_wait_logged": len(gateway), "gateway_wait_observed": int(hist[RESENT]["count"]),
        "gateway_wait_logged_sum_s": round(sum(gateway), 3),
        "gateway_wait_observed_sum_s": round(hist[RESENT]["sum"], 3),
        **_exact("moved_added_latency", sorted(stalls + gateway)),
        **_exact("resumed_added_latency", stalls), **_exact("resent_added_latency", resent),
        **_exact("moved_early_added_latency", early),
        "moved_added_latency_hist_p50_ms": _ms(bucket_quantile(buckets, 0.5)) if observed else 0.0,
        "moved_added_latency_hist_p99_ms": _ms(bucket_quantile(buckets, 0.99)) if observed else 0.0,
        "stall_buckets": {str(le): int(n) for le, n in buckets.items()},
    }


def untimed(migrated_moves: float, outcomes: dict[str, int], timed: int) -> dict[str, int]:
    """Moves the schedulers counted that no process timed, by why (`outcomes`: the detokenizers'
    kvmesh_detok_migrations_total, one per stream and wait):
    again: a second move within one wait, counted once by its detokenizer (moved again before its
        new worker's first tokens, or re-sent while it moved): that wait is timed once;
    no_wait: a stream its detokenizer counted that no process timed: aborted before its new
        worker's tokens (the client left, or it failed: nothing to wait for), or over before its move
        (its worker died between its last tokens and reporting it finished; not_held, and its
        gateway, which had ended the request, dropped the Moved). A Moved that reached its gateway
        after the first tokens of its new run would count here too: it is sent ahead of the
        Dispatch, one hop against the three of those tokens.
    total: the moves less the timed waits (their sum, unless a request re-sent before its first
        token was adopted where it ran: its gateway timed that wait, which no move caused)."""
    moves, streams = int(round(migrated_moves)), sum(outcomes.values())
    again, no_wait = max(moves - streams, 0), max(streams - timed, 0)
    return {"total": max(moves - timed, 0), "again": again, "no_wait": no_wait}
