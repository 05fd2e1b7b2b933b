"""Plots BENCHMARKS.md's serving results on the H200: kvmesh serve against vLLM's server, and
cache-aware against round-robin routing with two workers sharing the GPU.

    python bench/plot_serving.py   ->  bench/plots/h200_serving.png

kvmesh numbers come from the stored serve_bench results (bench/results/results_serve_*.json); vLLM's are
its server's figures measured on the same H200 type (../shared/peer-vllm/README.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
# vLLM 0.26.0 `vllm serve` + `vllm bench serve` on the H200 (random dataset, same lengths)
VLLM = {"c1 median TTFT (ms)": 23.4, "c1 median TPOT (ms)": 4.80, "c64 total tok/s (k)": 30.6,
        "c64 p99 ITL (ms)": 189.0}
TARGET = {"c1 median TTFT (ms)": 20.0, "c1 median TPOT (ms)": 4.3, "c64 total tok/s (k)": 35.0,
          "c64 p99 ITL (ms)": 50.0}


def single(name: str) -> dict[str, float]:
    s = json.loads((RESULTS_DIR / name).read_text())["sections"]["single"]
    return {"c1 median TTFT (ms)": s["c1"]["median_ttft_ms"], "c1 median TPOT (ms)": s["c1"]["median_tpot_ms"],
            "c64 total tok/s (k)": s["c64"]["total_token_throughput"] / 1e3, "c64 p99 ITL (ms)": s["c64"]["p99_itl_ms"]}


def routing(name: str) -> dict[str, dict[str, float]]:
    s = json.loads((RESULTS_DIR / name).read_text())["sections"]["routing"]
    out = {}
    for mode in ("cache_aware", "round_robin"):
        r = s[mode]["run"]
        out[mode] = {"hit rate (%)": 100 * r["cached_token_ratio"], "mean TTFT (ms)": r["mean_ttft_ms"],
                     "median TTFT (ms)": r["median_ttft_ms"], "median TPOT (ms)": r["median_tpot_ms"]}
    return out


def main() -> None:
    runs = {"kvmesh bf16 before (eager prefill, chunk 2048)":
                single("results_serve_single_bf16_before_prefill_graphs_2026-11-29.json"),
            "kvmesh bf16": single("results_serve_single_bf16_chunk1536_2026-11-29.json"),
            "kvmesh FP8 weights": single("results_serve_single_fp8_async_2026-11-29.json"),
            "vLLM 0.26.0 bf16": VLLM}
    route = routing("results_serve_routing_async_2026-11-29.json")
    fig, axes = plt.subplots(1, 5, figsize=(21, 4.2))
    colors = {"kvmesh bf16 before (eager prefill, chunk 2048)": "lightsteelblue", "kvmesh bf16": "tab:blue",
              "kvmesh FP8 weights": "tab:cyan", "vLLM 0.26.0 bf16": "tab:orange"}
    for ax, metric in zip(axes[:4], VLLM):
        names = list(runs)
        vals = [runs[n][metric] for n in names]
        ax.bar(range(len(names)), vals, color=[colors[n] for n in names])
        ax.axhline(TARGET[metric], color="k", ls="--", lw=1, label="target")
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1).replace(" (", "\n(") for n in names], fontsize=7)
        ax.set_title(metric + ("  (higher is better)" if "tok/s" in metric else "  (lower is better)"), fontsize=9)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.legend(fontsize=7)
    ax = axes[4]
    metrics = list(route["cache_aware"])
    width = 0.38
    for j, mode in enumerate(("cache_aware", "round_robin")):
        vals = [route[mode][m] for m in metrics]
        ax.bar([i + (j - 0.5) * width for i in range(len(metrics))], vals, width, label=mode,
               color="tab:green" if mode == "cache_aware" else "tab:gray")
        for i, v in enumerate(vals):
            ax.text(i + (j - 0.5) * width, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(metrics)), [m.replace(" (", "\n(") for m in metrics], fontsize=8)
    ax.set_title("2 workers on 1 GPU: routing", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle("kvmesh serve on one H200 (random Llama-3.1-8B weights; concurrency 1: 512/128, 64: 1024/128)",
                 fontsize=10)
    fig.tight_layout()
    out = HERE / "plots" / "h200_serving.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
