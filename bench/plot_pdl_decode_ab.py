"""Plots the batch-1 decode step of a Llama-3.1-8B-shaped model on the H200 by way of running a
layer and by programmatic dependent launch (BENCHMARKS.md, sixth session): GPU ms of one CUDA
graph replay at 128 and 8k context, mean of two rounds, from bench/pdl_decode_ab.py's call 3
(bf16 and fp8 weights) and call 2 (the early trigger).

    python bench/plot_pdl_decode_ab.py   ->  bench/plots/h200_pdl_decode_ab.png

Reads bench/results/results_pdl_decode_ab_2026-11-29_s6.json.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
RESULTS = RESULTS_DIR / "results_pdl_decode_ab_2026-11-29_s6.json"
PDL_NAMES = {0: "", 1: " + PDL", 2: " + PDL early"}


def variants(runs: list[dict], early_only: bool = False) -> dict[tuple, list[float]]:
    """(weights, label) -> [graph ms at 128, at 8k], averaged over the rounds."""
    acc: dict[tuple, list[list[float]]] = defaultdict(list)
    for r in runs:
        if early_only and r["pdl"] != 2:
            continue
        label = r["mode"] + PDL_NAMES[r["pdl"]] + (f" pf{r['prefetch']}" if r["prefetch"] else "")
        acc[(r["weights"], label)].append([r["graph_ms_128"], r["graph_ms_8k"]])
    return {k: [sum(v[i] for v in vs) / len(vs) for i in range(2)] for k, vs in acc.items()}


def main() -> None:
    data = json.loads(RESULTS.read_text())
    rows = {**variants(data["call3"]["runs"]), **variants(data["call2"]["runs"], early_only=True)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, weights in zip(axes, ("bf16", "fp8")):
        items = sorted(((label, v) for (w, label), v in rows.items() if w == weights), key=lambda x: -x[1][0])
        ys = range(len(items))
        for i, (offset, ctx, color) in enumerate(((-0.2, "128 context", "tab:blue"), (0.2, "8k context", "tab:orange"))):
            vals = [v[i] for _, v in items]
            ax.barh([y + offset for y in ys], vals, height=0.38, color=color, label=ctx)
            for y, val in zip(ys, vals):
                ax.text(val + 0.01, y + offset, f"{val:.2f}", va="center", fontsize=7)
        ax.set_yticks(list(ys), [label for label, _ in items], fontsize=8)
        lo = min(min(v) for _, v in items)
        ax.set_xlim(lo * 0.93, max(max(v) for _, v in items) * 1.03)
        ax.set_xlabel("GPU ms per batch-1 decode step (one CUDA-graph replay)")
        ax.set_title(f"{weights} weights" + (" (call 2 for 'early')" if weights == "bf16" else ""))
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Llama-3.1-8B shapes on one H200: decode layer as cuBLAS GEMMs / fused GEMVs / plain GEMVs, "
                 "with and without programmatic dependent launch", fontsize=10)
    fig.tight_layout()
    out = HERE / "plots" / "h200_pdl_decode_ab.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
