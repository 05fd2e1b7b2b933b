"""The printed summary (vLLM's layout) and the JSON result file (vLLM's key names, plus extras)."""
from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from services.bench.client import RequestResult
from services.bench.metrics import BenchmarkMetrics, TurnStats, percentile_key

_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
WIDTH = 50


def _row(label: str, value) -> str:
    if isinstance(value, float):
        return "{:<40} {:<10.2f}".format(label, value)
    return "{:<40} {:<10}".format(label, value)


def _rule(title: str, fill: str) -> str:
    return "{s:{c}^{n}}".format(s=title, n=WIDTH, c=fill)


def format_table(m: BenchmarkMetrics, percentile_metrics: list[str], percentiles: list[float],
                 request_rate: float, max_concurrency: int | None) -> str:
    lines = [_rule(" Serving Benchmark Result ", "="),
             _row("Successful requests:", m.completed),
             _row("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    lines.append(_row("Request rate configured (RPS):", "inf" if math.isinf(request_rate) else float(request_rate)))
    lines += [_row("Benchmark duration (s):", m.duration),
              _row("Total input tokens:", m.total_input),
              _row("Total generated tokens:", m.total_output),
              _row("Request throughput (req/s):", m.request_throughput)]
    if m.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", m.request_goodput))
    lines += [_row("Output token throughput (tok/s):", m.output_throughput),
              _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
              _row("Peak concurrent requests:", m.max_concurrent_requests),
              _row("Total Token throughput (tok/s):", m.total_token_throughput)]
    if m.cached_token_ratio is not None:
        lines.append(_row("Cached prompt tokens (%):", 100.0 * m.cached_token_ratio))
    for name in percentile_metrics:
        title, short = _TITLES[name]
        stats = m.latency[name]
        lines += [_rule(title, "-"),
                  _row(f"Mean {short} (ms):", stats.mean),
                  _row(f"Median {short} (ms):", stats.median),
                  _row(f"Std {short} (ms):", stats.std)]
        lines += [_row(f"P{percentile_key(p)} {short} (ms):", stats.percentiles[p]) for p in percentiles]
    if m.failure_reasons:
        lines.append(_rule("Failures by reason", "-"))
        lines += [_row(f"{reason}:", n) for reason, n in sorted(m.failure_reasons.items(), key=lambda kv: -kv[1])]
    lines.append(_rule("Token counts", "-"))
    lines.append(_row("Output tokens from:", _sources(m.output_len_sources)))
    lines.append(_row("Input tokens from:", _sources(m.input_len_sources)))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def failure_summary(results: list[RequestResult]) -> str | None:
    """One line for stderr when requests failed: how many, and why the first one did (its reason
    and the server's message, cut short); None when none failed. A run where every request failed
    measured nothing: `kvmesh bench serve` then exits 1."""
    failed = [r for r in results if not r.success]
    if not failed:
        return None
    first = min(failed, key=lambda r: r.start_time)
    why = " ".join((first.error or first.reason or "no reason given").split())   # one line, whatever the server sent
    if len(failed) == len(results):
        return f"kvmesh bench: all {len(results)} requests failed (the first: {why}); nothing was measured"
    return f"kvmesh bench: WARNING: {len(failed)} of {len(results)} requests failed (the first: {why})"


def format_turn_table(rows: list[TurnStats]) -> str:
    """Multi-turn: TTFT per turn index (how the growing history costs, or does not, when cached)."""
    head = f"{'turn':>4} {'requests':>8} {'prompt tok':>10} {'cached %':>8} {'mean TTFT':>10} {'med TTFT':>9} {'p99 TTFT':>9}"
    lines = [_rule(" TTFT by turn (ms) ", "="), head]
    for r in rows:
        cached = "-" if r.cached_token_ratio is None else f"{100.0 * r.cached_token_ratio:.1f}"
        lines.append(f"{r.turn:>4} {r.completed:>8} {r.mean_prompt_tokens:>10.0f} {cached:>8} "
                     f"{r.mean_ttft_ms:>10.2f} {r.median_ttft_ms:>9.2f} {r.p99_ttft_ms:>9.2f}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _sources(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} ({v})" for k, v in sorted(counts.items())) or "-"


def result_dict(m: BenchmarkMetrics, results: list[RequestResult], t0: float, meta: dict,
                percentiles: list[float], slos_ms: dict[str, float]) -> dict:
    """vLLM's result keys (duration, completed, ..., mean_ttft_ms, p99_ttft_ms, ttfts, itls, errors)."""
    out = dict(meta)
    out.update({
        "duration": m.duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s, "max_concurrent_requests": m.max_concurrent_requests,
    })
    for name, stats in m.latency.items():
        out[f"mean_{name}_ms"] = stats.mean
        out[f"median_{name}_ms"] = stats.median
        out[f"std_{name}_ms"] = stats.std
        for p in percentiles:
            out[f"p{percentile_key(p)}_{name}_ms"] = stats.percentiles[p]
    out.update({
        # Per-request arrays, in send order; times in seconds as vLLM stores them.
        "input_lens": m.input_lens, "output_lens": m.output_lens,
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
        # kvmesh extras.
        "tpots": m.tpots, "e2els": [r.latency for r in results],
        "start_times": [r.start_time - t0 for r in results],
        "end_times": [r.end_time - t0 for r in results],  # finished or failed
        "cached_tokens": [r.cached_tokens for r in results],
        "cached_token_ratio": m.cached_token_ratio, "failure_reasons": m.failure_reasons,
        "goodput_slos_ms": slos_ms, "output_len_sources": m.output_len_sources,
        "input_len_sources": m.input_len_sources,
        "server_prompt_tokens": [r.usage_prompt_tokens for r in results],  # None where not reported
        "turns": [r.turn for r in results],  # multi-turn: each request's turn index (0 = first), else None
        "ttft_by_turn": [row._asdict() for row in m.ttft_by_turn],
    })
    return out


def default_filename(backend: str, rate: float, max_concurrency: int | None, model: str) -> str:
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{backend}-{rate_label(rate)}qps{conc}-{Path(model).name}-{stamp}.json"


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def save_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False))
    return path
