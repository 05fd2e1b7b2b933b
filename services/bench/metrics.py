"""Pure metric functions, with vLLM's definitions (benchmarks/serve.py calculate_metrics).

    TTFT  send -> first content chunk
    TPOT  per request (E2EL - TTFT) / (output_tokens - 1); requests with one token are left out of
          the TPOT statistics (and count as TPOT 0 for goodput, as in vLLM)
    ITL   every gap between successive content chunks of every request (one entry per chunk)
    E2EL  send -> last content chunk
Throughputs divide by the benchmark duration (first send -> last completion). Output tokens per
request come from usage.completion_tokens when the server reports it, else the tokenizer, else the
number of content chunks; `output_len_sources` counts which was used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from services.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class LatencyStats:  # all in milliseconds
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


@dataclass
class BenchmarkMetrics:
    duration: float
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no --goodput was given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    cached_token_ratio: float | None  # None when the server never reported cached_tokens
    latency: dict[str, LatencyStats]
    failure_reasons: dict[str, int]
    output_len_sources: dict[str, int]
    input_len_sources: dict[str, int]
    input_lens: list[int] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)  # seconds, per request (0.0 when undefined)
    ttft_by_turn: list["TurnStats"] = field(default_factory=list)  # multi-turn only


class TimeSeries(NamedTuple):
    times: np.ndarray  # (B,) bin start, seconds from the benchmark start
    output_tokens_per_s: np.ndarray  # (B,)
    concurrent_requests: np.ndarray  # (B,) the most requests in flight at any point of the bin
    bin_s: float
    end: float  # seconds from the start to the last request's finish
    in_flight: "InFlight"


class InFlight(NamedTuple):
    """Requests in flight as a step function: level[i] holds from times[i] until times[i + 1];
    the last step is the last finish, where the level is back to 0."""
    times: np.ndarray  # (E,) seconds from the start, sorted
    level: np.ndarray  # (E,)


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: expected numbers such as 50,90,99, got {text!r}") from None
    bad = [p for p in values if not 0 < p < 100]
    if bad or not values:
        raise ValueError(f"--metric-percentiles: each value must be in (0, 100), got {text!r}")
    return values


def parse_percentile_metrics(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics: unknown {bad or text!r}; choose from {','.join(METRICS)}")
    return names


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            key, sep, value = part.partition(":")
            if not sep or key not in GOODPUT_KEYS:
                raise ValueError(f"--goodput: expected KEY:MS with KEY in {','.join(GOODPUT_KEYS)}, got {part!r}")
            if float(value) < 0:
                raise ValueError(f"--goodput: {key} must be >= 0 ms, got {value}")
            slos[key] = float(value)
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values_s: list[float], percentiles: list[float]) -> LatencyStats:
    """Seconds in, milliseconds out; an empty list gives zeros (as vLLM does)."""
    arr = np.asarray(values_s or [0.0], dtype=float) * 1000.0
    return LatencyStats(float(np.mean(arr)), float(np.median(arr)), float(np.std(arr)),
                        {p: float(np.percentile(arr, p)) for p in percentiles})


def request_tpot(res: RequestResult, output_len: int) -> float:
    """(E2EL - TTFT) / (output_len - 1); 0.0 when the request produced one token or fewer."""
    return (res.latency - res.ttft) / (output_len - 1) if output_len > 1 else 0.0


def output_len(res: RequestResult, count_tokens) -> tuple[int, str]:
    """Output tokens of a successful request and where the number came from."""
    if res.usage_output_tokens is not None:
        return res.usage_output_tokens, "usage"
    if count_tokens is not None:
        return count_tokens(res.generated_text), "tokenizer"
    return res.num_chunks, "chunks"


def input_len(res: RequestResult, dataset_exact: bool) -> tuple[int, str]:
    if dataset_exact:
        return res.prompt_len, "tokenizer"
    if res.usage_prompt_tokens is not None:
        return res.usage_prompt_tokens, "usage"
    return res.prompt_len, "estimate"


def is_good(ttft: float, tpot: float, e2el: float, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    return all(values[k] * 1000.0 <= slo for k, slo in slos_ms.items())


def time_series(results: list[RequestResult], output_lens: list[int], t0: float,
                bin_s: float | None = 1.0) -> TimeSeries:
    """Output tokens per second and the most requests in flight at once, in bins of bin_s from t0;
    bin_s None: bins of about a second that divide the run evenly, the last one ending at the last
    finish (for plots: no part-empty last bin reads as a drop in throughput).

    Tokens of a chunk are spread evenly over the request's chunks (output_len / num_chunks each),
    since the stream does not say how many tokens each chunk holds.
    """
    spans = [(r.start_time - t0, max(r.end_time, r.start_time) - t0) for r in results]
    end = max([e for _, e in spans], default=0.0)
    if bin_s is None:
        bin_s = max(end, 1e-9) / max(1, round(end))
    # the last finish closes the last bin (or falls inside it), never opens one of its own
    n_bins = max(1, int(np.ceil(max(end, 1e-9) / bin_s - 1e-9)))
    tokens = np.zeros(n_bins)
    for res, n_out, (start, _) in zip(results, output_lens, spans):
        if res.success and res.num_chunks:
            chunk_times = start + res.ttft + np.concatenate([[0.0], np.cumsum(res.itl)])  # (num_chunks,)
            idx = np.minimum((chunk_times // bin_s).astype(int), n_bins - 1)
            np.add.at(tokens, idx, n_out / res.num_chunks)
    events = _events(spans)
    return TimeSeries(np.arange(n_bins) * bin_s, tokens / bin_s, _peak_in_flight(events, n_bins, bin_s), bin_s,
                      end, in_flight_steps(events))


def _events(spans: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """(time, +1) per start and (time, -1) per finish, in time order; at the same instant ends
    sort first, so that back-to-back requests don't overlap."""
    return sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])


def in_flight_steps(events: list[tuple[float, int]]) -> InFlight:
    """The exact in-flight count after each event (one step per distinct instant)."""
    times, level, now = [], [], 0
    for t, step in events:
        now += step
        if times and times[-1] == t:
            level[-1] = now  # several events at one instant: one step, to the level after all of them
        else:
            times.append(t)
            level.append(now)
    return InFlight(np.asarray(times, dtype=float), np.asarray(level, dtype=int))


def _peak_in_flight(events: list[tuple[float, int]], n_bins: int, bin_s: float) -> np.ndarray:
    """Per bin, the most requests in flight at any instant (a sweep over start/end events)."""
    peak = np.zeros(n_bins, dtype=int)
    level, last_bin = 0, 0
    for t, step in events:
        b = min(int(t // bin_s), n_bins - 1)
        peak[last_bin + 1: b + 1] = np.maximum(peak[last_bin + 1: b + 1], level)  # level held over the gap
        level += step
        peak[b] = max(peak[b], level)
        last_bin = b
    return peak


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    slos_ms: dict[str, float], count_tokens=None, dataset_exact: bool = False) -> BenchmarkMetrics:
    """Aggregate one run. count_tokens(text) -> int counts output tokens when usage is missing."""
    ttfts, tpots, itls, e2els = [], [], [], []
    in_lens, out_lens, all_tpots = [], [], []
    out_src: dict[str, int] = {}
    in_src: dict[str, int] = {}
    reasons: dict[str, int] = {}
    good = 0
    for res in results:
        if not res.success:
            reasons[res.reason] = reasons.get(res.reason, 0) + 1
            in_lens.append(res.prompt_len)
            out_lens.append(0)
            all_tpots.append(0.0)
            continue
        n_out, src = output_len(res, count_tokens)
        n_in, isrc = input_len(res, dataset_exact)
        out_src[src] = out_src.get(src, 0) + 1
        in_src[isrc] = in_src.get(isrc, 0) + 1
        in_lens.append(n_in)
        out_lens.append(n_out)
        tpot = request_tpot(res, n_out)
        all_tpots.append(tpot)
        if n_out > 1:
            tpots.append(tpot)
        ttfts.append(res.ttft)
        itls.extend(res.itl)
        e2els.append(res.latency)
        good += is_good(res.ttft, tpot, res.latency, slos_ms)
    completed = len(ttfts)
    total_in = sum(n for n, r in zip(in_lens, results) if r.success)
    total_out = sum(out_lens)
    dur = max(duration, 1e-9)
    t0 = min((r.start_time for r in results), default=0.0)
    series = time_series(results, out_lens, t0)
    cached = [(r.cached_tokens, r.usage_prompt_tokens) for r in results if r.success and r.cached_tokens is not None]
    cached_ratio = (sum(c for c, _ in cached) / max(sum(p or 0 for _, p in cached), 1)) if cached else None
    stats = {name: summarize(vals, percentiles) for name, vals in
             (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els))}
    return BenchmarkMetrics(
        duration=duration, completed=completed, failed=len(results) - completed,
        total_input=total_in, total_output=total_out,
        request_throughput=completed / dur, request_goodput=(good / dur) if slos_ms else None,
        output_throughput=total_out / dur, total_token_throughput=(total_in + total_out) / dur,
        max_output_tokens_per_s=float(series.output_tokens_per_s.max()),
        max_concurrent_requests=int(series.concurrent_requests.max()),
        cached_token_ratio=cached_ratio, latency=stats, failure_reasons=reasons,
        output_len_sources=out_src, input_len_sources=in_src,
        input_lens=in_lens, output_lens=out_lens, tpots=all_tpots, ttft_by_turn=ttft_by_turn(results),
    )


class TurnStats(NamedTuple):
    """TTFT of the completed requests of one turn index across conversations (multi-turn)."""
    turn: int  # 1 = each conversation's first turn
    completed: int
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_prompt_tokens: float  # usage.prompt_tokens where reported, else the dataset's count
    cached_token_ratio: float | None  # cached_tokens / prompt_tokens; None when never reported


def ttft_by_turn(results: list[RequestResult]) -> list[TurnStats]:
    """One row per turn index that has a completed request; [] for single-turn workloads."""
    by_turn: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.success and r.turn is not None:
            by_turn.setdefault(r.turn, []).append(r)
    rows = []
    for turn in sorted(by_turn):
        rs = by_turn[turn]
        ttfts = np.asarray([r.ttft for r in rs]) * 1000.0
        prompts = [r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_len for r in rs]
        cached = [(r.cached_tokens, p) for r, p in zip(rs, prompts) if r.cached_tokens is not None]
        ratio = sum(c for c, _ in cached) / max(sum(p for _, p in cached), 1) if cached else None
        rows.append(TurnStats(turn + 1, len(rs), float(ttfts.mean()), float(np.median(ttfts)),
                              float(np.percentile(ttfts, 99)), float(np.mean(prompts)), ratio))
    return rows
