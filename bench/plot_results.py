"""Plots BENCHMARKS.md's H200 comparison: kvmesh against vLLM 0.26.0 and transformers, per metric.

    python bench/plot_results.py   ->  bench/plots/h200_vs_peers.png

kvmesh numbers come from the stored device results (bench/results/results_*.json); vLLM's are the
figures measured with ../shared/peer-vllm/run_peer.py on the same H200 type (see BENCHMARKS.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
VLLM = {"batch-1 decode 128": 202, "batch-1 decode 8k": 224, "decode B=64": 8400, "decode B=256": 14700,
        "prefill 512": 42800, "prefill 2k": 42300, "prefill 8k": 36700, "ShareGPT total": 21000}
HF = {"batch-1 decode 128": 19.2}


def kvmesh_numbers() -> dict[str, float]:
    eng = json.loads((RESULTS_DIR / "results_gpu_bench_greedy_2026-11-29.json").read_text())["sections"]["engine"]
    ms = {k: v["value"] for k, v in eng.items()}
    offline = eng["offline throughput 1000 reqs"]["note"]
    return {
        "batch-1 decode 128": 1e3 / ms["batch-1 decode ctx=128"],
        "batch-1 decode 8k": 1e3 / ms["batch-1 decode ctx=8192"],
        "decode B=64": ms["batched decode B=64"],
        "decode B=256": ms["batched decode B=256"],
        "prefill 512": ms["prefill L=512 x64"],
        "prefill 2k": ms["prefill L=2048 x16"],
        "prefill 8k": ms["prefill L=8192 x4"],
        "ShareGPT total": float(offline.split(" total")[0]),
    }


def main() -> None:
    ours = kvmesh_numbers()
    metrics = list(VLLM)
    fig, axes = plt.subplots(2, 4, figsize=(14, 6))
    for ax, m in zip(axes.flat, metrics):
        names, values, colors = ["kvmesh", "vLLM 0.26"], [ours[m], VLLM[m]], ["#2b7bba", "#999999"]
        if m in HF:
            names.append("HF eager"), values.append(HF[m]), colors.append("#e0a030")
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        ax.set_title(f"{m} (tok/s)", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.set_ylim(0, max(values) * 1.2)
    fig.suptitle("Random Llama-3.1-8B (bf16) on one H200, higher is better", fontsize=11)
    fig.tight_layout()
    out = HERE / "plots" / "h200_vs_peers.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
