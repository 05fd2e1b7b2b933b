"""PNG plots (matplotlib, Agg backend): latency CDFs, throughput over time, sweep curves, TTFT per
turn of a multi-turn run."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from services.bench.metrics import TimeSeries, TurnStats  # noqa: E402


# What each latency is, for the panel titles (vLLM's definitions, services/bench/README.md).
_LATENCY_TITLES = {
    "ttft": "TTFT: time to first token",
    "tpot": "TPOT: time per output token after the first",
    "itl": "ITL: gap between stream chunks",
    "e2el": "E2EL: request sent to last token",
}


def _cdf(ax, values_ms: list[float], name: str) -> None:
    ax.set_title(f"{_LATENCY_TITLES[name]} ({len(values_ms)} samples)", fontsize=10)
    ax.set_xlabel(f"{name.upper()} (ms)")
    ax.set_ylabel("fraction of samples \u2264 x")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    ax.set_ylim(0, 1.02)
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(xs, q))
        ax.axvline(v, linestyle=style, color="gray", label=f"p{q} = {v:.1f} ms")
    ax.legend(loc="best", fontsize=8)


def plot_latency_cdfs(samples_s: dict[str, list[float]], path: Path, title: str) -> Path:
    """samples_s: {'ttft': [...], 'tpot': [...], 'itl': [...], 'e2el': [...]} in seconds."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), layout="constrained")
    for ax, name in zip(axes.flat, ("ttft", "tpot", "itl", "e2el")):
        _cdf(ax, [v * 1000.0 for v in samples_s.get(name, [])], name)
    fig.suptitle(title)
    return _save(fig, path)


class Line(NamedTuple):
    x: np.ndarray  # seconds since the first request was sent
    y: np.ndarray


def throughput_lines(series: TimeSeries) -> dict[str, Line]:
    """What plot_throughput draws, both as steps-post: output tok/s per bin, closed at the last
    finish; requests in flight, exact, from 0 at the start to 0 at the last finish."""
    tok = Line(np.append(series.times, series.end), np.append(series.output_tokens_per_s, 0.0))
    flight = series.in_flight
    in_flight = Line(np.concatenate([[0.0], flight.times]), np.concatenate([[0], flight.level]))
    return {"output": tok, "in_flight": in_flight}


def plot_throughput(series: TimeSeries, path: Path, title: str) -> Path:
    return _save(throughput_figure(series, title), path)


def throughput_figure(series: TimeSeries, title: str):
    lines = throughput_lines(series)
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    out, flight = lines["output"], lines["in_flight"]
    ax.plot(out.x, out.y, drawstyle="steps-post", label=f"output tokens/s (mean over {series.bin_s:.2g} s bins)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, max(series.end, 1e-3) * 1.02)  # a little room after the last finish, where both are 0
    ax.set_xlabel("seconds since the first request was sent")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(flight.x, flight.y, drawstyle="steps-post", color="tab:orange", alpha=0.8, label="requests in flight")
    ax2.set_ylim(bottom=0, top=max(1, int(flight.y.max())) * 1.1)
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("requests in flight")
    # one legend for both axes, outside the plot so that it covers no data
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    ax.set_title(title)
    return fig


def plot_sweep(points: list[dict], path: Path, title: str) -> Path:
    """points: one dict per rate with rate label, output_throughput and TTFT/TPOT median/p99 (ms)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    xs = [p["output_throughput"] for p in points]
    for ax, name in zip(axes, ("ttft", "tpot")):
        for stat, marker in (("median", "o-"), ("p99", "s--")):
            ax.plot(xs, [p[f"{stat}_{name}_ms"] for p in points], marker, label=f"{stat} {name.upper()}")
        for x, p in zip(xs, points):
            ax.annotate(f"{p['rate']} req/s", (x, p[f"median_{name}_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_ylim(bottom=0)
        ax.margins(x=0.12)  # room for the rate labels of the outermost points
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_ttft_by_turn(rows: list[TurnStats], path: Path, title: str) -> Path:
    """Median and p99 TTFT per turn index, with the prompt's cached fraction on a second axis."""
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    turns = [r.turn for r in rows]
    ax.plot(turns, [r.median_ttft_ms for r in rows], "o-", label="median TTFT")
    ax.plot(turns, [r.p99_ttft_ms for r in rows], "s--", label="p99 TTFT")
    ax.set_xlabel("turn of the conversation (its prompt: the whole history so far + a new message)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0]
    cached = [(r.turn, 100.0 * r.cached_token_ratio) for r in rows if r.cached_token_ratio is not None]
    if cached:
        ax2 = ax.twinx()
        ax2.plot(*zip(*cached), "^:", color="tab:green", alpha=0.8, label="cached prompt tokens (%)")
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("cached prompt tokens (%)")
        handles += ax2.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    ax.set_title(title)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
