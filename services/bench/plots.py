"""PNG plots (matplotlib, Agg backend): latency CDFs, throughput over time, sweep curves."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from services.bench.metrics import TimeSeries  # noqa: E402


def _cdf(ax, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(xs, q))
        ax.axvline(v, linestyle=style, color="gray", label=f"p{q} {v:.1f}")
    ax.legend(loc="lower right", fontsize=8)


def plot_latency_cdfs(samples_s: dict[str, list[float]], path: Path, title: str) -> Path:
    """samples_s: {'ttft': [...], 'tpot': [...], 'itl': [...], 'e2el': [...]} in seconds."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, ("ttft", "tpot", "itl", "e2el")):
        _cdf(ax, [v * 1000.0 for v in samples_s.get(name, [])], name.upper())
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_throughput(series: TimeSeries, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(10, 4))
    # Repeat the last value at the end edge so that steps-post draws the final bin too.
    edges = np.append(series.times, series.times[-1] + (series.times[1] - series.times[0] if len(series.times) > 1 else 1.0))
    tok = np.append(series.output_tokens_per_s, series.output_tokens_per_s[-1])
    conc = np.append(series.concurrent_requests, series.concurrent_requests[-1])
    ax.plot(edges, tok, drawstyle="steps-post", label="output tok/s")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(edges, conc, drawstyle="steps-post", color="tab:orange", alpha=0.7, label="requests in flight")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("requests in flight")
    fig.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_sweep(points: list[dict], path: Path, title: str) -> Path:
    """points: one dict per rate with rate label, output_throughput and TTFT/TPOT median/p99 (ms)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [p["output_throughput"] for p in points]
    for ax, name in zip(axes, ("ttft", "tpot")):
        for stat, marker in (("median", "o-"), ("p99", "s--")):
            ax.plot(xs, [p[f"{stat}_{name}_ms"] for p in points], marker, label=f"{stat} {name.upper()}")
        for x, p in zip(xs, points):
            ax.annotate(f"{p['rate']} rps", (x, p[f"median_{name}_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
