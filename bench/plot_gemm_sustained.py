"""Plots bf16 GEMM rates on the H200 in a burst and sustained (BENCHMARKS.md, tenth session): per
shape (the 8192^3 ceiling, Llama-3.1-8B's layer GEMMs at 16,384 and 2,048 tokens) and cuBLAS
backend, from bench/sweep_gemm_sustained.py, against the rate the dense GEMMs alone would need
for the bf16 prefill targets.

    python bench/plot_gemm_sustained.py   ->  bench/plots/h200_gemm_sustained.png
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
RESULTS = "results_sweep_gemm_sustained_2026-12-01_s10.json"
GFLOP_PER_TOKEN = 13.96     # Llama-3.1-8B's dense layer GEMMs, 2 x 6.98e9 weights
TARGETS = {"47k tok/s (2k target)": 47_000, "40k tok/s (8k target)": 40_000}


def main() -> None:
    rows = json.loads((RESULTS_DIR / RESULTS).read_text())
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, ax = plt.subplots(figsize=(13, 6))
    width = 0.2
    for j, (backend, kind, color) in enumerate([("cublas", "burst_tflops", "tab:blue"),
                                                ("cublas", "sustained_tflops", "navy"),
                                                ("cublaslt", "burst_tflops", "tab:orange"),
                                                ("cublaslt", "sustained_tflops", "saddlebrown")]):
        vals = {r["shape"]: r[kind] for r in rows if r["backend"] == backend}
        ax.bar([i + (j - 1.5) * width for i in range(len(shapes))], [vals[s] for s in shapes], width,
               color=color, label=f"{backend}, {kind.split('_')[0]}")
    for (label, tok_s), ls in zip(TARGETS.items(), ("--", ":")):
        need = tok_s * GFLOP_PER_TOKEN / 1000
        ax.axhline(need, color="tab:red", ls=ls, lw=1.2,
                   label=f"GEMMs alone at {label}: {need:.0f} TFLOP/s, nothing else in the step")
    ax.set_xticks(range(len(shapes)), shapes, rotation=20, ha="right", fontsize=9)
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(450, 800)
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    ax.set_title("bf16 GEMMs on one H200: ten products after a pause (burst) against 2 s back to back "
                 "(sustained, at the ~690 W cap)\n(bench/sweep_gemm_sustained.py)", fontsize=10)
    fig.tight_layout()
    out = HERE / "plots" / "h200_gemm_sustained.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
